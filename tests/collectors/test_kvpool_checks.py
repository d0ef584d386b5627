"""The kvpool reader's edge checks: block counts that cannot all be true, impossible single
figures and conflicting duplicates become None with the reason; sound figures pass."""

from __future__ import annotations

import pytest

from kvpilot.collectors.kvpool.client import KvPoolScrape, samples_to_scrape
from kvpilot.collectors.promtext import parse_samples

ENGINE = '{engine="0",model_name="m"}'
DEVICE = '{device="0",rank="0"}'


def scrape(text: str) -> KvPoolScrape:
    return samples_to_scrape(
        parse_samples(text, prefixes=("kvpool_",)), taken_at_s=1.0, wall_time_s=2.0
    )


def blocks(total: str, free: str, cached: str, empty: str, longest: str, *extra: str) -> str:
    lines = [
        f"kvpool_blocks_usable{ENGINE} {total}",
        f"kvpool_blocks_free{ENGINE} {free}",
        f"kvpool_blocks_free_cached{ENGINE} {cached}",
        f"kvpool_blocks_empty{ENGINE} {empty}",
        f"kvpool_longest_free_run_blocks{ENGINE} {longest}",
        *extra,
    ]
    return "\n".join(lines) + "\n"


def reasons(sample: object) -> set[tuple[str, str]]:
    return {(r.field, r.reason) for r in sample.refused}  # type: ignore[attr-defined]


def test_sound_counts_give_the_rate() -> None:
    (engine,) = scrape(blocks("1000", "500", "100", "400", "450")).engines
    assert (engine.blocks_total, engine.blocks_free, engine.longest_free_run_blocks) == (
        1000,
        500,
        450,
    )
    assert engine.fragmentation is not None and engine.fragmentation.ratio == pytest.approx(0.1)
    assert engine.refused == ()


@pytest.mark.parametrize(
    ("counts", "why"),
    [
        (("100", "500", "0", "500", "100"), "500 free blocks of 100"),
        (("1000", "500", "100", "400", "600"), "longest free run of 600 blocks with 500 free"),
        (("1000", "500", "100", "400", "0"), "no free run with 500 blocks free"),
        (("1000", "500", "100", "300", "450"), "100 cached + 300 empty blocks with 500 free"),
    ],
)
def test_contradictory_counts_are_all_unknown_and_the_rate_says_why(
    counts: tuple[str, ...], why: str
) -> None:
    (engine,) = scrape(blocks(*counts)).engines
    assert engine.blocks_total is None and engine.blocks_free is None
    assert engine.longest_free_run_blocks is None and engine.blocks_empty is None
    assert engine.fragmentation is not None and engine.fragmentation.ratio is None
    assert why in (engine.fragmentation.reason or "")
    assert reasons(engine) == {("blocks", "contradictory")}


def test_a_negative_longest_run_is_no_rate_of_three() -> None:
    (engine,) = scrape(blocks("1000", "500", "100", "400", "-1000")).engines
    assert engine.fragmentation is None and engine.longest_free_run_blocks is None
    assert reasons(engine) == {("longest_free_run_blocks", "negative")}
    assert engine.blocks_free == 500  # the sound counts are kept


@pytest.mark.parametrize(
    ("line", "field", "reason"),
    [
        (
            f"kvpool_internal_fragmentation_ratio{ENGINE} 1.5",
            "internal_fragmentation_ratio",
            "out_of_range",
        ),
        (f"kvpool_requests_running{ENGINE} +Inf", "requests_running", "non_finite"),
        (f"kvpool_preemptions_total{ENGINE} -4", "preemptions_total", "negative"),
        (f"kvpool_block_size_tokens{ENGINE} 0", "block_size_tokens", "out_of_range"),
        (f"kvpool_snapshot_age_seconds{ENGINE} NaN", "snapshot_age_s", "non_finite"),
        (f"kvpool_scheduler_steps_total{ENGINE} 1.5", "scheduler_steps_total", "not_integer"),
    ],
)
def test_impossible_single_figures(line: str, field: str, reason: str) -> None:
    (engine,) = scrape(blocks("1000", "500", "100", "400", "450", line)).engines
    assert getattr(engine, field) is None
    assert reasons(engine) == {(field, reason)}
    assert engine.fragmentation is not None and engine.fragmentation.ratio is not None


def test_a_conflicting_duplicate_is_unknown_and_an_identical_one_harmless() -> None:
    text = blocks("1000", "500", "100", "400", "450", f"kvpool_blocks_free{ENGINE} 500")
    (engine,) = scrape(text).engines
    assert engine.blocks_free == 500 and engine.refused == ()
    text = blocks("1000", "500", "100", "400", "450", f"kvpool_longest_free_run_blocks{ENGINE} 40")
    (engine,) = scrape(text).engines
    assert engine.longest_free_run_blocks is None and engine.fragmentation is None
    assert reasons(engine) == {("longest_free_run_blocks", "duplicate_series")}


def allocator(ratio: str = "0.333", **figures: str) -> str:
    base = {
        "reserved_bytes": "1000",
        "allocated_bytes": "600",
        "active_bytes": "700",
        "free_in_reserved_bytes": "300",
        "largest_free_block_bytes": "200",
    }
    lines = [f"kvpool_allocator_{k}{DEVICE} {v}" for k, v in {**base, **figures}.items()]
    lines.append(f'kvpool_fragmentation_ratio{{device="0",rank="0",source="allocator"}} {ratio}')
    return "\n".join(lines) + "\n"


def test_allocator_sound_and_contradictory() -> None:
    (sound,) = scrape(allocator()).allocators
    assert sound.fragmentation_ratio == pytest.approx(0.333) and sound.refused == ()
    for figures in ({"allocated_bytes": "2000"}, {"largest_free_block_bytes": "400"}):
        (device,) = scrape(allocator(**figures)).allocators
        assert device.fragmentation_ratio is None and device.reserved_bytes is None
        assert reasons(device) == {("allocator", "contradictory")}
    (device,) = scrape(allocator(ratio="3.0")).allocators
    assert device.fragmentation_ratio is None
    assert reasons(device) == {("fragmentation_ratio", "out_of_range")}


def test_impossible_plugin_error_counts_are_refused_at_scrape_level() -> None:
    text = blocks("1000", "500", "100", "400", "450", 'kvpool_plugin_errors_total{part="a"} -1')
    got = scrape(text)
    assert got.plugin_errors == ()
    assert {(r.field, r.reason) for r in got.refused} == {("plugin_errors_total[a]", "negative")}
