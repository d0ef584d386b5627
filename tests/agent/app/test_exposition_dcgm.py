"""dcgm-exporter's device memory in kvpilot's /metrics: the device's, labelled as such."""

from __future__ import annotations

import json
from pathlib import Path

from prometheus_client import generate_latest

from kvpilot.agent.app.exposition import build_registry, single_server
from kvpilot.agent.readings.snapshot import Snapshot
from kvpilot.agent.tick.ticker import TickState
from kvpilot.collectors.dcgm import parse_answer
from kvpilot.collectors.errors import SourceError

ANSWER = Path(__file__).resolve().parents[2] / "fixtures" / "dcgm_exporter" / "query_answer.json"
MIB = 1 << 20


def test_the_pods_gpu_memory_is_exported_as_device_memory_with_its_source() -> None:
    dcgm = parse_answer(
        json.loads(ANSWER.read_text()),
        pod="vllm-7c9d8b6f5-x2k4p",
        namespace="llm",
        taken_at_s=1.0,
        wall_time_s=2.0,
    )
    snapshot = Snapshot(
        taken_at_s=1.0,
        wall_time_s=2.0,
        vllm=SourceError("vllm", "refused", "not here"),
        kvpool=None,
        nvml=SourceError("nvml", "unavailable", "libnvidia-ml.so.1 not found"),
        durations_s=(("dcgm", 0.01),),
        dcgm=dcgm,
    )
    text = generate_latest(build_registry(single_server(TickState(latest=snapshot)))).decode()
    uuid = "GPU-3f1c2a7e-8d4b-4c1e-9a55-1b2c3d4e5f60"
    device = 'gpu="0",mig="",source="dcgm_exporter"'
    used = f'kvpilot_gpu_device_memory_bytes{{{device},state="used",uuid="{uuid}"}}'
    total = f'kvpilot_gpu_device_memory_bytes{{{device},state="total",uuid="{uuid}"}}'
    assert _value(text, used) == 73210 * MIB
    assert _value(text, total) == 81559 * MIB
    assert "not the vLLM process's" in text  # HELP says whose memory it is
    assert 'kvpilot_collector_up{role="stable",server="vllm",source="dcgm"} 1.0' in text
    assert "kvpilot_gpu_memory_bytes{" not in text  # NVML's family stays NVML's


def _value(text: str, series: str) -> float:
    (line,) = (line for line in text.splitlines() if line.startswith(series + " "))
    return float(line.rsplit(" ", 1)[1])
