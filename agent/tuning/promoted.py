"""Which flags the stable instance runs, and why: the one decision between configured and
promoted flags, used to start it (`kvpilot run`, `kvpilot tune`) and to label it
(the live-flags metric).

A promotion is stored as a fact with the hash of the configuration it was promoted under:
the tuned server's configured argv as loaded (after `KVPILOT_*` overrides), its secrets
masked. Promoted flags win over the configured ones until that argv changes: a comment or
any other part of the YAML edited is no change; an override of the argv (the model, say) is
one. Without a file (flags from the command line only), the configured flags run.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

from kvpilot.agent.config import InstanceConfig
from kvpilot.agent.config.runtime import RuntimeConfig
from kvpilot.agent.state.store import StateStore
from kvpilot.collectors.secrets import SecretLost, mask_argv, restore_secrets

# {"argv": [...], "yaml_sha256": ..., "reason": ...}; the argv's secrets stored masked.
PROMOTED_FACT = "tuning.promoted"
# The hash of the YAML the running agent decided its flags under: {"yaml_sha256": ...}.
RUNNING_CONFIG_FACT = "agent.config"


def configured_hash(runtime: RuntimeConfig) -> str:
    """sha256 of the tuned server's configured argv as loaded, its secrets masked (a rotated
    API key keeps the promotion; the key comes back from the configured argv): a promotion
    holds while it is unchanged."""
    tuned = tuned_instance(runtime)
    argv = mask_argv(tuned.argv) if tuned is not None else []
    text = json.dumps({"configured_argv": argv}, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def yaml_hash(path: Path) -> str:
    """`configured_hash` of the configuration at `path`, loaded as `kvpilot run` loads it
    (with this process's `KVPILOT_*` overrides)."""
    from kvpilot.agent.config.load import load_config

    return configured_hash(load_config(path, os.environ, warn=False).runtime)


class Why(StrEnum):
    """Why the live flags are what they are."""

    CONFIGURED = "configured"  # nothing promoted (or no YAML to hold a promotion to)
    PROMOTED = "promoted"  # the tuner's, under this very configured argv
    YAML_CHANGED = "yaml_changed"  # configured: its argv changed since the last promotion


@dataclass(frozen=True, slots=True)
class LiveArgv:
    """The stable instance's flags and why."""

    argv: tuple[str, ...]
    why: Why
    promotion_reason: str | None = None  # what the tuner said when it promoted

    @property
    def source(self) -> Literal["configured", "promoted"]:
        return "promoted" if self.why is Why.PROMOTED else "configured"

    def describe(self) -> str:
        if self.why is Why.PROMOTED:
            return f"promoted ({self.promotion_reason or 'by the tuner'})"
        if self.why is Why.YAML_CHANGED:
            return "configured (its argv changed since the last promotion)"
        return "configured"

    def source_of(self, running: Sequence[str]) -> Literal["configured", "promoted"]:
        """Where the flags a server runs now came from: this decision's source when they
        are its flags; flags the tuner set since (a trial under way) are not configured."""
        return self.source if tuple(running) == self.argv else "promoted"


def live_argv(
    configured: Sequence[str], promoted: Mapping[str, Any] | None, config_sha256: str | None
) -> LiveArgv:
    """The flags to run: the promoted ones while the configuration (`config_sha256`, see
    `configured_hash`) is the one they were promoted under, else the configured ones."""
    if promoted and config_sha256 is not None and promoted.get("yaml_sha256") == config_sha256:
        try:
            # Stored masked: the secrets come back from the YAML they were promoted under.
            argv = restore_secrets(promoted["argv"], configured)
        except SecretLost:
            return LiveArgv(tuple(configured), Why.CONFIGURED)
        return LiveArgv(argv, Why.PROMOTED, promoted.get("reason"))
    if promoted and config_sha256 is not None:
        return LiveArgv(tuple(configured), Why.YAML_CHANGED)
    return LiveArgv(tuple(configured), Why.CONFIGURED)


def tuned_instance(runtime: RuntimeConfig) -> InstanceConfig | None:
    """The instance the tuner tunes and promotes for: the first stable one of those kvpilot
    starts (the local runtime's)."""
    return next((i for i in runtime.started_instances if i.role == "stable"), None)


def instance_live_argv(
    runtime: RuntimeConfig, store: StateStore, name: str, config_sha256: str | None
) -> LiveArgv | None:
    """Instance `name`'s flags and why (a promotion counts for the tuned instance only), or
    None for a server whose flags kvpilot does not set (the process runtime's)."""
    inst = next((i for i in runtime.started_instances if i.name == name), None)
    if inst is None:
        return None
    tuned = tuned_instance(runtime)
    promoted = store.get_fact(PROMOTED_FACT) if tuned is not None and tuned.name == name else None
    return live_argv(inst.argv, promoted, config_sha256)


def record_running_config(store: StateStore, config_sha256: str | None, now_wall_s: float) -> None:
    """Note the YAML the running agent decided its flags under (None: it has no file)."""
    if config_sha256 is None:
        store.delete_fact(RUNNING_CONFIG_FACT)
    else:
        store.set_fact(RUNNING_CONFIG_FACT, {"yaml_sha256": config_sha256}, now_wall_s)


def running_flags_source(
    runtime: RuntimeConfig, store: StateStore, name: str, running: Sequence[str]
) -> Literal["configured", "promoted"]:
    """Where the flags instance `name` runs now came from, decided under the YAML the running
    agent noted at start-up (the live-flags metric's label)."""
    noted = store.get_fact(RUNNING_CONFIG_FACT)
    sha = noted.get("yaml_sha256") if isinstance(noted, Mapping) else None
    live = instance_live_argv(runtime, store, name, sha)
    return "configured" if live is None else live.source_of(running)
