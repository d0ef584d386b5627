"""The tuner benchmark's replay: noisy trials, memory priced, the anchors, goals, tables by path."""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

import pytest

from kvpilot.tuner.problem.objective import TrialOutcome, TrialResult
from kvpilot.tuner.suggest.base import objective_value

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # the tuner benchmark's modules

import tuner_efficiency as bench  # noqa: E402
import tuner_goals as goals  # noqa: E402
import tuner_landscapes as landscapes  # noqa: E402
import tuner_noise as noise  # noqa: E402
import tuner_regret as regret  # noqa: E402
import tuner_strategies as strategies  # noqa: E402
from tuner_replay import CAPACITY, GOODPUT, Cell  # noqa: E402

KV = (1024, 2048, 4096)
SEQS = (4, 8, 16)


def _window(goodput: float, feasible: bool) -> TrialResult:
    outcome = TrialOutcome.FEASIBLE if feasible else TrialOutcome.SLO_BROKEN
    return TrialResult(outcome, goodput, None, None if feasible else "slow")


def _small_table(path: Path) -> Path:
    """3 x 3 cells: 4 sequences break the SLO; goodput grows with sequences and stops
    growing above 2048 bytes of KV, so the memory-priced best is (2048, 16)."""
    for seqs in SEQS:
        for kv in KV:
            base = 100.0 * seqs * (0.5 if kv == KV[0] else 1.0)
            ok = seqs > SEQS[0]
            windows = [_window(base * f, ok) for f in (0.9, 1.0, 1.1)]
            row = landscapes.cell_row(kv, seqs, windows, [None] * 3, (1.0, 2.0))
            landscapes.append_row(path, ("made by: this test",), row)
    return path


def _noisy(goodputs: dict[tuple[int, int], tuple[float, bool]]) -> noise.NoisyTable:
    return {
        key: noise.NoisyCell(Cell(g, ok, "" if ok else "slow"), (noise.Window(g, float(ok)),))
        for key, (g, ok) in goodputs.items()
    }


def test_a_trial_draws_one_of_the_cells_windows_not_its_median() -> None:
    windows = tuple(noise.Window(g, 1.0) for g in (100.0, 300.0, 500.0))
    cell = noise.NoisyCell(Cell(300.0, True, ""), windows)
    drawn = [noise.draw(cell, seed, (1, 8), 0).score for seed in range(60)]
    assert set(drawn) == {100.0, 300.0, 500.0}
    # Seeded by (seed, cell, visit): every strategy meets the same window on a first visit.
    assert noise.draw(cell, 7, (1, 8), 0) == noise.draw(cell, 7, (1, 8), 0)
    assert {noise.draw(cell, 7, (1, 8), v).score for v in range(30)} == set(drawn)


def test_a_drawn_windows_feasibility_is_its_own_or_its_rows_share(tmp_path: Path) -> None:
    table = tmp_path / "t.csv"
    windows = [_window(300.0, True), _window(50.0, False), _window(100.0, True)]
    landscapes.append_row(table, (), landscapes.cell_row(8, 4, windows, [None] * 3, (0, 0)))
    cell = noise.load_noisy(table)[(8, 4)]
    draws = [noise.draw(cell, seed, (8, 4), 0) for seed in range(100)]
    assert all(d.feasible == (d.score != 50.0) for d in draws)
    # A committed table knows only the count ("2/3"): a window is feasible at that ratio.
    old = tmp_path / "old.csv"
    old.write_text(
        "kv_cache_memory_bytes,max_num_seqs,goodput_tokens_per_s,feasible,reason,"
        "windows_feasible,goodput_windows\n8,4,100,1,,2/3,300;50;100\n"
    )
    cell = noise.load_noisy(old)[(8, 4)]
    share = sum(noise.draw(cell, seed, (8, 4), 0).feasible for seed in range(300)) / 300
    assert 0.55 < share < 0.78


def test_the_memory_priced_best_is_the_least_kv_within_5_percent_of_the_best() -> None:
    table = {
        (4096, 8): Cell(1000.0, True, ""),
        (2048, 8): Cell(960.0, True, ""),
        (1024, 8): Cell(900.0, True, ""),
        (1024, 16): Cell(2000.0, False, "slow"),
    }
    best = regret.best_of(table)
    assert best == (2048, 8)
    assert regret.regret(table, best, (4096, 8)) == pytest.approx(0.5)  # twice the memory
    assert regret.regret(table, best, (1024, 8)) == pytest.approx(1 - 900 / 960)
    assert regret.regret(table, best, (1024, 16)) == 1.0  # infeasible
    assert regret.regret(table, best, None) == 1.0  # nothing to recommend


def test_a_recommendation_prices_memory_and_needs_most_windows_feasible() -> None:
    def trial(key: tuple[int, int], goodput: float, ok: bool) -> strategies.Trial:
        outcome = TrialOutcome.FEASIBLE if ok else TrialOutcome.SLO_BROKEN
        return strategies.Trial(key, noise.Drawn(outcome, goodput, key[0], None))

    seen = [trial((4096, 8), 1000.0, True), trial((2048, 8), 980.0, True)]
    assert regret.recommend(seen) == (2048, 8)
    flaky = [*seen, trial((1024, 8), 5000.0, True), trial((1024, 8), 5000.0, False)]
    assert regret.recommend(flaky) == (2048, 8)  # one window of two feasible: not enough
    assert regret.recommend([trial((1024, 8), 1.0, False)]) is None


def test_auto_tune_starts_once_at_the_largest_budget_then_walks_max_num_seqs() -> None:
    cells = {(kv, s): (float(s), True) for kv in KV for s in SEQS}
    run = strategies.auto_tune(_noisy(cells), seed=0, budget=16)
    assert [t.key for t in run.trials] == [(4096, 4), (4096, 8), (4096, 16)]
    assert (run.setup_starts, run.starts_after(16), run.starts_after(2)) == (1, 4, 3)
    failing = _noisy(cells)
    failing[(4096, 16)] = noise.NoisyCell(Cell(None, False, "failed to start: OOM"), ())
    nothing = strategies.auto_tune(failing, seed=0, budget=16)
    assert (nothing.trials, nothing.starts_after(16)) == ((), 1)


def test_optuna_samplers_search_the_table_under_constraints() -> None:
    pytest.importorskip("optuna")
    cells = _noisy({(kv, s): (float(s), s > 4) for kv in KV for s in SEQS})
    for name in strategies.OPTUNA_STRATEGIES:
        run = strategies.RUNNERS[name](cells, 3, 4)  # 3 random, then one from the model
        assert len(run.trials) == 4 and all(t.key in cells for t in run.trials), name
        assert run.starts_after(4) == 4
    tpe = strategies.RUNNERS["optuna-tpe"]
    assert tpe(cells, 3, 6) == tpe(cells, 3, 6)  # seeded


def test_a_paired_test_needs_six_landscapes_and_pairs_them() -> None:
    assert regret.paired_p([0.0] * 5, [1.0] * 5) is None
    lower = regret.paired_p([0.1 * i for i in range(8)], [0.1 * i + 0.2 for i in range(8)])
    assert lower == pytest.approx(1 / 256)
    assert regret.paired_p([0.5] * 8, [0.5] * 8) == 1.0


def _landscape(within: float, to_match: float, gp_regret: float) -> regret.Landscape:
    runs = 10
    hits = round(within * runs)
    ours = regret.Figures(
        {8: (0.0,) * hits + (0.3,) * (runs - hits)}, (16,) * runs, (to_match,) * runs
    )
    anchor = regret.Figures({8: (0.5,) * runs}, (6,) * runs, (math.inf,) * runs)
    gp = regret.Figures({8: (gp_regret,) * runs}, (16,) * runs, (math.inf,) * runs)
    figures = {"bayesian": ours, "auto_tune": anchor, "optuna-gp": gp}
    return regret.Landscape("x", 9, 6, (1, 8), 100.0, (4, 8), 101.0, figures)


def test_each_goal_says_met_or_not_met_with_its_figures() -> None:
    met = goals.goals(_landscape(0.8, 5.0, 0.2), None)
    assert [g.met for g in met] == [True, True, True]
    missed = goals.goals(_landscape(0.7, math.inf, 0.0), None)
    assert [g.met for g in missed] == [False, False, False]
    lines = [g.line("x") for g in missed]
    assert lines[0] == "  goal x, within 95 % at 8 trials in >= 80% of runs: NOT met (70% of runs)"
    assert "median never starts against auto_tune's 6" in lines[1]
    assert "mean 0.090 against 0.000" in lines[2]


def test_a_table_given_by_path_is_replayed_and_judged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    table = _small_table(tmp_path / "gpu.csv")
    assert bench.main(["--table", str(table), "--quick", "--mirror", "none"]) == 0
    out = capsys.readouterr().out
    assert "landscape gpu: 9 cells, 6 feasible;" in out
    assert "memory-priced best 1600 tok/s at kv=2 KiB seqs=16" in out
    assert out.count("  goal gpu, ") == 3
    assert "landscape chat" not in out  # a table by path replaces the built-in set


def test_a_table_that_is_not_a_landscape_table_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("kv,seqs\n1,2\n")
    assert bench.main(["--table", str(bad), "--quick"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {bad}: not a landscape table: no column kv_cache_memory_bytes")
    with pytest.raises(SystemExit) as exc:
        bench.main(["--table", str(tmp_path / "absent.csv")])
    assert exc.value.code == 2


def test_without_optuna_the_replay_says_so_and_judges_no_goal_against_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    why = "optuna is not installed (a dev dependency: .venv/bin/pip install optuna)"
    monkeypatch.setattr(goals, "optuna_missing", lambda: why)
    source = goals.Source("t", _small_table(tmp_path / "t.csv"), None, "finish")
    assert goals.replay_tables([source], seeds=1, checkpoints=(4, 8), mirror="none") == 0
    out = capsys.readouterr().out
    assert f"optuna-gp, optuna-tpe: not run: {why}" in out
    assert f"goal t, lower regret than optuna-gp: not judged ({why})" in out
    assert "\n  optuna-gp " not in out


def test_an_open_loop_landscape_sends_at_its_rate_into_its_own_table() -> None:
    chat = landscapes.BY_NAME["chat"]
    fast = landscapes.at_rate(chat, 2.0)
    assert (fast.name, fast.workload.rate_rps, fast.workload.concurrency) == (
        "chat-2rps",
        2.0,
        None,
    )
    assert fast.table.name == "landscape_chat-2rps.csv"
    planned = fast.plan(0)
    assert planned[-1].delay_s > 0.0 and planned[0].delay_s == 0.0  # arrivals spread, not a burst
    with pytest.raises(ValueError, match="positive"):
        landscapes.at_rate(chat, 0.0)


def _capacity_table(path: Path, with_capacity: bool = True) -> Path:
    """3 x 2 cells: goodput alone favours the largest budget (800 tok/s, nothing within 5 %),
    capacity at the SLO puts 2 KiB within 5 % of the best (9.7 of 10 req/s); at 1 KiB and 8
    sequences no rate held."""
    cells = [
        (1024, 4, 100, "2.0", ""),
        (2048, 4, 200, "3.0", ""),
        (4096, 4, 300, "3.1", ""),
        (1024, 8, 50, "", "no rate held down to 0.5 req/s"),
        (2048, 8, 400, "9.7", ""),
        (4096, 8, 800, "10.0", ""),
    ]
    extra = ",capacity_rps" if with_capacity else ""
    header = "kv_cache_memory_bytes,max_num_seqs,goodput_tokens_per_s,feasible,reason,pass"
    lines = ["# made by: this test", header + extra]
    for kv, seqs, goodput, capacity, reason in cells:
        row = f"{kv},{seqs},{goodput},{int(not reason)},{reason},1"
        lines.append(row + (f",{capacity}" if with_capacity else ""))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_table_with_capacity_is_scored_by_capacity_with_memory_priced(tmp_path: Path) -> None:
    table = noise.load_noisy(_capacity_table(tmp_path / "cap.csv"))
    truth = {key: cell.truth for key, cell in table.items()}
    assert truth[(2048, 8)].score == 9.7  # req/s at the SLO
    assert not truth[(1024, 8)].feasible
    assert truth[(1024, 8)].reason == "no rate held down to 0.5 req/s"
    assert regret.best_of(truth) == (2048, 8)  # within 5 % of 10 req/s, half the memory
    # The same cells without the column: goodput, where only the largest budget is best.
    plain_path = _capacity_table(tmp_path / "plain.csv", with_capacity=False)
    plain = noise.load_noisy(plain_path)
    assert regret.best_of({k: c.truth for k, c in plain.items()}) == (4096, 8)
    assert noise.score_kind(plain_path) == GOODPUT


def test_the_score_travels_under_its_own_name_and_is_what_a_suggester_maximises() -> None:
    # Capacity at the SLO never rides in a field named goodput inside the replay.
    replay_types = (Cell, noise.Window, noise.Drawn, strategies.Trial, regret.Landscape)
    named_goodput = [
        f"{kind.__name__}.{field.name}"
        for kind in replay_types
        for field in dataclasses.fields(kind)
        if "goodput" in field.name
    ]
    assert named_goodput == []
    # The tuner's TrialResult has one objective field; a suggester is told the score there.
    told = noise.Drawn(TrialOutcome.FEASIBLE, 9.7, 2048, None).as_trial_result()
    assert (objective_value(told), told.memory_bytes) == (9.7, 2048)
    broken = noise.Drawn(TrialOutcome.SLO_BROKEN, 3.0, 2048, "slow").as_trial_result()
    assert (objective_value(broken), broken.reason) == (None, "slow")


def test_a_capacity_cell_measured_twice_draws_either_ladder_and_is_judged_on_the_median(
    tmp_path: Path,
) -> None:
    path = _capacity_table(tmp_path / "cap.csv")
    with path.open("a") as handle:
        handle.write("2048,8,400,1,,2,8.5\n2048,8,0,0,no rate held,3,\n")
    cell = noise.load_noisy(path)[(2048, 8)]
    assert cell.truth.score == pytest.approx(9.1)  # median of 9.7 and 8.5
    assert cell.truth.feasible  # two ladders of three held a rate
    drawn = {noise.draw(cell, seed, (2048, 8), 0).score for seed in range(60)}
    assert drawn == {9.7, 8.5, None}


def test_the_replay_of_a_capacity_table_says_so_and_prices_memory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    table, gpu = _capacity_table(tmp_path / "cap.csv"), _small_table(tmp_path / "gpu.csv")
    args = ["--table", str(table), "--table", str(gpu), "--quick", "--mirror", "none"]
    assert bench.main(args) == 0
    out = capsys.readouterr().out
    assert "scored by capacity at the SLO (capacity_rps, req/s), memory priced" in out
    assert (
        "landscape cap: 6 cells, 5 feasible; best capacity 10 req/s at kv=4 KiB seqs=8; "
        "memory-priced best 9.7 req/s at kv=2 KiB seqs=8"
    ) in out
    assert "landscape gpu: 9 cells, 6 feasible; best goodput 1600 tok/s" in out
    assert out.count("  goal cap, ") == 3
    # The summary mixes both scores: each landscape's row names the one its regret is of.
    assert f"  {'landscape':<18}score    " in out
    words = [line.split() for line in out.splitlines()]
    rows = {w[0]: w[1] for w in words if w and w[0] in {"cap", "gpu"}}
    assert rows == {"cap": "capacity", "gpu": "goodput"}


def test_a_capacity_row_as_measured_is_replayed_by_capacity(tmp_path: Path) -> None:
    import tuner_capacity as capacity_mode

    from kvpilot.tuner.measure.capacity import Capacity, RateWindow

    held = Capacity(
        3.0,
        (RateWindow(2.0, 20, 20, 0, True), RateWindow(3.0, 30, 29, 0, True)),
        4.5,
    )
    none = Capacity(None, (RateWindow(2.0, 20, 3, 0, False), RateWindow(1.3, 13, 2, 0, False)), 1.3)
    failed = TrialResult.failed_to_start("", memory_bytes=1024)
    table = tmp_path / "landscape_t-capacity.csv"
    rows = [
        capacity_mode.capacity_row(2048, 4, held, _window(300.0, True), (60.0, 20.0), 1, 30.0),
        capacity_mode.capacity_row(1024, 4, none, None, (60.0, 20.0), 1, 30.0),
        capacity_mode.capacity_row(4096, 4, failed, None, (0.0, 20.0), 1, 30.0),
    ]
    for row in rows:
        landscapes.append_row(table, ("made by: this test",), row, capacity_mode.CAPACITY_COLUMNS)
    assert rows[0]["capacity_ladder"] == "2+(20/20) 3+(29/30)"
    assert rows[1]["reason"] == "no rate held down to 1.3 req/s"
    assert rows[2]["reason"].startswith("failed to start")
    assert capacity_mode.describe(rows[0]) == "capacity 3 req/s [2+(20/20) 3+(29/30)]"
    top_held = Capacity(3.0, held.windows, None)
    floor = capacity_mode.capacity_row(2048, 4, top_held, None, (1.0, 1.0), 1, 30.0)
    assert "(a floor: the ladder's top held)" in capacity_mode.describe(floor)
    assert capacity_mode.describe(rows[1]) == (
        "capacity none [2-(3/20) 1.3-(2/13)] no rate held down to 1.3 req/s"
    )
    cells = noise.load_noisy(table)
    assert noise.score_kind(table) == CAPACITY
    assert cells[(2048, 4)].truth == Cell(3.0, True, "")
    assert not cells[(1024, 4)].truth.feasible and not cells[(4096, 4)].truth.feasible
    drawn = noise.draw(cells[(4096, 4)], 0, (4096, 4), 0)
    assert drawn.outcome is TrialOutcome.FAILED_TO_START


def test_the_capacity_measure_refuses_a_window_that_is_no_window(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--measure", "--capacity", "--out-dir", str(tmp_path), "--landscapes", "chat"]
    assert bench.main([*args, "--window-s", "0"]) == 2
    assert "a ladder needs a positive window" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # nothing started, nothing written


def test_a_long_table_name_keeps_the_summary_columns_apart(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    table = _capacity_table(tmp_path / "landscape_chat-capacity.csv")
    assert bench.main(["--table", str(table), "--quick", "--mirror", "none"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    (row,) = [w for w in rows if w and w[0] == "landscape_chat-capacity"]
    assert row[1] == "capacity"


def test_a_landscape_measured_by_capacity_only_is_replayed_by_its_table_not_its_name(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert {"chat-tight", "stream-tight"} <= set(landscapes.BY_NAME)
    with pytest.raises(SystemExit) as exited:
        bench.main(["--landscapes", "chat-tight"])
    assert exited.value.code == 2
    assert "chat-tight: measured by capacity only" in capsys.readouterr().err


def test_a_windows_record_keeps_each_requests_own_p95_gap_the_slo_judges() -> None:
    from capacity import request_records

    from kvpilot.tuner.load.generator import LoadReport, RequestResult
    from kvpilot.tuner.problem.objective import Slo, attains

    gaps = (0.004,) * 19 + (0.040,) * 2  # a mean of 7.4 ms, a p95 of 40 ms
    times = [0.1]
    for gap in gaps:
        times.append(times[-1] + gap)
    result = RequestResult(0, 16, 22, 0.0, times[-1], 0.1, tuple(times), 22, None)
    assert result.inter_token_s == pytest.approx(gaps)
    (record,) = request_records(LoadReport(0.0, times[-1], (result,)))
    assert record["inter_token_s"] == pytest.approx(sum(gaps) / len(gaps))
    assert record["inter_token_p95_s"] == pytest.approx(0.040)
    # The mean alone would say the 10 ms limit holds; the request's own p95 says it does not.
    slo = Slo(ttft_p95_s=2.0, inter_token_p95_s=0.010)
    assert record["inter_token_s"] < slo.inter_token_p95_s and not attains(result, slo)


def test_a_tight_landscape_is_its_burst_traffic_under_a_tighter_inter_token_limit() -> None:
    for tight in landscapes.CAPACITY_ONLY:
        burst = landscapes.BY_NAME[tight.name.removesuffix("-tight")]
        assert (tight.workload, tight.prefix_len, tight.prefix_groups) == (
            burst.workload,
            burst.prefix_len,
            burst.prefix_groups,
        )
        assert tight.slo.ttft_p95_s == burst.slo.ttft_p95_s
        assert tight.slo.inter_token_p95_s < burst.slo.inter_token_p95_s


def test_simulated_landscapes_are_independent_and_keep_the_product_objective() -> None:
    """Dev and test seeds draw different landscapes; the knee errs against the planner and
    the chunk knee against two prompts a step; the least feasible KV is a real boundary
    (one block less no longer holds the target); a failed start costs its seconds; the
    registered suggesters are strategies by name."""
    from tuner_sim import DEV_SEEDS, TEST_SEEDS, Config, draw_landscape
    from tuner_sim_run import FAILED_START_S, registered_suggesters, run_trials

    dev = [draw_landscape(s) for s in DEV_SEEDS]
    test = [draw_landscape(s) for s in TEST_SEEDS]
    assert {ls.target_rps for ls in dev}.isdisjoint(ls.target_rps for ls in test)
    errors = [ls.need * ls.seq_bytes / ls.planner_knee_bytes for ls in dev]
    assert min(errors) < 0.9 and max(errors) > 1.1  # the planner's estimate is not the truth
    chunks = [ls.chunk_knee_tokens / (2 * ls.prompt_tokens) for ls in dev]
    assert min(chunks) < 0.9 and max(chunks) > 1.1  # nor is two prompts a step
    ls = dev[0]
    least = ls.least_feasible_blocks()
    assert least is not None
    block = ls.geometry.bytes_per_block
    levels = sorted({round(512 * 32 ** (i / 63)) for i in range(64)})

    def held(blocks: int) -> bool:
        return any(
            ls.starts(c) and ls.capacity(c) >= ls.target_rps
            for t in levels
            for s in range(1, min(t, 512) + 1)
            for c in [Config(blocks * block, s, t)]
        )

    assert held(least) and not held(least - 1)
    cliff = Config(ls.free_bytes, 8, 4096)
    assert not ls.starts(cliff)
    asks = iter([cliff, None])
    record = run_trials(ls, lambda: next(asks), lambda *_: None, 0, lambda _c: 1.0)
    assert record.failed_starts == 1 and record.elapsed_s == FAILED_START_S
    assert {"bayes", "random"} <= set(registered_suggesters())


def test_quick_simulated_benchmark_reports_regret_floor_and_the_discrimination_verdict(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from tuner_sim_bench import report

    assert report((0,), ("random", "bayes"), 1, "bayes") == 0
    out = capsys.readouterr().out
    assert "noise floor" in out and "random search meets the goal on" in out
    assert "bayes" in out


def test_the_noise_floor_is_what_a_search_of_every_cell_pays_to_the_noise() -> None:
    """One window a cell: no noise, a floor of 0. Two ladders a cell where the small budget
    sometimes reads within 5 % of the large one though its truth is not: a perfect search
    picks it in some draws, and the floor is the mean of those regrets."""
    exact = _noisy({(1024, 8): (90.0, True), (2048, 8): (100.0, True)})
    assert regret.noise_floor(exact) == 0.0
    small = noise.NoisyCell(
        Cell(90.0, True, ""), (noise.Window(80.0, 1.0), noise.Window(99.0, 1.0))
    )
    large = noise.NoisyCell(Cell(100.0, True, ""), (noise.Window(100.0, 1.0),))
    floor = regret.noise_floor({(1024, 8): small, (2048, 8): large})
    # Picking (1024, 8) scores 1 - min(90 / 100, 2048 / 1024 capped at 1) = 0.1, about half
    # the draws.
    assert 0.02 < floor < 0.08
