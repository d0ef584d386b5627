"""kvpilot: memory observability and auto-tuning for vLLM."""

from importlib.metadata import PackageNotFoundError, version

try:
    # pyproject.toml is the one place the version is written; the installed metadata carries it
    # (the plugin's copy under /opt/kvpilot-plugin in vLLM's image too).
    __version__ = version("kvpilot")
except PackageNotFoundError:  # a source tree on sys.path without an install
    __version__ = "0+unknown"
