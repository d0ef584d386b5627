"""Test doubles and a harness that drives the real alert tracker and the remediator tick by tick."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from kvpilot.agent.alerts import AlertTracker, AlertTransition
from kvpilot.agent.config import RemediationConfig
from kvpilot.agent.model import Action, AlertFacts, Condition, Instance, labels_of
from kvpilot.agent.remediation import (
    LightStepResult,
    MemoryCheck,
    Remediator,
    WatchWindows,
)
from kvpilot.agent.remediation.ladder import BetterConfig, no_better_config
from tests.fakes.remediation_journal import MemoryJournal

WALL_OFFSET_S = 1_700_000_000.0


def remediation_config(**fields: Any) -> RemediationConfig:
    """The `remediation` section as the YAML would give it (sub-sections as dicts), validated."""
    return RemediationConfig.model_validate(fields)


class FakeClock:
    """A monotonic clock and a wall clock that move only when told."""

    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s

    def wall(self) -> float:
        return WALL_OFFSET_S + self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds


def make_instance(name: str = "vllm-0", role: str = "stable", pid: int = 100) -> Instance:
    return Instance(
        name=name,
        role=role,  # type: ignore[arg-type]
        url="http://127.0.0.1:8000",
        kvpool_url=None,
        pids=frozenset({pid, pid + 1}),
        main_pid=pid,
        argv=("python", "-m", "vllm.entrypoints.openai.api_server", "--model", "m"),
        started_at_wall_s=WALL_OFFSET_S,
    )


class RecordingRuntimeDouble:
    """A test double of the runtime: records restarts, gives new PIDs, can fail or hold."""

    kind = "local"

    def __init__(self, *instances: Instance, can_change_flags: bool = True) -> None:
        self.can_change_flags = can_change_flags
        self._instances = {i.name: i for i in instances}
        self.restarts: list[tuple[str, tuple[str, ...] | None, float, float]] = []
        self.failures: list[BaseException] = []  # raised by the next restarts, in order
        self.hold: asyncio.Event | None = None  # restart waits on it when set
        self.entered = 0

    def instances(self) -> tuple[Instance, ...]:
        return tuple(self._instances.values())

    async def restart(
        self,
        name: str,
        *,
        drain_timeout_s: float,
        ready_timeout_s: float,
        argv: Sequence[str] | None = None,
    ) -> Instance:
        self.entered += 1
        if self.hold is not None:
            await self.hold.wait()
        self.restarts.append(
            (name, None if argv is None else tuple(argv), drain_timeout_s, ready_timeout_s)
        )
        if self.failures:
            raise self.failures.pop(0)
        old = self._instances[name]
        new_pid = (old.main_pid or 0) + 100
        new = dataclasses.replace(
            old,
            main_pid=new_pid,
            pids=frozenset({new_pid, new_pid + 1}),
            argv=old.argv if argv is None else tuple(argv),
        )
        self._instances[name] = new
        return new


class FixedPreflight:
    """A pre-flight double that answers what it is told and records the instances checked."""

    def __init__(self, ok: bool | None, reason: str = "figures from the test") -> None:
        self.answer = MemoryCheck("cpu", ok, reason, 10, 5)
        self.checked: list[str] = []

    def check(self, instance: Instance) -> MemoryCheck:
        self.checked.append(instance.name)
        return self.answer


class RecordingLightStep:
    def __init__(self, ok: bool = True) -> None:
        self.ok = ok
        self.calls: list[str] = []

    async def reset_prefix_cache(self, instance: Instance) -> LightStepResult:
        self.calls.append(instance.name)
        return LightStepResult(self.ok, "reset" if self.ok else "refused")


def condition(
    rule: str = "fragmentation_allocator",
    instance: str = "vllm-0",
    *,
    active: bool | None = True,
    action: str = "restart",
    role: str = "stable",
    capacity_leak: bool | None = None,
    action_note: str | None = None,
) -> Condition:
    """A rule's condition: the typed facts the remediator reads, and the annotation text for
    people (`action_note`, the action's own name unless told otherwise)."""
    notes = {"action": action_note or action, "summary": f"{rule} on {instance}"}
    return Condition(
        rule=rule,
        labels=labels_of(
            {"alertname": rule, "instance": instance, "role": role, "severity": "warning"}
        ),
        active=active,
        value=1.0 if active else 0.0,
        summary=f"{rule} on {instance}",
        reason=None if active is not None else "source down",
        annotations=labels_of(notes),
        facts=AlertFacts(Action(action), capacity_leak),
    )


async def until(predicate: Callable[[], bool], what: str, max_yields: int = 2000) -> None:
    """Let the event loop run until `predicate` holds; fail after `max_yields` turns."""
    for _ in range(max_yields):
        if predicate():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"never happened: {what}")


class Harness:
    """The real AlertTracker feeding a Remediator, with a driven clock (for_s 0: fire at once)."""

    def __init__(
        self,
        config: RemediationConfig | None = None,
        *,
        windows: WatchWindows | None = None,
        runtime_drain_timeout_s: float = 0.0,
        instances: Sequence[Instance] = (),
        preflight: FixedPreflight | None = None,
        light_step: RecordingLightStep | None = None,
        better_config: BetterConfig = no_better_config,
        journal: MemoryJournal | None = None,
        can_change_flags: bool = True,
    ) -> None:
        self.clock = FakeClock()
        self.runtime = RecordingRuntimeDouble(
            *(instances or (make_instance(),)), can_change_flags=can_change_flags
        )
        self.journal = journal if journal is not None else MemoryJournal()
        self.config = config or remediation_config(preflight={"enabled": preflight is not None})
        self.tracker = AlertTracker(new_id=self._ids())
        self.remediator = Remediator(
            self.runtime,
            self.journal,
            self.config,
            windows=windows or WatchWindows(),
            runtime_drain_timeout_s=runtime_drain_timeout_s,
            preflight=preflight,
            light_step=light_step,
            better_config=better_config,
            clock=self.clock,
            wall_clock=self.clock.wall,
        )
        self.transitions: list[AlertTransition] = []

    @staticmethod
    def _ids() -> Callable[[], str]:
        counter = iter(range(1, 10_000))
        return lambda: f"inc-{next(counter)}"

    def tick(self, *conditions: Condition, advance_s: float = 1.0) -> list[asyncio.Task]:
        self.clock.advance(advance_s)
        transitions = self.tracker.update(conditions, self.clock.now_s, self.clock.wall())
        self.transitions.extend(transitions)
        return self.remediator.observe(transitions, conditions)

    def decisions(self, action: str | None = None) -> list[str]:
        return [a.decision for a in self.journal.audit if action is None or a.action == action]
