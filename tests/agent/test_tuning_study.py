"""Which memory knob a study searches, and over what range, from the stable argv and the
GPU's memory (given here as NVML would report it: no GPU runs in this environment)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpilot.agent.config import load_config
from kvpilot.agent.tuning_config import TuningConfig
from kvpilot.agent.tuning_study import GpuMemory, StudyError, build_study
from kvpilot.rig.server import free_port
from kvpilot.tuner.space import KnobKind
from tests.agent.sidecar_harness import agent_config, server_spec

GIB = 1 << 30
H100 = GpuMemory(total_bytes=80 * GIB, free_bytes=60 * GIB, name="NVIDIA H100 80GB HBM3")


def _config(tmp_path: Path, **spec: object):
    path = agent_config(
        tmp_path, spec=server_spec(**spec), rules={}, notifiers=[], remediation={},
        listen_port=free_port(),
    )  # fmt: skip
    return load_config(path)


def test_the_cpu_build_searches_the_kv_budget(tmp_path: Path) -> None:
    study = build_study(_config(tmp_path), TuningConfig(), gpu=None)
    memory, seqs = study.space.knobs
    assert (memory.name, memory.kind) == ("kv_cache_memory_bytes", KnobKind.INTEGER)
    # One request of 1024 tokens (32 blocks of 32 KiB) and the null block.
    assert memory.low == 33 * 32 * 1024 and memory.high == 64 << 20
    assert (seqs.name, seqs.low, seqs.high) == ("max_num_seqs", 1, 64)


def test_with_a_gpu_and_no_explicit_budget_it_searches_the_utilisation(tmp_path: Path) -> None:
    study = build_study(_config(tmp_path, kv_cache_memory_bytes=None), TuningConfig(), gpu=H100)
    memory = study.space.knobs[0]
    assert (memory.name, memory.kind) == ("gpu_memory_utilization", KnobKind.REAL)
    # Other processes hold 20 of 80 GiB: vLLM refuses a utilisation above the free 75 %.
    assert memory.high == 0.75
    assert 0 < memory.low < 0.05  # the tiny model needs little for one request
    assert study.space.violation(study.space.candidate(
        {"gpu_memory_utilization": 0.7, "max_num_seqs": 8}
    )) is None  # fmt: skip


def test_an_explicit_budget_in_the_argv_keeps_the_kv_knob_even_with_a_gpu(tmp_path: Path) -> None:
    study = build_study(_config(tmp_path), TuningConfig(), gpu=H100)
    assert study.space.knobs[0].name == "kv_cache_memory_bytes"
    with pytest.raises(StudyError, match="overrides --gpu-memory-utilization"):
        build_study(_config(tmp_path), TuningConfig(memory_knob="gpu_memory_utilization"), H100)


def test_the_utilisation_knob_needs_a_gpu_and_room_on_it(tmp_path: Path) -> None:
    config = _config(tmp_path, kv_cache_memory_bytes=None)
    utilisation = TuningConfig(memory_knob="gpu_memory_utilization")
    with pytest.raises(StudyError, match="NVML sees none"):
        build_study(config, utilisation, gpu=None)
    full = GpuMemory(total_bytes=80 * GIB, free_bytes=GIB // 1000)
    with pytest.raises(StudyError, match="other processes hold"):
        build_study(config, utilisation, gpu=full)
