"""Which workload a run replays and why; the study fingerprint keeps a learned workload's
coarse key only, so drift continues the study and a real change starts another."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kvpilot.agent.app.parts import tuned_server
from kvpilot.agent.config import load_config
from kvpilot.agent.config.tuning import TuningConfig
from kvpilot.agent.tuning.study import MEASURED_KV_ERROR_RATIO, StudyError, build_study
from kvpilot.agent.tuning.workload.choice import choose_workload, configured_workload
from kvpilot.agent.tuning.workload.window import WorkloadWindow
from kvpilot.rig.server import free_port
from kvpilot.tuner.load.generator import ShapedWorkload, TraceWorkload, Workload
from kvpilot.tuner.measure.traces import workload_hash
from kvpilot.tuner.suggest.prior import DEFAULT_PRIOR_ERROR_RATIO
from tests.agent.sidecar_harness import agent_config, server_spec
from tests.agent.tuning.workload_scrapes import served


def _shape(requests: int, *, prompt: int = 300, rate_s: float = 1.0):  # type: ignore[no-untyped-def]
    window = WorkloadWindow(3600)
    window.observe(served(0, at_s=0.0, prompt=prompt))
    window.observe(served(requests, at_s=requests / rate_s, prompt=prompt))
    return window.shape()


def test_below_the_floor_the_configured_workload_with_the_count() -> None:
    choice = choose_workload(TuningConfig(), _shape(150))
    assert choice.source == "configured"
    assert choice.workload == configured_workload(TuningConfig().workload)
    assert "150 requests" in choice.reason and "floor of 200" in choice.reason


def test_at_the_floor_the_learned_workload_with_its_key() -> None:
    choice = choose_workload(TuningConfig(), _shape(200), max_model_len=1024)
    assert choice.source == "learned"
    assert isinstance(choice.workload, ShapedWorkload)
    assert choice.workload.num_requests == TuningConfig().workload.requests
    # The observed 1 request/s, replayed with the default headroom of 1.25.
    assert choice.workload.rate_rps == pytest.approx(1.25)
    assert "replayed at 1.25x its rate" in choice.reason
    assert choice.workload.max_model_len == 1024
    assert choice.key is not None and choice.key in choice.reason
    assert choice.served() == "learned:" + choice.key + ";headroom=1.25"
    assert "200 requests" in choice.reason


def test_a_burst_factor_is_another_study_and_plain_poisson_keeps_the_key() -> None:
    plain = choose_workload(TuningConfig(learn={"headroom": 1}), _shape(200))
    bursty = choose_workload(TuningConfig(learn={"burst_factor": 4, "headroom": 1}), _shape(200))
    assert plain.served() == "learned:" + (plain.key or "")
    assert bursty.key == plain.key  # the traffic's shape is the same
    assert bursty.served() == plain.served() + ";burst=4"


def test_headroom_replays_the_learned_rate_faster_and_is_another_study() -> None:
    at_rate = choose_workload(TuningConfig(learn={"headroom": 1}), _shape(200))
    faster = choose_workload(TuningConfig(learn={"headroom": 2}), _shape(200))
    assert at_rate.workload.rate_rps == pytest.approx(1.0)
    assert faster.workload.rate_rps == pytest.approx(2.0)
    assert "replayed at" not in at_rate.reason and "replayed at 2x its rate" in faster.reason
    assert faster.key == at_rate.key  # the traffic's shape is the same
    assert faster.served() == at_rate.served() + ";headroom=2"


def test_no_window_disabled_or_a_configured_floor() -> None:
    none = choose_workload(TuningConfig(), None, no_shape="no sidecar answered")
    assert (none.source, none.reason) == ("configured", "no learned workload: no sidecar answered")
    off = TuningConfig.model_validate({"learn": {"enabled": False}})
    assert choose_workload(off, _shape(5000)).reason == "learning is off (tuning.learn.enabled)"
    low = TuningConfig.model_validate({"learn": {"min_requests": 20, "burst_factor": 3}})
    learned = choose_workload(low, _shape(20))
    assert learned.source == "learned"
    assert isinstance(learned.workload, ShapedWorkload) and learned.workload.burst_factor == 3


def test_a_trace_file_wins(tmp_path: Path) -> None:
    trace = tmp_path / "trace.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n0,10,5\n2,20,6\n")
    tuning = TuningConfig.model_validate({"workload": {"trace": str(trace)}})
    choice = choose_workload(tuning, _shape(5000))
    assert choice.source == "trace" and str(trace) in choice.reason
    assert isinstance(choice.workload, TraceWorkload)
    assert choice.workload.arrivals == ((0.0, 10, 5), (2.0, 20, 6))
    missing = TuningConfig.model_validate({"workload": {"trace": str(tmp_path / "none.csv")}})
    with pytest.raises(ValueError, match=r"tuning\.workload\.trace"):
        choose_workload(missing, None)


def test_learn_config_is_validated() -> None:
    for bad in ({"min_requests": 0}, {"burst_factor": 0.5}, {"window_s": 1}, {"other": 1}):
        with pytest.raises(ValueError):
            TuningConfig.model_validate({"learn": bad})
    assert TuningConfig().learn.min_requests == 200


def _config(tmp_path: Path):  # type: ignore[no-untyped-def]
    path = agent_config(
        tmp_path,
        spec=server_spec(),
        rules={},
        notifiers=[],
        remediation={},
        listen_port=free_port(),
    )
    return load_config(path)


def test_the_configured_study_keeps_its_fingerprint(tmp_path: Path) -> None:
    """Studies that ran before the learned workload existed continue: same hash as then."""
    config = _config(tmp_path)
    study = build_study(tuned_server(config), TuningConfig())
    w = TuningConfig().workload
    assert type(study.workload) is Workload
    plain = Workload(
        w.requests, study.workload.prompt_len, study.workload.output_len, w.concurrency
    )
    assert workload_hash(study.workload) == workload_hash(plain)
    assert (
        study.fingerprint
        == build_study(
            tuned_server(config), TuningConfig(), chosen=choose_workload(TuningConfig(), None)
        ).fingerprint
    )


def test_drift_continues_the_learned_study_and_a_change_starts_another(tmp_path: Path) -> None:
    config = _config(tmp_path)
    tuning = TuningConfig()

    def study_of(shape):  # type: ignore[no-untyped-def]
        return build_study(tuned_server(config), tuning, chosen=choose_workload(tuning, shape))

    base = study_of(_shape(400, prompt=300, rate_s=2.0))
    drifted = study_of(_shape(460, prompt=330, rate_s=2.4))
    longer = study_of(_shape(400, prompt=900, rate_s=2.0))
    configured = build_study(tuned_server(config), tuning)
    assert isinstance(base.workload, ShapedWorkload)
    assert drifted.fingerprint == base.fingerprint
    assert longer.fingerprint != base.fingerprint
    assert base.fingerprint != configured.fingerprint


def test_an_unreadable_trace_is_a_study_error(tmp_path: Path) -> None:
    tuning = TuningConfig.model_validate({"workload": {"trace": str(tmp_path / "gone.jsonl")}})
    with pytest.raises(StudyError, match=r"gone\.jsonl"):
        build_study(tuned_server(_config(tmp_path)), tuning)


def test_an_open_loop_tells_the_suggester_what_the_load_offers(tmp_path: Path) -> None:
    """The replayed rate times the mean output is the goodput of a configuration that
    serves all of it: what a miss's share is read against before anything held. A closed
    loop offers no rate: None."""
    config = _config(tmp_path)
    tuning = TuningConfig.model_validate({"suggester": "informed"})
    choice = choose_workload(tuning, _shape(200))
    study = build_study(tuned_server(config), tuning, gpu=None, chosen=choice)
    load = study.knowledge.load
    assert load is not None and choice.workload.rate_rps is not None
    # 60-token answers fall in vLLM's bucket (50, 100], replayed uniform in 51-100.
    assert choice.workload.rate_rps == pytest.approx(1.25)
    assert load.offered_tokens_per_s == pytest.approx(1.25 * (51 + 100) / 2)
    closed = build_study(tuned_server(config), tuning, gpu=None)
    assert closed.knowledge.load is not None
    assert closed.knowledge.load.offered_tokens_per_s is None


def test_the_kv_a_running_request_held_replaces_the_planners_estimate(
    tmp_path: Path,
) -> None:
    """Where the learned window measured it (10 blocks of the server's 16 tokens, at the
    planner's 1 KiB a token on this build), the search is told that, with the narrower band
    of a measurement; without it, the planner's lengths and its band."""
    config = _config(tmp_path)
    tuning = TuningConfig.model_validate({"suggester": "informed"})
    measured = dataclasses.replace(_shape(200), kv_blocks_per_running=10.0)
    choice = choose_workload(tuning, measured)
    assert choice.reason.endswith("; 10 KV blocks a running request")  # said where it is used
    study = build_study(tuned_server(config), tuning, gpu=None, chosen=choice)
    load = study.knowledge.load
    assert load is not None
    assert load.kv_bytes_per_request == 10 * 16 * 1024
    assert load.error_ratio == MEASURED_KV_ERROR_RATIO < DEFAULT_PRIOR_ERROR_RATIO
    planned = build_study(
        tuned_server(config), tuning, gpu=None, chosen=choose_workload(tuning, _shape(200))
    ).knowledge.load
    assert planned is not None and planned.error_ratio == DEFAULT_PRIOR_ERROR_RATIO
    assert planned.kv_bytes_per_request != load.kv_bytes_per_request
