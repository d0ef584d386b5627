"""Thrash per request on the preemption spike and admission rejections on KV saturation, read
from series derived from vLLM 0.32's source (tests/fixtures/vllm), then through the ladder."""

from __future__ import annotations

from pathlib import Path

from kvpilot.agent.model import Action
from kvpilot.agent.remediation import plan_for
from kvpilot.agent.rules.config import KvSaturationConfig, PreemptionSpikeConfig
from kvpilot.agent.rules.preemption import PreemptionSpikeRule
from kvpilot.agent.rules.saturation import KvSaturationRule
from kvpilot.collectors.vllm_metrics import EngineSample
from kvpilot.collectors.vllm_parse import parse_vllm_metrics
from tests.agent.rules.rules_helpers import Driver, annotation, only

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "vllm"
ARGV = ("vllm", "serve", "m", "--max-num-seqs", "64")


def _series(stem: str, stamps: tuple[float, ...] = (0.0, 30.0)) -> list[EngineSample]:
    return [
        parse_vllm_metrics(
            (FIXTURES / f"{stem}_{i}.prom").read_text(), taken_at_s=t, wall_time_s=t
        )[0]
        for i, t in enumerate(stamps)
    ]


def _spike(stem: str):  # type: ignore[no-untyped-def]
    driver = Driver(PreemptionSpikeRule(PreemptionSpikeConfig()))
    out = [only(driver.tick(s.taken_at_s, engines=[s])) for s in _series(stem)]
    return out[-1]


def test_the_same_requests_preempted_again_and_again_are_thrash_and_cap_first() -> None:
    fired = _spike("derived_preemptions_thrash")
    # 28 preemptions in 30 s, 8 of the 20 requests finished in the window preempted 3 times.
    assert fired.active is True and fired.facts.thrash is True
    text = annotation(fired, "thrash") or ""
    assert text.startswith("true: 40% of 20 finished requests") and "1.40 preemptions" in text
    assert "thrash: true" in (annotation(fired, "description") or "")
    plan = plan_for(
        "preemption_spike", fired.facts, "vllm-0", light_step_enabled=False, current_argv=ARGV
    )
    assert plan.steps == ("recommend_config",) and plan.argv == (
        *ARGV,
        "--max-num-active-seqs",
        "48",
    )
    assert plan.reason.startswith("no capacity-leak signature; thrash")


def test_a_burst_spread_over_many_requests_is_not_thrash_and_asks_for_a_larger_budget() -> None:
    fired = _spike("derived_preemptions_spread")
    # The same 28 preemptions in 30 s, each on its own request.
    assert fired.active is True and fired.facts.thrash is False
    assert (annotation(fired, "thrash") or "").startswith("false: 0% of 28 finished requests")
    plan = plan_for(
        "preemption_spike", fired.facts, "vllm-0", light_step_enabled=False, current_argv=ARGV
    )
    assert plan.steps == ("recommend_tuning",) and plan.argv is None
    assert "burst spread over many requests" in plan.reason


def test_thrash_is_unknown_when_no_request_finished_in_the_window() -> None:
    driver = Driver(PreemptionSpikeRule(PreemptionSpikeConfig()))
    (first,) = _series("derived_preemptions_thrash", (0.0,))
    c = only(driver.tick(0.0, engines=[first]))
    assert c.facts.thrash is None
    assert (annotation(c, "thrash") or "").startswith("unknown")


def test_rejections_while_saturated_are_typed_and_keep_the_cap_off_the_advice() -> None:
    driver = Driver(KvSaturationRule(KvSaturationConfig()))
    conditions = [
        only(driver.tick(s.taken_at_s, engines=[s]))
        for s in _series("derived_deferred", (0.0, 15.0, 30.0))
    ]
    assert conditions[0].facts.admission_refused is None  # one reading: no increase yet
    fired = conditions[-1]
    # Usage 0.995 with 7 waiting, and the queue limit refused 31 requests in the 30 s.
    assert fired.active is True and fired.facts.admission_refused is True
    assert fired.facts.action is Action.LADDER
    text = "31 requests refused by a queue limit in 30 s"
    assert annotation(fired, "admission_rejections") == text
    assert text in (annotation(fired, "description") or "")
    plan = plan_for(
        "kv_saturation", fired.facts, "vllm-0", light_step_enabled=False, current_argv=ARGV
    )
    assert plan.steps == ("recommend_tuning",) and not plan.restarts
    assert "a queue limit already refuses requests" in plan.reason


def test_saturation_without_rejections_keeps_the_lower_cap() -> None:
    real = parse_vllm_metrics(
        (FIXTURES / "v0_32_under_load.prom").read_text(), taken_at_s=0.0, wall_time_s=0.0
    )[0]
    driver = Driver(KvSaturationRule(KvSaturationConfig()))
    driver.tick(0.0, engines=[real])
    later = parse_vllm_metrics(
        (FIXTURES / "v0_32_under_load.prom").read_text(), taken_at_s=10.0, wall_time_s=10.0
    )[0]
    fired = only(driver.tick(10.0, engines=[later]))
    assert fired.active is True and fired.facts.admission_refused is False
    assert (
        annotation(fired, "admission_rejections") == "0 requests refused by a queue limit in 30 s"
    )
    plan = plan_for(
        "kv_saturation", fired.facts, "vllm-0", light_step_enabled=False, current_argv=ARGV
    )
    assert plan.steps == ("recommend_config",)
