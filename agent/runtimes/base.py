"""The runtime contract: where vLLM lives, and how the agent starts, stops and restarts it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

from kvpilot.agent.model import Instance

RuntimeKind = Literal["local", "process", "attach", "kubernetes"]
# running: the server's main process is alive; exited: a process this runtime owned ended
# (exit_code says how); missing: no process matches; unknown: the runtime cannot tell.
InstanceState = Literal["running", "exited", "missing", "unknown"]


class RuntimeFailure(RuntimeError):
    """A runtime operation did not reach its goal; the message says which step and why."""


class RuntimeUnsupported(RuntimeFailure):
    """This runtime cannot perform the operation (e.g. `start` on an attached server)."""


class FlagsNotApplied(RuntimeUnsupported):
    """New flags were written down for a person to apply (recommend-only), not applied: a
    recommendation, not a failed restart."""


class UnknownInstance(RuntimeFailure):
    """No instance of that name is configured in this runtime."""


class NotReady(RuntimeFailure):
    """The server did not become healthy and answer a probe; carries the log tail if known."""

    def __init__(self, message: str, log_tail: str | None = None) -> None:
        text = message if not log_tail else f"{message}\n--- vLLM log tail ---\n{log_tail}"
        super().__init__(text)
        self.log_tail = log_tail


class ProcessesSurvived(RuntimeFailure):
    """Processes of the server were still alive after SIGKILL and the kill deadline."""

    def __init__(self, message: str, pids: Sequence[int]) -> None:
        super().__init__(message)
        self.pids = tuple(pids)


@dataclass(frozen=True, slots=True)
class InstanceStatus:
    """What a runtime knows about one instance's process right now.

    `since_wall_s` is when the state began as far as the runtime knows: the process's start
    time while running, or when the exit or absence was first observed.
    """

    name: str
    state: InstanceState
    main_pid: int | None
    since_wall_s: float | None
    exit_code: int | None = None  # negative: killed by that signal (subprocess convention)
    reason: str | None = None


@dataclass(frozen=True, slots=True)
class StopResult:
    """How a stop went: drained by SIGTERM within the deadline, or killed."""

    name: str
    was_running: bool  # the main process was alive when the stop began
    drained: bool  # it then exited on SIGTERM before the drain deadline
    exit_code: int | None  # None where the runtime cannot see it (not its child)
    killed_pids: tuple[int, ...]  # processes that needed SIGKILL
    elapsed_s: float


@runtime_checkable
class Runtime(Protocol):
    """Where vLLM servers live. Instances are addressed by their configured name."""

    kind: RuntimeKind

    @property
    def can_change_flags(self) -> bool:
        """Whether `restart(..., argv=...)` runs the server with new flags: the remediation
        ladder promotes the tuner's validated configuration only where it can, and elsewhere
        recommends it (the process runtime signals a server it did not start)."""
        ...

    def instances(self) -> tuple[Instance, ...]:
        """Every configured instance with its current PIDs (empty while not running)."""
        ...

    def status(self, name: str) -> InstanceStatus:
        """Running, exited (with its code) or missing, and since when."""
        ...

    async def start(self, name: str, *, ready_timeout_s: float) -> Instance:
        """Start the instance and wait until it is healthy and answers a probe."""
        ...

    async def stop(self, name: str, *, drain_timeout_s: float) -> StopResult:
        """SIGTERM the main process (vLLM drains), then SIGKILL whatever is left."""
        ...

    async def restart(
        self,
        name: str,
        *,
        drain_timeout_s: float,
        ready_timeout_s: float,
        argv: Sequence[str] | None = None,
    ) -> Instance:
        """Stop with drain, bring the server back (new argv if given), wait until ready."""
        ...

    async def aclose(self, *, drain_timeout_s: float) -> None:
        """The agent is stopping: local stops the servers it runs; process leaves them be."""
        ...
