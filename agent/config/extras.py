"""The optional parts of kvpilot that a configuration needs, and which are not installed.

The core install is small (it goes into vLLM images for the plugin); the pod runtime needs
the Kubernetes client and tuning needs the scientific stack. A configuration that needs a
missing one is refused at start-up with the pip command that installs it, instead of an
ImportError at the first API call or the first trial."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

from kvpilot.agent.config.agent import AgentConfig

# Each extra of pyproject.toml that the agent may need, with the modules that tell it is there.
EXTRA_MODULES = {
    "kubernetes": ("kubernetes",),
    "tuner": ("skopt", "sklearn", "numpy", "scipy"),
}


def needed_extras(config: AgentConfig, *, tuning: bool = False) -> dict[str, str]:
    """Each extra `config` needs, with the setting that needs it. `tuning`: the command
    tunes whatever the schedule says (`kvpilot tune`)."""
    needed = {}
    if (extra := config.runtime.needed_extra) is not None:
        needed[extra] = f"runtime.kind {config.runtime.kind}"
    if tuning:
        needed["tuner"] = "tuning"
    elif config.tuning.schedule is not None:
        needed["tuner"] = "tuning.schedule"
    return needed


def missing_extras(
    needed: dict[str, str], find_spec: Callable[[str], Any] | None = None
) -> str | None:
    """One sentence naming what is missing and the command that installs it, or None."""
    find_spec = find_spec or importlib.util.find_spec
    missing = {
        extra: why
        for extra, why in needed.items()
        if any(find_spec(module) is None for module in EXTRA_MODULES[extra])
    }
    if not missing:
        return None
    reasons = "; ".join(f"{why} needs kvpilot[{extra}]" for extra, why in missing.items())
    return f"{reasons}, which is not installed: pip install 'kvpilot[{','.join(missing)}]'"
