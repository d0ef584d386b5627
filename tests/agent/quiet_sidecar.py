"""For API tests: an attach configuration whose one server nothing answers, and a sidecar
with no notifiers, the remediator of its own runtime, and NVML that sees no server process
(the fake library, or none, answers for the GPUs)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvpilot.agent.app.parts import tick_settings
from kvpilot.agent.config import AgentConfig
from kvpilot.agent.remediation import Remediator
from kvpilot.agent.runtimes.base import Runtime
from kvpilot.agent.state.store import StateStore
from kvpilot.agent.tick.sidecar import Sidecar
from kvpilot.agent.tick.watched import WatchedServers
from kvpilot.collectors.nvml import NvmlCollector


def attach_config(tmp_path: Path) -> AgentConfig:
    """Attach to one server `vllm` at a port nothing listens on; its state folder made."""
    config = AgentConfig.model_validate(
        {
            "state_dir": str(tmp_path / "state"),
            "runtime": {
                "kind": "attach",
                "servers": [{"name": "vllm", "url": "http://127.0.0.1:9"}],
            },
        }
    )
    config.state_dir.mkdir(parents=True)
    return config


def quiet_sidecar(
    config: AgentConfig, store: StateStore, runtime: Runtime, **extra: Any
) -> Sidecar:
    """`extra` goes to `Sidecar` as it is (an `after` hook, say)."""
    return Sidecar(
        tick_settings(config),
        store=store,
        runtime=runtime,
        notifiers={},
        remediator=Remediator(runtime, store, config.remediation),
        watched=WatchedServers(tick_settings(config), NvmlCollector(server_pids=frozenset)),
        **extra,
    )
