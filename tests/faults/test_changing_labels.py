"""Label values that change on every scrape, or run long, cost the parser a bounded amount of
memory: its memos of line heads and label blocks are bounded in bytes, not in entries."""

from __future__ import annotations

import gc
import tracemalloc
from dataclasses import replace
from pathlib import Path

from kvpilot.agent.tick.calibration import PlannerCheck
from kvpilot.collectors.promtext import clear_caches, parse_samples
from kvpilot.collectors.vllm_parse import VllmScrape, parse_vllm_metrics

MIB = 1 << 20
TINY_CONFIG = Path(__file__).resolve().parents[2] / "rig" / "models" / "tiny-llama" / "config.json"


def _body(i: int, value_chars: int) -> str:
    """A scrape whose one label value is new each time, `value_chars` long."""
    label = f"{i:08d}" + "x" * (value_chars - 8)
    return (
        f'vllm:num_requests_running{{engine="0",model_name="m",req="{label}"}} 1\n'
        f'vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} 0.5\n'
    )


def _retained_after(bodies: int, value_chars: int) -> int:
    """Bytes still held once `bodies` scrapes have been parsed and dropped."""
    clear_caches()
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(bodies):
            parse_vllm_metrics(_body(i, value_chars), taken_at_s=i, wall_time_s=i)
        gc.collect()
        return tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
        clear_caches()


def test_labels_that_change_every_scrape_hold_at_most_the_memo_budget() -> None:
    """300 scrapes with a fresh 40 KB label each: 12 MB of distinct text went through."""
    retained = _retained_after(300, 40_000)
    bound = 14 * MIB  # the memos' 12 MiB, and the interpreter's slack
    assert retained < bound, f"{retained / MIB:.1f} MiB kept after the bodies were dropped"


def test_a_label_larger_than_a_memo_share_is_parsed_every_time_and_never_kept() -> None:
    retained = _retained_after(10, 600_000)  # 600 KB per label value
    assert retained < 2 * MIB, f"{retained / MIB:.1f} MiB kept"


def test_memos_still_give_the_same_samples_once_emptied() -> None:
    text = _body(1, 100)
    first = parse_samples(text)
    for i in range(2, 2_000):  # enough new heads to pass a budget and empty the memo
        parse_samples(_body(i, 5_000))
    assert parse_samples(text) == first


def test_the_planner_check_keeps_one_comparison_per_engine_present() -> None:
    """cache_config_info labels that change on every scrape (a 40 KB value each time)."""
    text = (TINY_CONFIG.parents[3] / "tests/fixtures/vllm/v0_32_under_load.prom").read_text()
    (engine,) = parse_vllm_metrics(text, taken_at_s=0.0, wall_time_s=0.0)
    planner = PlannerCheck(TINY_CONFIG)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(200):
            config = (*engine.cache_config, ("zz_changing", f"{i:08d}" + "x" * 40_000))
            scrape = VllmScrape(i, i, (replace(engine, cache_config=config),), None)
            (found,) = planner.check(scrape)
            assert found.engine == "0"
        gc.collect()
        retained = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert retained < 1 * MIB, f"{retained / MIB:.1f} MiB kept by the planner check"
