"""On a GPU the search range counts the stable server's own memory as room, as the restart
pre-flight does, and a parallel canary runs only where it fits beside the stable server.
NVML is the fake C library under the real pynvml; the server is this test's own process."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

from kvpilot.agent.app.parts import tuned_server
from kvpilot.agent.config import load_config
from kvpilot.agent.config.tuning import TuningConfig
from kvpilot.agent.runtimes.device_memory import server_device_memory_bytes
from kvpilot.agent.tuning.gpu_bounds import GpuMemory, read_gpu
from kvpilot.agent.tuning.observer import measured_memory
from kvpilot.agent.tuning.study import build_study
from kvpilot.rig.server import free_port
from kvpilot.tuner.rollout.canary import Strategy
from tests.agent.sidecar_harness import agent_config, server_spec
from tests.fakes.nvml import FakeGpu, FakeNvmlLibrary, FakeProcess, installed

GIB = 1 << 30
TOTAL = 80 * GIB
UTILISATION = TuningConfig(memory_knob="gpu_memory_utilization")


def _config(tmp_path: Path, utilization: float):
    path = agent_config(
        tmp_path,
        spec=server_spec(kv_cache_memory_bytes=None),
        rules={},
        notifiers=[],
        remediation={},
        listen_port=free_port(),
    )
    config = load_config(path)
    inst = config.runtime.instances[0]
    argv = (*inst.argv, "--gpu-memory-utilization", str(utilization))
    runtime = config.runtime.model_copy(
        update={"instances": (inst.model_copy(update={"argv": argv}),)}
    )
    return config.model_copy(update={"runtime": runtime})


def _gpu_with_stable_at(utilization: float) -> GpuMemory | None:
    """NVML's view while the stable server holds its whole budget at `utilization`."""
    own = math.ceil(TOTAL * utilization)
    gpu = FakeGpu(
        uuid="GPU-0",
        total_bytes=TOTAL,
        used_bytes=own,
        reserved_bytes=0,
        processes=(FakeProcess(pid=os.getpid(), used_bytes=own),),
    )
    with installed(FakeNvmlLibrary([gpu])):
        return read_gpu(frozenset({os.getpid()}))


def test_the_stable_servers_own_memory_is_read_from_nvml() -> None:
    gpu = _gpu_with_stable_at(0.45)
    assert gpu is not None
    assert gpu.server_used_bytes == math.ceil(TOTAL * 0.45)
    assert gpu.free_bytes == TOTAL - gpu.server_used_bytes
    assert gpu.room_bytes == TOTAL


@pytest.mark.parametrize("utilization", [0.9, 0.45])
def test_the_range_reaches_the_top_whatever_the_stable_holds(
    tmp_path: Path, utilization: float
) -> None:
    # Before, a stable at 0.9 left "no room to search" and one at 0.45 capped it near 0.55:
    # its own memory counted as another process's.
    study = build_study(
        tuned_server(_config(tmp_path, utilization)), UTILISATION, _gpu_with_stable_at(utilization)
    )
    knob = study.space.knobs[0]
    assert knob.name == "gpu_memory_utilization"
    assert knob.high == UTILISATION.max_gpu_memory_utilization == 0.95
    assert knob.low is not None and knob.low < 0.05


@pytest.mark.parametrize("utilization", [0.9, 0.45])
def test_a_canary_that_cannot_fit_beside_the_stable_runs_in_sequence(
    tmp_path: Path, utilization: float
) -> None:
    study = build_study(
        tuned_server(_config(tmp_path, utilization)), UTILISATION, _gpu_with_stable_at(utilization)
    )
    assert study.strategy is Strategy.SEQUENTIAL
    free = TOTAL - math.ceil(TOTAL * utilization)
    assert study.strategy_reason == (
        "trials run in sequence: a canary at gpu_memory_utilization 0.95 needs 76.0 GiB, "
        f"and {free / GIB:.1f} GiB is free beside the stable server"
    )


def test_a_canary_that_fits_beside_the_stable_runs_in_parallel(tmp_path: Path) -> None:
    # A small stable (0.2) and a range capped at 0.5: 40 GiB fit in the 64 GiB left.
    tuning = TuningConfig(memory_knob="gpu_memory_utilization", max_gpu_memory_utilization=0.5)
    study = build_study(tuned_server(_config(tmp_path, 0.2)), tuning, _gpu_with_stable_at(0.2))
    assert (study.strategy, study.strategy_reason) == (Strategy.PARALLEL, None)


def test_a_stable_not_started_yet_is_counted_at_its_flags(tmp_path: Path) -> None:
    # Nothing runs yet: 80 GiB free, but the stable takes half of it when it starts, and a
    # canary at 0.6 needs 48 GiB.
    empty = GpuMemory(total_bytes=TOTAL, free_bytes=TOTAL)
    tuning = TuningConfig(memory_knob="gpu_memory_utilization", max_gpu_memory_utilization=0.6)
    study = build_study(tuned_server(_config(tmp_path, 0.5)), tuning, empty)
    assert study.strategy is Strategy.SEQUENTIAL
    assert study.strategy_reason is not None and "40.0 GiB is free" in study.strategy_reason
    fits = build_study(tuned_server(_config(tmp_path, 0.4)), tuning, empty)
    assert fits.strategy is Strategy.PARALLEL


def test_a_server_without_a_reported_kv_budget_is_priced_at_its_device_memory() -> None:
    own = 30 * GIB
    gpu = FakeGpu(
        uuid="GPU-0",
        total_bytes=TOTAL,
        used_bytes=own + 4 * GIB,
        reserved_bytes=0,
        processes=(
            FakeProcess(pid=os.getpid(), used_bytes=own),  # the server at the URL
            FakeProcess(pid=1, used_bytes=4 * GIB),  # a neighbour
        ),
    )
    url = "http://127.0.0.1:8000"
    with installed(FakeNvmlLibrary([gpu])):
        held = server_device_memory_bytes(url, lambda _url: frozenset({os.getpid()}))
        assert held == own
        assert server_device_memory_bytes(url, lambda _url: frozenset()) is None
        # No cache_config_info budget in the window: the device memory prices it.
        assert measured_memory((), url, lambda _url: held) == own
    with installed(None):  # the CPU build: no NVML, no device memory
        assert server_device_memory_bytes(url, lambda _url: frozenset({os.getpid()})) is None
