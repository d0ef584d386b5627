"""/metrics and /healthz over the agent's tick state, through a real ASGI client."""

from __future__ import annotations

from pathlib import Path

from starlette.testclient import TestClient

from kvpilot.agent.app.exposition import build_registry, single_server
from kvpilot.agent.app.http import build_app
from kvpilot.agent.readings.derive import EngineFigures
from kvpilot.agent.readings.snapshot import Snapshot
from kvpilot.agent.tick.ticker import TickState
from kvpilot.collectors.errors import SourceError
from kvpilot.collectors.fragmentation import kv_blocks_fragmentation
from kvpilot.collectors.kvpool.client import KvBlockSample, KvPoolScrape
from kvpilot.collectors.vllm_metrics import VllmScrape, parse_vllm_metrics

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "vllm" / "v0_32_under_load.prom"


def _kv_block(free: int, longest: int) -> KvBlockSample:
    return KvBlockSample(
        engine="0",
        model_name="tiny-llama",
        taken_at_s=10.0,
        blocks_total=1023,
        blocks_free=free,
        blocks_free_cached=3,
        blocks_empty=free - 3,
        longest_free_run_blocks=longest,
        fragmentation=kv_blocks_fragmentation(free, longest, 1023),
        internal_fragmentation_slots=17,
        internal_fragmentation_ratio=0.02,
        requests_running=33,
        block_size_tokens=32,
        preemptions_total=21,
        last_preemption_wall_s=1_700_000_000.0,
        scheduler_steps_total=900,
        snapshot_age_s=0.01,
    )


def _state(kv_block: KvBlockSample) -> TickState:
    engines = parse_vllm_metrics(FIXTURE.read_text(), taken_at_s=10.0, wall_time_s=1e9)
    snapshot = Snapshot(
        taken_at_s=10.0,
        wall_time_s=1e9,
        vllm=VllmScrape(10.0, 1e9, engines, "0.32.0"),
        kvpool=KvPoolScrape(10.0, 1e9, (kv_block,), ()),
        nvml=SourceError("nvml", "unavailable", "no driver"),
        durations_s=(("vllm", 0.004), ("nvml", 0.0), ("kvpool", 0.002)),
    )
    figures = EngineFigures(
        model_name=engines[0].model_name,
        engine="0",
        span_s=30.0,
        preemption_rate_per_s=0.5,
        kvpool_preemption_rate_per_s=0.7,
        prefix_cache_hit_ratio=None,
        generation_tokens_per_s=120.0,
        iterations_per_s=8.0,
        latency_quantiles_s=(("ttft", 0.5, 0.04), ("ttft", 0.99, None)),
    )
    state = TickState(latest=snapshot, figures=(figures,), ticks_total=5, last_tick_at_s=10.0)
    state.errors_total[("nvml", "unavailable")] = 5
    return state


def _client(state: TickState, now_s: float) -> TestClient:
    app = build_app(
        state, build_registry(single_server(state)), clock=lambda: now_s, stale_after_s=5.0
    )
    return TestClient(app)


def test_metrics_exports_every_source_and_leaves_unknowns_absent() -> None:
    state = _state(_kv_block(free=200, longest=50))
    response = _client(state, now_s=11.0).get("/metrics")
    assert response.status_code == 200
    text = response.text
    server = 'role="stable",server="vllm"'
    assert f'kvpilot_collector_up{{{server},source="vllm"}} 1.0' in text
    assert f'kvpilot_collector_up{{{server},source="nvml"}} 0.0' in text
    assert (
        f'kvpilot_collector_errors_total{{reason="unavailable",{server},source="nvml"}} 5.0' in text
    )
    assert (
        'kvpilot_kv_blocks{engine="0",model_name="rig/models/tiny-llama",'
        f'{server},state="free"}} 5.0' in text
    )
    assert (
        'kvpilot_fragmentation_ratio{device="",engine="0",model_name="tiny-llama",rank="",'
        f'{server},source="kv_blocks"}} 0.75' in text
    )
    assert (
        'kvpilot_preemptions_total{counter="kvpool",engine="0",model_name="tiny-llama",'
        f"{server}}} 21.0" in text
    )
    assert f'percentile="50",{server}}} 0.04' in text
    assert 'percentile="99"' not in text  # unknown is absent, never zero
    assert "kvpilot_gpu_memory_bytes" not in text  # no GPU: no invented readings


def test_a_guarded_fragmentation_rate_is_absent() -> None:
    state = _state(_kv_block(free=10, longest=10))  # fewer than 16 free blocks
    text = _client(state, now_s=11.0).get("/metrics").text
    assert 'source="kv_blocks"' not in text
    assert (
        'kvpilot_kvpool_blocks{engine="0",model_name="tiny-llama",role="stable",server="vllm",'
        'state="free"} 10.0' in text
    )


def test_healthz_follows_the_age_of_the_last_tick() -> None:
    state = _state(_kv_block(free=200, longest=50))
    fresh = _client(state, now_s=12.0).get("/healthz")
    assert fresh.status_code == 200 and fresh.json()["status"] == "ok"
    stale = _client(state, now_s=16.0).get("/healthz")
    assert stale.status_code == 503 and stale.json()["status"] == "stale"
    assert _client(TickState(), now_s=0.0).get("/healthz").status_code == 503
