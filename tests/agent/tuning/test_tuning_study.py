"""Which memory knob a study searches, and over what range, from the stable argv and the
GPU's memory (given here as NVML would report it: no GPU runs in this environment)."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest

from kvpilot.agent.app.parts import tuned_server
from kvpilot.agent.config import load_config
from kvpilot.agent.config.tuning import TuningConfig
from kvpilot.agent.tuning.study import (
    GpuMemory,
    StudyError,
    build_study,
    deployed_values,
    read_gpu,
    rollout_settings,
    study_suggester,
)
from kvpilot.rig.server import free_port
from kvpilot.tuner.judge.judgement import DEFAULT_METRICS, LIVE_METRICS, JudgeConfig, MetricSpec
from kvpilot.tuner.problem.space import KnobKind
from kvpilot.tuner.suggest import (
    BayesianSuggester,
    KneeSuggester,
    Knowledge,
    KvPrior,
    LoadShape,
    MemoryAxis,
    RandomSuggester,
    make_suggester,
)
from tests.agent.sidecar_harness import agent_config, server_spec
from tests.fakes.nvml import FakeGpu, FakeNvmlLibrary, installed

GIB = 1 << 30
H100 = GpuMemory(total_bytes=80 * GIB, free_bytes=60 * GIB, name="NVIDIA H100 80GB HBM3")


def _config(tmp_path: Path, **spec: object):
    path = agent_config(
        tmp_path,
        spec=server_spec(**spec),
        rules={},
        notifiers=[],
        remediation={},
        listen_port=free_port(),
    )
    return load_config(path)


def test_the_cpu_build_searches_the_kv_budget(tmp_path: Path) -> None:
    study = build_study(tuned_server(_config(tmp_path)), TuningConfig(), gpu=None)
    memory, seqs = study.space.knobs
    assert (memory.name, memory.kind) == ("kv_cache_memory_bytes", KnobKind.INTEGER)
    # One request of 1024 tokens (32 blocks of 32 KiB) and the null block.
    assert memory.low == 33 * 32 * 1024 and memory.high == 64 << 20
    assert (seqs.name, seqs.low, seqs.high) == ("max_num_seqs", 1, 64)


def test_with_a_gpu_and_no_explicit_budget_it_searches_the_utilisation(tmp_path: Path) -> None:
    study = build_study(
        tuned_server(_config(tmp_path, kv_cache_memory_bytes=None)), TuningConfig(), gpu=H100
    )
    memory = study.space.knobs[0]
    assert (memory.name, memory.kind) == ("gpu_memory_utilization", KnobKind.REAL)
    # Other processes hold 20 of 80 GiB: vLLM refuses a utilisation above the free 75 %.
    assert memory.high == 0.75
    assert 0 < memory.low < 0.05  # the tiny model needs little for one request
    assert (
        study.space.violation(
            study.space.candidate({"gpu_memory_utilization": 0.7, "max_num_seqs": 8})
        )
        is None
    )


def test_an_explicit_budget_in_the_argv_keeps_the_kv_knob_even_with_a_gpu(tmp_path: Path) -> None:
    study = build_study(tuned_server(_config(tmp_path)), TuningConfig(), gpu=H100)
    assert study.space.knobs[0].name == "kv_cache_memory_bytes"
    with pytest.raises(StudyError, match="overrides --gpu-memory-utilization"):
        build_study(
            tuned_server(_config(tmp_path)),
            TuningConfig(memory_knob="gpu_memory_utilization"),
            H100,
        )


def test_the_utilisation_knob_needs_a_gpu_and_room_on_it(tmp_path: Path) -> None:
    config = _config(tmp_path, kv_cache_memory_bytes=None)
    utilisation = TuningConfig(memory_knob="gpu_memory_utilization")
    with pytest.raises(StudyError, match="NVML sees none"):
        build_study(tuned_server(config), utilisation, gpu=None)
    full = GpuMemory(total_bytes=80 * GIB, free_bytes=GIB // 1000)
    with pytest.raises(StudyError, match="other processes hold"):
        build_study(tuned_server(config), utilisation, gpu=full)


def test_extra_knobs_and_own_constraints_join_the_space(tmp_path: Path) -> None:
    tuning = TuningConfig(
        extra_knobs=(
            {"name": "max_num_batched_tokens", "low": 256, "high": 4096},
            {"name": "enable_prefix_caching"},
        ),
        constraints=("max_num_seqs * 64 <= max_num_batched_tokens",),
    )
    study = build_study(tuned_server(_config(tmp_path)), tuning)
    names = [k.name for k in study.space.knobs]
    assert names == [
        "kv_cache_memory_bytes",
        "max_num_seqs",
        "max_num_batched_tokens",
        "enable_prefix_caching",
    ]
    values = {"kv_cache_memory_bytes": 8 << 20, "enable_prefix_caching": True}
    too_many = study.space.candidate({**values, "max_num_seqs": 32, "max_num_batched_tokens": 512})
    assert "max_num_seqs * 64 <= max_num_batched_tokens" in (study.space.violation(too_many) or "")
    fits = study.space.candidate({**values, "max_num_seqs": 4, "max_num_batched_tokens": 512})
    assert study.space.violation(fits) is None


def test_knobs_and_constraints_that_cannot_work_are_config_errors() -> None:
    with pytest.raises(ValueError, match="max_num_seqs \\*"):
        TuningConfig(constraints=("max_num_seqs * <= 4",))
    with pytest.raises(ValueError, match="low <= high"):
        TuningConfig(extra_knobs=({"name": "max_num_batched_tokens", "low": 9000, "high": 10},))


def test_the_study_holds_the_other_flags_fixed_in_either_spelling(tmp_path: Path) -> None:
    config = _config(tmp_path)
    base = build_study(tuned_server(config), TuningConfig())
    inst = config.runtime.instances[0]
    argv = list(inst.argv)
    at = argv.index("--kv-cache-memory-bytes")
    argv[at : at + 2] = ["--kv-cache-memory-bytes=1234567"]  # another value, other spelling
    moved = config.model_copy(
        update={
            "runtime": config.runtime.model_copy(
                update={"instances": (inst.model_copy(update={"argv": tuple(argv)}),)}
            )
        }
    )
    assert build_study(tuned_server(moved), TuningConfig()).fingerprint == base.fingerprint
    # A flag the study holds fixed changed: another study.
    other = moved.model_copy(
        update={
            "runtime": moved.runtime.model_copy(
                update={"instances": (inst.model_copy(update={"argv": (*argv, "--seed", "7")}),)}
            )
        }
    )
    assert build_study(tuned_server(other), TuningConfig()).fingerprint != base.fingerprint


def test_live_traffic_is_a_study_of_its_own(tmp_path: Path) -> None:
    config = _config(tmp_path)
    replay = build_study(tuned_server(config), TuningConfig()).fingerprint
    live = {"canary": {"traffic": "service"}}
    service = build_study(tuned_server(config), TuningConfig.model_validate(live)).fingerprint
    other_load = {**live, "workload": {"requests": 8}}
    assert service != replay
    assert (
        build_study(tuned_server(config), TuningConfig.model_validate(other_load)).fingerprint
        == service
    )


def test_a_model_the_planner_cannot_read_is_a_study_error(tmp_path: Path) -> None:
    config = _config(tmp_path, model_dir=tmp_path / "nowhere")
    with pytest.raises(StudyError, match=r"the planner cannot bound the search for .*nowhere"):
        build_study(tuned_server(config), TuningConfig())


def test_the_gpu_is_read_once_and_quietly(caplog: pytest.LogCaptureFixture) -> None:
    gpu = FakeGpu(uuid="GPU-0", total_bytes=80 * GIB, used_bytes=20 * GIB, reserved_bytes=0)
    with caplog.at_level(logging.DEBUG):
        with installed(FakeNvmlLibrary([gpu])):
            assert read_gpu() == GpuMemory(80 * GIB, 60 * GIB, "NVIDIA H100 80GB HBM3")
        with installed(None):  # no NVML library: the CPU build, and nothing to warn about
            assert read_gpu() is None
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


@pytest.mark.parametrize(
    ("name", "kind"),
    # informed searches the batch, then the memory, where it knows the load's shape (here)
    [("bayes", BayesianSuggester), ("informed", KneeSuggester), ("random", RandomSuggester)],
)
def test_the_study_runs_the_suggester_the_configuration_names(
    tmp_path: Path, name: str, kind: type
) -> None:
    tuning = TuningConfig.model_validate({"suggester": name})
    study = build_study(tuned_server(_config(tmp_path)), tuning, gpu=None)
    assert isinstance(study_suggester(study), kind)


@pytest.mark.parametrize("metrics", [DEFAULT_METRICS, LIVE_METRICS], ids=["replay", "live"])
def test_the_latency_margin_reaches_every_latency_the_judge_counts(
    tmp_path: Path, metrics: tuple[MetricSpec, ...]
) -> None:
    tuning = TuningConfig.model_validate({"latency_margin_ratio": 0.5, "error_margin_ratio": 0.02})
    study = build_study(tuned_server(_config(tmp_path)), tuning, gpu=None)
    settings = rollout_settings(study, JudgeConfig(metrics=metrics))
    margins = {m.name: (m.tolerance_ratio, m.tolerance_abs) for m in settings.judge.metrics}
    assert [margins[name][0] for name in ("ttft_s", "inter_token_s", "e2e_s")] == [0.5] * 3
    assert margins["goodput_tokens_per_s"][0] == 0.1  # goodput keeps its own
    assert margins["errors_ratio"][1] == 0.02
    # Unset, the preemption margin is the judge's own: 0.01 a request replayed, 0.1 live.
    assert margins["preemptions_per_request"][1] == (0.01 if metrics is DEFAULT_METRICS else 0.1)
    tuning = tuning.model_copy(update={"preemption_margin_per_request": 0.05})
    study = build_study(tuned_server(_config(tmp_path)), tuning, gpu=None)
    judged = rollout_settings(study, JudgeConfig(metrics=metrics)).judge.metrics
    assert {m.name: m.tolerance_abs for m in judged}["preemptions_per_request"] == 0.05


def test_the_informed_suggester_is_told_the_planner_need_the_deployed_flags_and_the_axis(
    tmp_path: Path,
) -> None:
    """CPU build: the KV-budget knob's axis is the identity; the need is the closed-loop
    workload's requests in flight (16, capped at the deployed max_num_seqs of 8) times the
    tokens each holds (384 prompt, half of 64 out), in blocks of 32 tokens of 32 KiB. The
    load's shape keeps the 16 requests uncapped: the batch the load needs is what the
    search is after."""
    config = _config(tmp_path, max_num_seqs=8)
    tuning = TuningConfig.model_validate({"suggester": "informed", "seed": 3})
    study = build_study(tuned_server(config), tuning, gpu=None)
    blocks = math.ceil(8 * (384 + 64 / 2) / 32)
    told = Knowledge(
        prior=KvPrior(blocks * 32 * 1024),
        deployed={"kv_cache_memory_bytes": 64 << 20, "max_num_seqs": 8},
        axis=MemoryAxis.identity(),
        load=LoadShape(16.0, 1024 * (384 + 64 / 2), 384.0),
    )
    assert study.knowledge == told
    # What the study builds asks what a suggester told all of it asks, not a blind one.
    first = study_suggester(study).ask()
    assert first == make_suggester("informed", study.space, 3, told).ask()
    assert first != make_suggester("informed", study.space, 3).ask()


def test_on_a_gpu_the_utilisation_axis_is_the_gpu_less_what_the_planner_says_is_not_kv(
    tmp_path: Path,
) -> None:
    """The axis agrees with the planner's own bounds: at the least utilisation the KV left
    is one request of max_model_len (within the bound's rounding to 1e-4 of the GPU)."""
    config = _config(
        tmp_path,
        kv_cache_memory_bytes=None,
        extra_args=("--gpu-memory-utilization", "0.5"),
    )
    study = build_study(tuned_server(config), TuningConfig(), gpu=H100)
    memory = study.space.knobs[0]
    axis = study.knowledge.axis
    assert axis is not None and axis.bytes_per_unit == 80 * GIB
    one_request = 33 * 32 * 1024  # 32 blocks of 32 tokens and the null block
    assert memory.low is not None
    assert one_request <= axis.kv_bytes(memory.low) <= one_request + 1e-4 * 80 * GIB
    assert study.knowledge.deployed == {"gpu_memory_utilization": 0.5}
    assert study.knowledge.prior == KvPrior(math.ceil(16 * (384 + 64 / 2) / 32) * 32 * 1024)


def test_the_deployed_flags_are_read_in_either_spelling_and_unknown_where_unusable(
    tmp_path: Path,
) -> None:
    space = build_study(tuned_server(_config(tmp_path)), TuningConfig()).space
    argv = ("vllm", "serve", "m", "--max-num-seqs=32", "--kv-cache-memory-bytes", "8388608")
    assert deployed_values(space, argv) == {"max_num_seqs": 32, "kv_cache_memory_bytes": 8 << 20}
    human = ("vllm", "serve", "m", "--max_num_seqs", "32", "--kv-cache-memory-bytes=8M")
    assert deployed_values(space, human) == {"max_num_seqs": 32, "kv_cache_memory_bytes": 8 << 20}
    # Outside the space, unreadable, or left to vLLM's default: unknown, never a guess.
    odd = ("vllm", "serve", "m", "--max-num-seqs", "4096", "--kv-cache-memory-bytes", "lots")
    assert deployed_values(space, odd) == {}
