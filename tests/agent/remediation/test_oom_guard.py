"""The OOM guard through the real remediator: steps, guards, promotion, alert, advice.

The runtime is a recording double (nothing real can die of memory safely here); the cgroup
count is a real file the test writes; the journal is the memory journal."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from kvpilot.agent.config.remediation import OomConfig
from kvpilot.agent.model import Action, AlertFacts, Instance
from kvpilot.agent.remediation import MemoryCheck, Remediator, Trigger
from kvpilot.agent.remediation.oom.guard import SERVER_OOM_ALERT, OomGuard
from kvpilot.agent.remediation.oom.startup import start_guarded
from kvpilot.agent.remediation.trigger import RemediationOutcome
from kvpilot.agent.runtimes.base import InstanceStatus
from kvpilot.agent.runtimes.probe import START_MARKER, StartFailed
from kvpilot.agent.state.decision import Decision
from kvpilot.collectors.vllm_argv import flag_value
from kvpilot.tuner.oom import GIB, MIB
from kvpilot.tuner.planner.preflight import KnobRange
from tests.fakes.remediation_journal import MemoryJournal

from .remediation_helpers import (
    RecordingRuntimeDouble,
    condition,
    make_instance,
    remediation_config,
)

KV = "--kv-cache-memory-bytes"
OVER = (
    "ValueError: Available memory on node 0 (2.0/23.54 GiB) on kv cache allocation is less "
    "than requested memory for kv (100.0 GiB)."
)
RANGE = KnobRange("kv_cache_memory_bytes", float(MIB), float(1024 * GIB), "one request", "avail")


class DyingRuntime(RecordingRuntimeDouble):
    """The double, with an exit and a log: what the local runtime shows after a death."""

    def __init__(self, instance: Instance, *, can_change_flags: bool = True) -> None:
        super().__init__(instance, can_change_flags=can_change_flags)
        self.exit_code: int | None = 1
        self.log = ""
        self.start_fails = 0

    def status(self, name: str) -> InstanceStatus:
        if self.exit_code is None:
            return InstanceStatus(name, "running", 200, 0.0)
        return InstanceStatus(name, "exited", None, 0.0, exit_code=self.exit_code)

    def log_tail(self, name: str, max_chars: int = 4000) -> str:
        return self.log[-max_chars:]

    async def start(self, name: str, *, ready_timeout_s: float) -> Instance:
        if self.start_fails:
            self.start_fails -= 1
            raise StartFailed("exited before it was ready", self.log)
        self.exit_code = None
        return self.instances()[0]

    async def restart(self, name: str, **kw: object) -> Instance:
        new = await super().restart(name, **kw)  # type: ignore[arg-type]
        self.exit_code = None
        return new


def _instance(kv_bytes: int = 100 * GIB) -> Instance:
    base = make_instance()
    return Instance(
        **{
            **{f: getattr(base, f) for f in base.__slots__},  # type: ignore[arg-type]
            "argv": (*(base.argv or ()), KV, str(kv_bytes)),
        }
    )


class Rig:
    def __init__(self, tmp: Path, *, can_change_flags: bool = True, **remediation: object) -> None:
        self.events = tmp / "memory.events"
        self.events.write_text("oom 0\noom_kill 0\n")
        self.runtime = DyingRuntime(_instance(), can_change_flags=can_change_flags)
        section = remediation_config(
            **{"cooldown_s": 0.0, "preflight": {"enabled": False}, **remediation}
        )
        self.promoted: list[tuple[str, tuple[str, ...], str]] = []
        self.guard = OomGuard(
            section.oom, self.runtime, lambda name, argv: RANGE, events_file=self.events
        )
        self.remediator = Remediator(
            self.runtime,
            MemoryJournal(),
            section,
            oom=self.guard,
            on_promoted=lambda *args: self.promoted.append(args),
        )

    def oom_kill(self) -> None:
        count = int(self.events.read_text().split()[-1])
        self.events.write_text(f"oom 0\noom_kill {count + 1}\n")

    def argv_now(self) -> Sequence[str]:
        return self.runtime.instances()[0].argv or ()


CLEARED = condition("server_down", active=False)


def down(n: int = 1, action: Action = Action.RESTART) -> Trigger:
    return Trigger(
        "vllm-0", "server_down", CLEARED.fingerprint, f"inc-{n}", facts=AlertFacts(action)
    )


def remediate(rig: Rig, trigger: Trigger) -> RemediationOutcome:
    """One remediation to its end; the server_down condition clears after any restart."""

    async def main() -> RemediationOutcome:
        task = asyncio.create_task(rig.remediator.remediate(trigger))
        for _ in range(2000):
            if task.done():
                break
            if rig.runtime.restarts:
                rig.remediator.observe([], [CLEARED])
            await asyncio.sleep(0)
        return await task

    return asyncio.run(main())


def test_a_start_up_too_big_is_stepped_down_promoted_and_alerted(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.runtime.start_fails = 1
    rig.runtime.log = f"{START_MARKER}1 =====\n{OVER}\nEngine core initialization failed"
    asyncio.run(start_guarded(rig.runtime, rig.remediator, "vllm-0", ready_timeout_s=1))
    (restart,) = rig.runtime.restarts
    stepped = int(flag_value(restart[1] or (), KV) or 0)
    assert stepped == int(1.8 * GIB) // MIB * MIB  # what was available less 10 %
    assert rig.promoted and rig.promoted[0][1] == restart[1]
    assert "available" in rig.promoted[0][2]  # the reason goes with the promotion
    events = rig.remediator.take_events()
    assert [(dict(e.labels)["alertname"], e.status) for e in events] == [
        (SERVER_OOM_ALERT, "firing")
    ]
    assert dict(events[0].annotations)["direction"] == "too_big"
    assert [e.status for e in rig.remediator.take_events()] == ["resolved"]  # it runs again


def test_a_mid_run_oom_kill_is_read_from_the_cgroup_count(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.guard.started("vllm-0")
    rig.oom_kill()
    rig.runtime.exit_code, rig.runtime.log = -signal.SIGKILL, "INFO serving\n"
    outcome = remediate(rig, down())
    assert outcome.decision is Decision.SUCCEEDED
    assert flag_value(rig.argv_now(), KV) == str(75 * GIB)  # the configured 25 % step
    assert dict(rig.remediator.take_events()[0].annotations)["evidence"] == "oom_killer"


def test_a_sigkill_that_is_not_the_oom_killer_restarts_with_the_same_flags(
    tmp_path: Path,
) -> None:
    rig = Rig(tmp_path)
    rig.guard.started("vllm-0")
    rig.runtime.exit_code = -signal.SIGKILL  # the count did not rise
    outcome = remediate(rig, down())
    assert outcome.decision is Decision.SUCCEEDED
    assert rig.runtime.restarts[0][1] is None and not rig.promoted
    assert rig.remediator.take_events() == []


def test_the_budget_stops_a_repeating_oom(tmp_path: Path) -> None:
    rig = Rig(tmp_path, budget={"max_restarts": 1, "window_s": 3600})
    rig.guard.started("vllm-0")
    for n in (1, 2, 3):
        rig.oom_kill()
        rig.runtime.exit_code = -signal.SIGKILL
        remediate(rig, down(n))
    assert len(rig.runtime.restarts) == 1  # the budget refused the others


def test_failed_steps_open_the_breaker_and_the_start_up_loop_ends(tmp_path: Path) -> None:
    rig = Rig(tmp_path, circuit_breaker={"failures_to_open": 2}, oom={"max_steps": 5})
    rig.runtime.start_fails = 1
    rig.runtime.log = f"{START_MARKER}1 =====\n{OVER}\n"
    rig.runtime.failures = [StartFailed("again", OVER) for _ in range(5)]
    with pytest.raises(StartFailed):
        asyncio.run(start_guarded(rig.runtime, rig.remediator, "vllm-0", ready_timeout_s=1))
    assert len(rig.runtime.restarts) == 2  # then the breaker is open: no third
    assert rig.remediator.breaker.state("vllm-0", time.monotonic()) == "open"


def test_the_process_runtime_recommends_the_stepped_flags(tmp_path: Path) -> None:
    rig = Rig(tmp_path, can_change_flags=False)
    rig.guard.started("vllm-0")
    rig.oom_kill()
    rig.runtime.exit_code = None  # not its child: no exit code, it may run again already
    outcome = remediate(rig, down())
    assert outcome.decision is Decision.RECOMMENDED and rig.runtime.restarts == []
    events = {dict(e.labels)["alertname"]: e for e in rig.remediator.take_events()}
    suggested = dict(events[SERVER_OOM_ALERT].annotations)["suggested_flags"]
    assert f"{KV} {75 * GIB}" in suggested
    assert "recommended_flags" in dict(events["KvpilotTuningRecommended"].annotations)


def test_an_alert_only_server_down_is_suggested_not_applied(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.guard.started("vllm-0")
    rig.oom_kill()
    rig.runtime.exit_code = -signal.SIGKILL
    outcome = remediate(rig, down(action=Action.ALERT))
    assert outcome.decision is Decision.ALERT_ONLY and rig.runtime.restarts == []
    (event,) = rig.remediator.take_events()
    assert "suggested_flags" in dict(event.annotations)


def test_disabled_the_guard_is_not_asked(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    guard = OomGuard(
        OomConfig(enabled=False), rig.runtime, lambda n, a: RANGE, events_file=rig.events
    )
    assert guard.plan(down(), rig.runtime.instances()[0]) is None


class ArgvPreflight:
    """A pre-flight double that records the flags it was asked about."""

    def __init__(self) -> None:
        self.checked: list[tuple[str, ...]] = []

    def check(self, instance: Instance) -> MemoryCheck:
        self.checked.append(tuple(instance.argv or ()))
        return MemoryCheck("cpu", True, "fits", 10, 5)


def test_the_memory_pre_flight_checks_the_stepped_flags(tmp_path: Path) -> None:
    rig = Rig(tmp_path, preflight={"enabled": True})
    checks = ArgvPreflight()
    rig.remediator = Remediator(
        rig.runtime, MemoryJournal(), rig.remediator.config, oom=rig.guard, preflight=checks
    )
    rig.guard.started("vllm-0")
    rig.oom_kill()
    rig.runtime.exit_code = -signal.SIGKILL
    assert remediate(rig, down()).decision is Decision.SUCCEEDED
    assert [flag_value(argv, KV) for argv in checks.checked] == [str(75 * GIB)]
