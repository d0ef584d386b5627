"""Recognise a vLLM server's command line (both launch forms) and read what the agent needs."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

LaunchForm = Literal["vllm-serve", "module"]

# `python -m <one of these>` runs the OpenAI-compatible server directly.
SERVER_MODULES = frozenset(
    {"vllm.entrypoints.openai.api_server", "vllm.entrypoints.launchers.api_server.entry"}
)
# `python -m <this> serve ...` is what the `vllm` console script runs.
CLI_MODULE = "vllm.entrypoints.cli.main"
DEFAULT_PORT = 8000
# Python options that consume the next argument (python -X dev -m ...).
_PYTHON_OPTS_WITH_VALUE = frozenset({"-X", "-W", "-Q"})
_WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "[::]"})  # noqa: S104 - matched, never bound


class NotAVllmServer(ValueError):
    """The command line is not one of vLLM's server launch forms."""


@dataclass(frozen=True, slots=True)
class ServerArgs:
    """What a vLLM server's argv says about where it listens and how it shuts down."""

    form: LaunchForm
    model: str | None
    host: str | None  # None: vLLM binds every interface
    port: int
    api_key: str | None  # the first of --api-key's values
    shutdown_timeout_s: int | None  # None: vLLM's default (0, abort in-flight requests)
    served_model_name: str | None

    @property
    def probe_host(self) -> str:
        """Where the agent reaches it: loopback when the server binds every interface."""
        if self.host is None or self.host in _WILDCARD_HOSTS:
            return "127.0.0.1"
        return f"[{self.host}]" if ":" in self.host else self.host

    @property
    def url(self) -> str:
        return f"http://{self.probe_host}:{self.port}"


def _is_python(arg0: str) -> bool:
    return os.path.basename(arg0).startswith("python")


def _is_vllm_script(arg: str) -> bool:
    return os.path.basename(arg) == "vllm"


def launch_split(argv: Sequence[str]) -> tuple[LaunchForm, list[str]] | None:
    """The launch form and the server's own arguments, or None for any other command."""
    argv = list(argv)
    if not argv:
        return None
    if _is_vllm_script(argv[0]):
        return ("vllm-serve", list(argv[2:])) if argv[1:2] == ["serve"] else None
    if not _is_python(argv[0]):
        return None
    i = 1
    while i < len(argv):
        arg = argv[i]
        if arg == "-m":
            module = argv[i + 1] if i + 1 < len(argv) else ""
            rest = list(argv[i + 2 :])
            if module in SERVER_MODULES:
                return "module", rest
            if module == CLI_MODULE and rest[:1] == ["serve"]:
                return "vllm-serve", rest[1:]
            return None
        if not arg.startswith("-"):  # a script: `python .../bin/vllm serve ...`
            rest = list(argv[i + 1 :])
            return (
                ("vllm-serve", rest[1:]) if _is_vllm_script(arg) and rest[:1] == ["serve"] else None
            )
        i += 2 if arg in _PYTHON_OPTS_WITH_VALUE else 1
    return None


def is_vllm_server(argv: Sequence[str]) -> bool:
    return launch_split(argv) is not None


def _option_values(args: Sequence[str], name: str) -> list[str] | None:
    """The values of the last `--name` (space or `=` form); nargs='+' options keep them all."""
    found: list[str] | None = None
    i = 0
    while i < len(args):
        arg = args[i]
        if arg.startswith(name + "="):
            found = [arg[len(name) + 1 :]]
        elif arg == name:
            values = []
            j = i + 1
            while j < len(args) and not args[j].startswith("--"):
                values.append(args[j])
                j += 1
            found = values
            i = j
            continue
        i += 1
    return found


def _first(args: Sequence[str], name: str) -> str | None:
    values = _option_values(args, name)
    return values[0] if values else None


def _int_option(args: Sequence[str], name: str) -> int | None:
    text = _first(args, name)
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        raise NotAVllmServer(f"{name} must be an integer, got {text!r}") from None


def parse_server_argv(argv: Sequence[str]) -> ServerArgs:
    """Parse either launch form; raises NotAVllmServer for anything else."""
    split = launch_split(argv)
    if split is None:
        raise NotAVllmServer(
            "not a vLLM server command line: expected `vllm serve MODEL ...` or "
            f"`python -m vllm.entrypoints.openai.api_server --model MODEL ...`, got {list(argv)!r}"
        )
    form, args = split
    model = _first(args, "--model")
    if form == "vllm-serve" and args and not args[0].startswith("-"):
        model = args[0]  # `vllm serve MODEL`: the positional comes first by convention
    port = _int_option(args, "--port")
    return ServerArgs(
        form=form,
        model=model,
        host=_first(args, "--host"),
        port=DEFAULT_PORT if port is None else port,
        api_key=_first(args, "--api-key"),
        shutdown_timeout_s=_int_option(args, "--shutdown-timeout"),
        served_model_name=_first(args, "--served-model-name"),
    )


def redacted(argv: Sequence[str]) -> list[str]:
    """The argv with `--api-key` values replaced, for logs."""
    out, hiding = [], False
    for arg in argv:
        if arg.startswith("--api-key="):
            out.append("--api-key=***")
            hiding = False
        elif arg == "--api-key":
            out.append(arg)
            hiding = True
        elif hiding and not arg.startswith("--"):
            out.append("***")
        else:
            out.append(arg)
            hiding = False
    return out
