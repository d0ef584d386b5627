"""Servers known only by their URLs: watched and alerted on, never signalled or restarted.

This is `kvpilot run --vllm-url` and a node agent that watches many servers something else
runs. Without a process there is nothing to stop, so every action is `RuntimeUnsupported`
and remediation records a refusal instead of acting.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvpilot.agent.model import Instance, Role
from kvpilot.agent.runtimes.base import (
    InstanceStatus,
    RuntimeKind,
    RuntimeUnsupported,
    StopResult,
    UnknownInstance,
)

NO_PROCESS = "attached by URL: kvpilot sees no process"


@dataclass(frozen=True, slots=True)
class AttachedServer:
    """One watched server; `pids` (optional) tell its processes apart in NVML."""

    name: str
    url: str
    kvpool_url: str | None = None
    role: Role = "stable"
    pids: frozenset[int] = frozenset()
    model_config: Path | None = None


class AttachRuntime:
    kind: RuntimeKind = "attach"
    can_change_flags = False  # it never restarts

    def __init__(self, servers: Sequence[AttachedServer]) -> None:
        self._servers = {server.name: server for server in servers}
        self._instances = tuple(
            Instance(
                name=s.name,
                role=s.role,
                url=s.url,
                kvpool_url=s.kvpool_url,
                pids=s.pids,
                main_pid=None,
                argv=None,
                started_at_wall_s=None,
                model_config=s.model_config,
            )
            for s in servers
        )

    def instances(self) -> tuple[Instance, ...]:
        return self._instances

    def status(self, name: str) -> InstanceStatus:
        if name not in self._servers:
            raise UnknownInstance(name)
        return InstanceStatus(name, "unknown", None, None, reason=NO_PROCESS)

    async def start(self, name: str, *, ready_timeout_s: float) -> Instance:
        raise RuntimeUnsupported(f"{name}: {NO_PROCESS}, so it cannot be started")

    async def stop(self, name: str, *, drain_timeout_s: float) -> StopResult:
        raise RuntimeUnsupported(f"{name}: {NO_PROCESS}, so it cannot be stopped")

    async def restart(
        self,
        name: str,
        *,
        drain_timeout_s: float,
        ready_timeout_s: float,
        argv: Sequence[str] | None = None,
    ) -> Instance:
        raise RuntimeUnsupported(f"{name}: {NO_PROCESS}, so it cannot be restarted")

    async def aclose(self, *, drain_timeout_s: float) -> None:
        return None
