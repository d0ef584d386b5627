"""A label that holds a number no engine could have (400 digits of `num_gpu_blocks`) is
refused with its reason: it never stops a tick, never breaks kvpilot's own /metrics, and the
live canary observer and the planner check read past it."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
import yaml

from kvpilot.agent.tick.calibration import PlannerCheck
from kvpilot.agent.tuning.pod.live_intervals import read_pod
from kvpilot.collectors.vllm_parse import VllmScrape, parse_vllm_metrics
from tests.faults.agent_process import kvpilot, ticks, value
from tests.faults.misbehaving import Misbehaving, answer, free_port

ROOT = Path(__file__).resolve().parents[2]
PAYLOAD = (ROOT / "tests" / "fixtures" / "vllm" / "v0_32_under_load.prom").read_text()
TINY_CONFIG = ROOT / "rig" / "models" / "tiny-llama" / "config.json"
HUGE = "9" * 400


def _huge(label: str, text: str = PAYLOAD) -> str:
    out, n = re.subn(rf'([{{,]){label}="\d+"', rf'\g<1>{label}="{HUGE}"', text)
    assert n == 1, f"the fixture has {n} {label} labels"
    return out


@pytest.mark.parametrize("label", ["num_gpu_blocks", "block_size"])
def test_a_huge_cache_config_integer_is_refused_not_raised(label: str) -> None:
    (engine,) = parse_vllm_metrics(_huge(label), taken_at_s=1.0, wall_time_s=1.0)
    assert (label, "out_of_range") in {(r.field, r.reason) for r in engine.refused}
    assert getattr(engine, label) is None
    if label == "num_gpu_blocks":
        assert engine.blocks_total is None and engine.blocks_free is None
    assert engine.kv_usage_ratio is not None  # the rest of the scrape is kept


def test_the_live_canary_observer_reads_past_a_huge_label() -> None:
    reading = read_pod(_huge("num_gpu_blocks"), taken_at_s=1.0, wall_time_s=1.0)
    assert reading is not None and reading.scrape.engines[0].num_gpu_blocks is None


def test_the_planner_check_reports_a_huge_label_as_an_error() -> None:
    (engine,) = parse_vllm_metrics(_huge("num_gpu_blocks"), taken_at_s=1.0, wall_time_s=1.0)
    (found,) = PlannerCheck(TINY_CONFIG).check(VllmScrape(1.0, 1.0, (engine,), None))
    assert found.calibration is None and found.error


@pytest.mark.slow
@pytest.mark.parametrize("usage_line", [True, False], ids=["with-usage", "without-usage"])
def test_an_agent_fed_a_huge_label_keeps_ticking_and_serving(
    tmp_path: Path, usage_line: bool
) -> None:
    body = _huge("num_gpu_blocks")
    if not usage_line:
        body = "\n".join(
            ln for ln in body.splitlines() if not ln.startswith("vllm:kv_cache_usage_perc")
        )
    port = free_port()
    version = answer(b'{"version": "0.32.0"}', "application/json")
    with Misbehaving({"/metrics": answer(body.encode()), "/version": version}) as vllm:
        config = {
            "listen": {"host": "127.0.0.1", "port": port},
            "interval_s": 0.5,
            "state_dir": str(tmp_path / "state"),
            "runtime": {"kind": "process", "port": int(vllm.url.rsplit(":", 1)[1])},
        }
        (tmp_path / "kvpilot.yaml").write_text(yaml.safe_dump(config))
        with kvpilot(["run", "--config", str(tmp_path / "kvpilot.yaml")], tmp_path, port) as agent:
            text = agent.wait_for("three ticks", lambda t: ticks(t) >= 3)
            health = httpx.get(f"{agent.url}/healthz", timeout=5.0)
            metrics = httpx.get(f"{agent.url}/metrics", timeout=5.0)
    assert health.status_code == 200, health.text
    assert metrics.status_code == 200
    assert value(text, "kvpilot_collector_up", source="vllm") == 1.0
    refused = value(text, "kvpilot_collector_errors_total", source="vllm", reason="out_of_range")
    assert refused is not None and refused >= 1
