"""What the tick leaves for the exposition to read: each watched server's latest tick, and the
sidecar's own counters. Values of the tick room, so that the app above reads them."""

from __future__ import annotations

from dataclasses import dataclass

from kvpilot.agent.tick.ticker import TickState


@dataclass(frozen=True, slots=True)
class ServerView:
    """One vLLM server the agent watches: its name, role, and latest tick."""

    server: str
    role: str
    state: TickState
    pids: frozenset[int] = frozenset()  # the server's processes, in the agent's namespace

    @property
    def labels(self) -> tuple[str, str]:
        return (self.server, self.role)


@dataclass(frozen=True, slots=True)
class SidecarCounters:
    """What the sidecar adds to the agent's metrics, read by the exposition."""

    alerts_by_state: tuple[tuple[tuple[str, str, str], int], ...]  # (alertname, state, sev)
    outbox_backlog: int | None
    notifications_total: tuple[tuple[tuple[str, str], int], ...]  # (notifier, outcome)
    remediations_total: tuple[tuple[tuple[str, str], int], ...]  # (server, decision)
    breakers_open: tuple[tuple[str, bool], ...]
    remediation_in_progress: bool
    tick_overruns_total: int = 0
    task_failures_total: tuple[tuple[str, int], ...] = ()  # (task, failures)
    state_write_errors_total: tuple[tuple[str, int], ...] = ()  # (reason, failed writes)
    mode: tuple[str, str] = ("armed", "config")  # the switch in force and its layer
