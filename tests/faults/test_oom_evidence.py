"""Faults in the OOM guard's evidence: a damaged cgroup file, a log without a reason, a step
the planner's pre-flight refuses. Each is a clear reason, never a traceback or a loop."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from kvpilot.agent.config.remediation import OomConfig
from kvpilot.agent.remediation.oom.cgroup import read_oom_kills
from kvpilot.agent.remediation.oom.step import NoStep, plan_step
from kvpilot.agent.state.decision import Decision
from kvpilot.tuner.oom import (
    MIB,
    ExitFacts,
    NotOom,
    OomDirection,
    OomSource,
    OomVerdict,
    classify_exit,
)
from kvpilot.tuner.planner.preflight import KnobRange
from tests.agent.remediation.test_oom_guard import SERVER_OOM_ALERT, Rig, down, remediate

DAMAGED = [
    "",
    "oom_kill\n",
    "oom_kill many\n",
    "oom_kill -3\n",
    "oom 1\nlow 0\n",
    "\x00\x01\x02 oom_kill",
    "oom_kill 1 2\n",
]


@pytest.mark.parametrize("text", DAMAGED)
def test_a_damaged_memory_events_is_none_with_a_reason(tmp_path: Path, text: str) -> None:
    path = tmp_path / "memory.events"
    path.write_text(text)
    count = read_oom_kills(path)
    assert count.count is None and count.reason and str(path) in count.reason


def test_undecodable_bytes_are_a_reason(tmp_path: Path) -> None:
    path = tmp_path / "memory.events"
    path.write_bytes(b"\xff\xfe oom_kill 1")
    count = read_oom_kills(path)
    assert count.count is None and count.reason


def test_a_damaged_count_leaves_a_sigkill_unclassified_and_restarts_plainly(
    tmp_path: Path,
) -> None:
    rig = Rig(tmp_path)
    rig.guard.started("vllm-0")
    rig.events.write_text("oom_kill lots\n")
    rig.runtime.exit_code = -signal.SIGKILL
    outcome = remediate(rig, down())
    assert outcome.decision is Decision.SUCCEEDED
    assert rig.runtime.restarts[0][1] is None  # the same flags: no evidence of memory
    assert rig.remediator.take_events() == []


def test_a_log_without_a_reason_is_not_memory() -> None:
    for text in ("", "INFO up\nRuntimeError: Engine core initialization failed.\n", "\x00" * 50):
        verdict = classify_exit(ExitFacts(1, text))
        assert isinstance(verdict, NotOom) and verdict.reason


def test_a_step_below_the_planners_minimum_is_refused() -> None:
    verdict = OomVerdict(OomDirection.TOO_BIG, OomSource.LOG, "over", None, 8 * MIB, MIB)
    floor = KnobRange("kv_cache_memory_bytes", 2 * MIB, None, "one request of max_model_len")
    argv = ("vllm", "serve", "m", "--kv-cache-memory-bytes", str(8 * MIB))
    step = plan_step(argv, verdict, OomConfig(), floor)
    assert isinstance(step, NoStep)
    assert "below the planner's minimum" in step.reason and "one request" in step.reason


def test_a_refused_step_is_alerted_and_never_restarted(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.guard._range_for = lambda name, argv: KnobRange(  # type: ignore[method-assign]
        "kv_cache_memory_bytes", float(200 << 30), None, "one request of max_model_len"
    )
    rig.guard.started("vllm-0")
    rig.oom_kill()
    rig.runtime.exit_code = -signal.SIGKILL
    outcome = remediate(rig, down())
    assert outcome.decision is Decision.ALERT_ONLY and rig.runtime.restarts == []
    (event,) = rig.remediator.take_events()
    assert dict(event.labels)["alertname"] == SERVER_OOM_ALERT
    assert "pre-flight refused" in dict(event.annotations)["description"]


def test_the_planner_that_cannot_read_the_model_is_a_reason(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.guard._range_for = lambda name, argv: "no config.json"  # type: ignore[method-assign]
    rig.guard.started("vllm-0")
    rig.oom_kill()
    rig.runtime.exit_code = -signal.SIGKILL
    outcome = remediate(rig, down())
    assert outcome.decision is Decision.ALERT_ONLY and "no config.json" in outcome.reason
