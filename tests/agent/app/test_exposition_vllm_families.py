"""`exposition.vllm_families: exclude` leaves vLLM's own series out of kvpilot's /metrics,
and only those: read from a recorded vLLM 0.32 /metrics, every family rendered from it is
one the catalog marks, and the plugin's preemption series stay."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.agent.app.exposition import VllmFamilies, build_registry, single_server
from kvpilot.agent.config.errors import ConfigError
from kvpilot.agent.config.load import validate_config
from kvpilot.agent.readings.derive import EngineFigures
from kvpilot.agent.readings.snapshot import Snapshot
from kvpilot.agent.tick.ticker import TickState
from kvpilot.collectors.errors import SourceError
from kvpilot.collectors.vllm_metrics import VllmScrape, parse_vllm_metrics
from kvpilot.dashboards.metric_catalog import CATALOG

IDLE = Path(__file__).resolve().parents[2] / "fixtures" / "vllm" / "v0_32_idle.prom"
# Families about kvpilot itself, which stay whatever vLLM's are.
KVPILOT_OWN = {
    "kvpilot_build_info",
    "kvpilot_ticks_total",
    "kvpilot_collector_up",
    "kvpilot_collector_scrape_duration_seconds",
}


def _series(vllm_families: VllmFamilies) -> dict[str, list[dict[str, str]]]:
    """Each rendered family (by catalog name) with its series' labels."""
    engines = parse_vllm_metrics(IDLE.read_text(), taken_at_s=1.0, wall_time_s=2.0)
    (engine,) = engines
    figures = EngineFigures(
        model_name=engine.model_name,
        engine=engine.engine,
        span_s=10.0,
        preemption_rate_per_s=0.5,
        kvpool_preemption_rate_per_s=0.25,
        prefix_cache_hit_ratio=0.4,
        generation_tokens_per_s=100.0,
        iterations_per_s=20.0,
        latency_quantiles_s=(("ttft", 0.95, 0.2),),
    )
    snapshot = Snapshot(
        taken_at_s=1.0,
        wall_time_s=2.0,
        vllm=VllmScrape(1.0, 2.0, engines, "0.32.0"),
        kvpool=None,
        nvml=SourceError("nvml", "unavailable", "libnvidia-ml.so.1 not found"),
        durations_s=(("vllm", 0.01),),
    )
    state = TickState(latest=snapshot, figures=(figures,), ticks_total=1)
    registry = build_registry(single_server(state), vllm_families=vllm_families)
    text = generate_latest(registry).decode()
    rendered: dict[str, list[dict[str, str]]] = {}
    for family in text_string_to_metric_families(text):
        # The parser strips the _total and _info a family's kind adds.
        (name,) = {family.name, f"{family.name}_total", f"{family.name}_info"} & set(CATALOG)
        for sample in family.samples:
            rendered.setdefault(name, []).append(dict(sample.labels))
    return rendered


def test_included_by_default_every_vllm_family_is_rendered() -> None:
    rendered = _series("include")
    marked = {name for name, spec in CATALOG.items() if spec.vllm_copy != "none"}
    # Everything the recorded server and the figures can give (no deferral or rejection is
    # recorded idle, so those two stay absent: unknown is never a zero).
    assert marked - set(rendered) <= {
        "kvpilot_requests_deferred",
        "kvpilot_admission_rejections_total",
    }
    assert {"vllm", "kvpool"} <= {
        s["counter"] for s in rendered["kvpilot_preemption_rate_per_second"]
    }


def test_excluded_only_kvpilots_own_families_and_the_plugins_series_remain() -> None:
    rendered = _series("exclude")
    assert set(rendered) == KVPILOT_OWN | {"kvpilot_preemption_rate_per_second"}
    (rate,) = rendered["kvpilot_preemption_rate_per_second"]
    assert rate["counter"] == "kvpool"
    assert {s["source"] for s in rendered["kvpilot_collector_up"]} >= {"vllm"}


def test_the_setting_is_validated_with_a_clear_error() -> None:
    runtime = {"kind": "process", "port": 8000}
    config = validate_config({"runtime": runtime, "exposition": {"vllm_families": "exclude"}})
    assert config.exposition.vllm_families == "exclude"
    assert validate_config({"runtime": runtime}).exposition.vllm_families == "include"
    with pytest.raises(ConfigError) as caught:
        validate_config({"runtime": runtime, "exposition": {"vllm_families": "some"}})
    assert "exposition.vllm_families" in str(caught.value)
