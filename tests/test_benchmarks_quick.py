"""The benchmarks' short modes run in CI: they must run, and their goals must hold."""

from __future__ import annotations

import asyncio
import gc
import io
import itertools
import logging
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvpilot.agent.app import loop_watch
from kvpilot.agent.app.logs import JsonFormatter
from kvpilot.agent.app.tick_loop import TickLoop
from kvpilot.tuner.problem.objective import TrialOutcome, TrialResult

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # the tuner benchmark's modules

import soak  # noqa: E402
import tuner_goals as goals  # noqa: E402
import tuner_landscapes as landscapes  # noqa: E402
import tuner_replay as replay  # noqa: E402

# The committed landscapes' grid: KV budgets in 32-token blocks x max_num_seqs.
GRID = [
    (blocks * landscapes.BYTES_PER_BLOCK, seqs)
    for seqs in (8, 16, 32, 64, 128)
    for blocks in (48, 96, 192, 384, 768)
]


def _run(script: str, *args: str) -> str:
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_collect_cycle_costs_under_a_quarter_of_the_library_parser() -> None:
    out = _run("collect_cycle.py", "--quick")
    ratio = float(out.split("ratio (cycle / prometheus_client):")[1].split()[0])
    assert ratio <= 0.25


def _window(goodput: float, feasible: bool) -> TrialResult:
    outcome = TrialOutcome.FEASIBLE if feasible else TrialOutcome.SLO_BROKEN
    return TrialResult(outcome, goodput, None, None if feasible else "slow")


def test_a_cell_is_the_median_window_and_feasible_by_majority() -> None:
    windows = [_window(300.0, True), _window(50.0, False), _window(100.0, True)]
    row = landscapes.cell_row(1024, 8, windows, [None, 0.5, 0.7], (12.0, 30.0))
    assert row["goodput_tokens_per_s"] == "100"
    assert row["feasible"] == "1"
    assert (row["windows_feasible"], row["goodput_min"], row["goodput_max"]) == ("2/3", "50", "300")
    assert row["goodput_windows"] == "300;50;100"
    assert row["prefix_hit_ratio"] == "0.6"
    assert row["windows_feasible_each"] == "1;0;1"  # which windows, for the noisy replay
    one_of_three = landscapes.cell_row(1024, 8, windows[1:2] * 2 + windows[:1], [None] * 3, (0, 0))
    assert (one_of_three["feasible"], one_of_three["reason"]) == ("0", "slow")


def test_the_table_is_appended_cell_by_cell_and_a_rerun_sees_what_is_there(
    tmp_path: Path,
) -> None:
    table = tmp_path / "t.csv"
    assert landscapes.measured_cells(table) == set()
    row = landscapes.cell_row(2048, 4, [_window(10.0, True)], [None], (1.0, 2.0))
    landscapes.append_row(table, ("made by: the command",), row)
    landscapes.append_row(table, ("made by: the command",), {**row, "max_num_seqs": "8"})
    assert landscapes.measured_cells(table) == {(2048, 4), (2048, 8)}
    text = table.read_text()
    assert text.startswith("# made by: the command\n") and text.count("# made by") == 1
    assert replay.load_table(table)[(2048, 8)].score == 10.0


def test_a_second_pass_is_measured_apart_and_pooled_with_the_first(tmp_path: Path) -> None:
    table = tmp_path / "t.csv"
    first = [_window(100.0, True), _window(110.0, True), _window(120.0, True)]
    second = [_window(10.0, False), _window(20.0, False), _window(400.0, True)]
    landscapes.append_row(table, (), landscapes.cell_row(1, 4, first, [None] * 3, (0, 0), 1))
    assert landscapes.measured_cells(table, 2) == set()
    landscapes.append_row(table, (), landscapes.cell_row(1, 4, second, [None] * 3, (0, 0), 2))
    assert landscapes.measured_cells(table, 2) == {(1, 4)}
    cell = replay.load_table(table)[(1, 4)]
    assert cell.score == 105.0  # the median of all six windows
    assert cell.feasible  # 4 of 6 windows


def test_a_pass_the_header_sets_aside_is_named_and_not_pooled(
    tmp_path: Path,
) -> None:
    table = tmp_path / "t.csv"
    loaded = [_window(900.0, True)] * 3
    quiet = [_window(100.0, True)] * 3
    header = ("pass 1: 18:38-19:24 UTC; not replayed: measured under load average 4-19",)
    landscapes.append_row(table, header, landscapes.cell_row(1, 4, loaded, [None] * 3, (0, 0), 1))
    landscapes.append_row(table, header, landscapes.cell_row(1, 4, quiet, [None] * 3, (0, 0), 2))
    assert replay.excluded_passes(table) == {1: "measured under load average 4-19"}
    # The replay pools the complete passes it may use: here pass 2 only.
    assert replay.load_table(table, {2})[(1, 4)].score == 100.0
    noisy, lines = goals.prepared(goals.Source("t", table, [(1, 4)], "finish"), None)
    assert noisy is not None and noisy[(1, 4)].truth.score == 100.0
    assert {w.score for w in noisy[(1, 4)].windows} == {100.0}  # pass 2's
    assert "pass 1: 1 of 1 cells, not used (measured under load average 4-19)" in lines[0]


def test_the_prefix_landscape_shares_one_prefix_per_group_and_window() -> None:
    ls = landscapes.BY_NAME["prefix"]
    first, second = ls.plan(0), ls.plan(1)
    n, groups = ls.prefix_len, ls.prefix_groups
    heads = [item.prompt[:n] for item in first]
    assert all(heads[i] == heads[i % groups] for i in range(len(heads)))
    assert len(set(heads)) == groups
    assert {item.prompt[:n] for item in second}.isdisjoint(heads)  # each window starts cold
    # The suffix is the request's own: same length rule as the workload's prompt_len.
    assert all(32 <= len(item.prompt) - n <= 96 for item in first)


@pytest.mark.slow
def test_soak_runs_against_every_kind_of_flapping_server() -> None:
    # 45 s: the agent must survive every mode and report each goal; the figures are for
    # the 30-minute run, not asserted here (the machine is shared).
    out = _run("soak.py", "--quick")
    assert "modes ok, restart, garbage, drip, huge, refused, nan" in out
    assert out.count("goal ") == 4


@pytest.mark.slow
def test_agent_footprint_runs_the_baseline_and_the_candidate() -> None:
    # HEAD as the baseline: every checkout holds it, a shallow one perhaps not the default.
    out = _run("agent_footprint.py", "--quick", "--baseline", "HEAD")
    # A run whose agent did not tick exits 1 (checked in `_run`); these lines say both ran.
    for servers in (1, 2):
        for kind in ("baseline", "candidate"):
            assert f"{servers} server(s), round 1, {kind}: " in out
        assert f"\n{servers} server(s)\n" in out
    assert out.count("ratio candidate / baseline") == 2
    assert "goal 1 server(s), CPU under 0.25 % of a core at 1 Hz: " in out


def test_a_row_appended_to_a_table_begun_before_a_new_column_keeps_its_columns(
    tmp_path: Path,
) -> None:
    table = tmp_path / "old.csv"
    old_columns = [c for c in landscapes.COLUMNS if c != "windows_feasible_each"]
    table.write_text("# made by: an older command\n" + ",".join(old_columns) + "\n")
    windows = [_window(300.0, True), _window(50.0, False), _window(100.0, True)]
    landscapes.append_row(table, (), landscapes.cell_row(8, 4, windows, [None] * 3, (0, 0), 2))
    rows = landscapes.read_rows(table)
    assert list(rows[0]) == old_columns  # no value shifted under another column's name
    assert (rows[0]["pass"], rows[0]["goodput_windows"]) == ("2", "300;50;100")


def test_quick_replay_prints_every_strategy_the_goals_and_the_paired_tests() -> None:
    out = _run("tuner_efficiency.py", "--quick", "--landscapes", "stream", "--mirror", "none")
    section = out.split("landscape stream: 25 cells")[1]
    for strategy in ("bayesian", "random", "auto_tune", "optuna-gp", "optuna-tpe"):
        assert f"\n  {strategy} " in section, out
    verdicts = [line.strip() for line in section.splitlines() if line.startswith("  goal ")]
    assert len(verdicts) == 3, out
    assert all(
        re.search(r"^goal stream, .+: (met|NOT met|not judged) \(", line) for line in verdicts
    ), verdicts
    # One landscape is too few for a test across landscapes, and the output says so.
    assert "bayesian < optuna-gp: no test: 1 landscape(s), fewer than 6" in out, out


def test_every_committed_landscape_is_complete_on_the_benchmark_grid() -> None:
    for ls in landscapes.LANDSCAPES:
        noisy, lines = goals.prepared(goals.Source(ls.name, ls.table, GRID, "finish"), None)
        assert noisy is not None and len(noisy) == 25, lines
        assert all(len(cell.windows) >= 3 for cell in noisy.values()), ls.name


def test_passes_replays_only_the_passes_asked_for() -> None:
    chat = goals.Source("chat", landscapes.BY_NAME["chat"].table, GRID, "finish")
    _, lines = goals.prepared(chat, {4})
    assert "pass 3: 25 of 25 cells, not used (not asked for)" in lines[0], lines
    assert "pass 4: 25 of 25 cells" in lines[0] and "pass 4: 25 of 25 cells, not" not in lines[0]
    nothing, lines = goals.prepared(chat, {9})
    assert nothing is None and "not judged (no complete pass among those asked for)" in lines[-1]


def test_reversed_kv_mirrors_the_budgets_and_keeps_every_cell() -> None:
    a, b, c = (replay.Cell(float(g), True, "") for g in (1, 2, 3))
    table = {(1024, 8): a, (2048, 8): b, (4096, 8): c, (4096, 16): a}
    assert replay.reversed_kv(table) == {(4096, 8): a, (2048, 8): b, (1024, 8): c, (1024, 16): a}


def _got(
    receiver: str, fingerprint: str, incident: str, status: str, at_s: float = 0.0
) -> soak.Received:
    return soak.Received(receiver, fingerprint, incident, status, at_s)


def test_the_soak_finds_every_kind_of_event_out_of_order_per_receiver_and_alert() -> None:
    in_order = [
        _got("a", "f1", "i1", "firing"),
        _got("a", "f2", "j1", "firing"),  # another alert between: its own lane
        _got("a", "f1", "i1", "firing"),  # a repeat
        _got("a", "f1", "i1", "resolved"),
        _got("a", "f1", "i1", "resolved"),  # re-sent (at least once)
        _got("a", "f1", "i2", "firing"),  # the alert fires again: a new incident
        _got("b", "f1", "i1", "firing"),  # another receiver keeps its own order
    ]
    assert soak.order_faults(in_order) == []
    faults = soak.order_faults(
        [
            _got("a", "f1", "i1", "resolved"),  # resolved with no firing before it
            _got("b", "f1", "i1", "firing"),
            _got("b", "f1", "i1", "resolved"),
            _got("b", "f1", "i1", "firing"),  # a firing after its resolved
            _got("c", "f1", "i1", "firing"),
            _got("c", "f1", "i2", "firing"),  # began before i1 resolved
            _got("c", "f1", "i1", "resolved"),  # i1 back after i2 began
        ]
    )
    assert faults == [
        "a, alert f1, incident i1: resolved before any firing",
        "b, alert f1, incident i1: firing after its resolved",
        "c, alert f1, incident i2: began before incident i1 resolved",
        "c, alert f1, incident i1: resolved after a later incident began",
    ]


def test_a_receiver_misses_only_what_another_had_before_the_catch_up_time() -> None:
    got = [
        _got("fast", "f1", "i1", "firing", 10.0),
        _got("fast", "f1", "i1", "resolved", 20.0),
        _got("fast", "f2", "j1", "firing", 95.0),  # too recent to be owed yet
        _got("slow", "f1", "i1", "firing", 12.0),
    ]
    assert soak.missing(got, ("fast", "slow", "silent"), before_s=90.0) == {
        "fast": 0,
        "slow": 1,  # f1's resolved
        "silent": 2,
    }


def test_the_largest_gap_counts_ticks_that_stopped_until_the_window_ends() -> None:
    starts = [9.5, 10.5, 11.5, 12.5]
    assert soak.largest_gap(starts, 10.0, 12.6) == pytest.approx(1.0)  # 9.5 -> 10.5
    assert soak.largest_gap(starts, 10.0, 20.0) == pytest.approx(7.5)  # 12.5 -> the end
    assert soak.largest_gap([], 10.0, 20.0) == pytest.approx(10.0)


def test_the_soak_reads_tick_starts_and_slow_callbacks_from_the_agents_own_log(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The lines as the agent writes them (its JSON formatter), from a real tick loop on a
    loop the agent's watch turned on: one tick waits 150 ms off the CPU (as a process the
    kernel set aside does), another spends 150 ms of CPU; asyncio's wall-clock measure sees
    both, the CPU measure only the second."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter())
    watched = [logging.getLogger(name) for name in ("asyncio", loop_watch.__name__)]
    for logger in watched:
        logger.addHandler(handler)
    monkeypatch.setenv(loop_watch.WATCH_LOOP_ENV, "1")
    # The watch times every callback of the process: undone when the test ends.
    monkeypatch.setattr(asyncio.events.Handle, "_run", asyncio.events.Handle._run)
    ticks = 0
    five = asyncio.Event()

    async def tick() -> None:
        nonlocal ticks
        ticks += 1
        if ticks == 3:
            time.sleep(0.15)  # noqa: ASYNC251 - the loop waits, off the CPU
        if ticks == 4:
            spent = time.thread_time() + 0.15
            while time.thread_time() < spent:  # a parse that holds the loop on the CPU
                pass
        if ticks == 5:
            five.set()

    async def main() -> None:
        assert loop_watch.watch_loop_if_asked(asyncio.get_running_loop())
        stop = asyncio.Event()
        loop = TickLoop(tick, interval_s=0.05, on_start=loop_watch.log_tick_start)
        running = asyncio.create_task(loop.run(stop))
        try:
            await asyncio.wait_for(five.wait(), timeout=10.0)
        finally:
            stop.set()
        await running

    try:
        asyncio.run(main())
    finally:
        for logger in watched:
            logger.removeHandler(handler)
        gc.callbacks.remove(loop_watch._time_collections)
    text = out.getvalue()
    starts = soak.tick_starts(text)
    assert len(starts) >= 5 and starts == sorted(starts)
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    assert max(gaps) >= 0.15  # the held loop shows as a gap between starts
    slow = soak.slow_callbacks(text)
    assert len(slow) == 2 and all(c.took_s >= 0.15 and "tick" in c.what for c in slow)
    on_cpu = soak.cpu_slow_callbacks(text)
    assert len(on_cpu) == 1 and (on_cpu[0].cpu_s or 0.0) >= 0.15 and "tick" in on_cpu[0].what
    # Stamped as the 4th tick's callback began, just before it logged its start.
    assert on_cpu[0].at_s is not None and starts[2] < on_cpu[0].at_s <= starts[3]


def test_the_loop_watch_is_off_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(loop_watch.WATCH_LOOP_ENV, raising=False)

    async def main() -> bool:
        return loop_watch.watch_loop_if_asked(asyncio.get_running_loop())

    assert asyncio.run(main()) is False
    assert asyncio.run(main()) is False  # and asked again, still off: nothing was switched on
