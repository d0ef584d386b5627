"""The planner against a recorded live server, as the agent shows and exports it."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import generate_latest
from rich.console import Console

from kvpilot.agent.app.exposition import build_registry, single_server
from kvpilot.agent.cli.snapshot_view import render
from kvpilot.agent.readings.snapshot import Snapshot
from kvpilot.agent.tick.calibration import PlannerCheck, model_config_of
from kvpilot.agent.tick.ticker import TickState
from kvpilot.collectors.errors import SourceError
from kvpilot.collectors.vllm_metrics import VllmScrape, parse_vllm_metrics
from kvpilot.rig.server import TINY_MODEL_DIR, ServerSpec, build_argv

IDLE = Path(__file__).resolve().parents[2] / "fixtures" / "vllm" / "v0_32_idle.prom"


def _scrape() -> VllmScrape:
    engines = parse_vllm_metrics(IDLE.read_text(), taken_at_s=1.0, wall_time_s=2.0)
    return VllmScrape(1.0, 2.0, engines, "0.32.0")


def test_the_recorded_tiny_server_agrees_with_the_plan() -> None:
    (item,) = PlannerCheck(TINY_MODEL_DIR / "config.json").check(_scrape())
    assert item.error is None and item.calibration is not None
    assert item.calibration.blocks_difference == 0
    assert item.calibration.live_num_blocks == item.calibration.predicted_num_blocks


def test_a_config_that_is_not_a_model_gives_a_reason_not_an_exception(tmp_path: Path) -> None:
    broken = tmp_path / "config.json"
    broken.write_text('{"architectures": ["BertModel"], "model_type": "bert"}')
    (item,) = PlannerCheck(broken).check(_scrape())
    assert item.calibration is None and item.error


def test_exported_and_printed() -> None:
    scrape = _scrape()
    state = TickState(
        latest=Snapshot(1.0, 2.0, scrape, None, SourceError("nvml", "unavailable", "x"), ()),
        calibrations=PlannerCheck(TINY_MODEL_DIR / "config.json").check(scrape),
    )
    text = generate_latest(build_registry(single_server(state))).decode()
    assert "kvpilot_planner_kv_blocks_difference_ratio{" in text
    assert "} 0.0" in text.split("kvpilot_planner_kv_blocks_difference_ratio{")[1].split("\n")[0]
    console = Console(width=200, record=True)
    console.print(render(state.latest, (), state.calibrations))
    printed = console.export_text()
    assert "server reports 1024" in printed and "diff +0" in printed


def test_the_model_config_is_found_from_the_server_argv() -> None:
    argv = tuple(build_argv(ServerSpec(port=8000)))
    assert model_config_of(argv) == TINY_MODEL_DIR / "config.json"
    assert model_config_of(("vllm", "serve", "org/remote-model")) is None
    assert model_config_of(None) is None
