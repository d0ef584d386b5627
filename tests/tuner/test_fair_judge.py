"""The judge counts what users feel; KV usage is shown beside it, never counted. The baseline's
goodput and memory, and the warm-up, are kept in the trial and shown wherever a trial is."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence

import pytest
from rich.console import Console

from kvpilot.agent.state.db import Database
from kvpilot.agent.state.trials import SqliteTrialStore
from kvpilot.tuner.judge.evidence import Counts
from kvpilot.tuner.judge.judgement import (
    DEFAULT_METRICS,
    LIVE_METRICS,
    Classification,
    JudgeConfig,
    Verdict,
    judge,
)
from kvpilot.tuner.problem.objective import TrialOutcome, TrialResult
from kvpilot.tuner.report.html import render_report
from kvpilot.tuner.report.table import summary_line, trials_table
from kvpilot.tuner.rollout.canary import Strategy
from kvpilot.tuner.session import SessionSummary
from kvpilot.tuner.trials import TrialState, Warmup, new_trial, trial_from_dict, trial_to_dict
from tests.tuner.rollout.test_canary import GOOD, Rig, ScriptedObserver

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _spread(centre: float, n: int = 12) -> list[float]:
    return [centre * (1 + 0.01 * ((i % 5) - 2)) for i in range(n)]


# The same service from a ninefold smaller KV budget: latencies, preemptions, errors and
# goodput equal; the smaller budget is simply fuller. Enough of it to show so: 600 requests
# without a failure or a preemption (half a point of errors needs about 550), over 30 s.
BASELINE = {
    "ttft_s": _spread(0.20),
    "inter_token_s": _spread(0.012),
    "e2e_s": _spread(1.5),
    "preemptions_per_s": Counts(0.0, 30.0),
    "preemptions_per_request": Counts(0.0, 600.0),
    "goodput_tokens_per_s": _spread(1030.0),
    "errors_ratio": [0.0] * 600,
    "kv_usage_ratio": _spread(0.08),
}
SMALLER_BUDGET = {**BASELINE, "kv_usage_ratio": _spread(0.72)}


@pytest.mark.parametrize("metrics", [DEFAULT_METRICS, LIVE_METRICS], ids=["replay", "live"])
def test_a_smaller_kv_budget_at_equal_service_passes(metrics: tuple) -> None:
    judgement = judge(SMALLER_BUDGET, BASELINE, JudgeConfig(metrics=metrics))
    assert judgement.classification is Classification.PASS, judgement.reason
    assert judgement.score_ratio == 1.0
    kv = next(m for m in judgement.metrics if m.name == "kv_usage_ratio")
    assert kv.verdict is Verdict.HIGH and not kv.counts_against  # shown, not counted
    assert kv.canary_median is not None and kv.canary_median > 0.7
    assert "shown, not counted: kv_usage_ratio high" in judgement.reason


def test_a_goodput_drop_still_counts_on_replay() -> None:
    slower = {**SMALLER_BUDGET, "goodput_tokens_per_s": _spread(600.0)}
    judgement = judge(slower, BASELINE, JudgeConfig(metrics=DEFAULT_METRICS))
    assert judgement.classification is not Classification.PASS
    assert "goodput_tokens_per_s low" in judgement.reason


def test_on_live_traffic_a_side_is_judged_at_the_rate_it_receives() -> None:
    # The splitter sets each side's generation rate: a lower one is shown, and what counts
    # is whether the side keeps up with what it gets (its latencies).
    fewer = {**SMALLER_BUDGET, "goodput_tokens_per_s": _spread(600.0)}
    judgement = judge(fewer, BASELINE, JudgeConfig(metrics=LIVE_METRICS))
    assert judgement.classification is Classification.PASS, judgement.reason
    assert "shown, not counted: goodput_tokens_per_s low" in judgement.reason
    slower = {**fewer, "ttft_s": [2 * t for t in BASELINE["ttft_s"]]}
    judgement = judge(slower, BASELINE, JudgeConfig(metrics=LIVE_METRICS))
    assert judgement.classification is not Classification.PASS
    assert "ttft_s high" in judgement.reason
    no_ttft = {k: v for k, v in fewer.items() if k != "ttft_s"}
    judgement = judge(no_ttft, BASELINE, JudgeConfig(metrics=LIVE_METRICS))
    assert judgement.classification is Classification.INCONCLUSIVE
    assert "no data on ttft_s" in judgement.reason


def test_both_metric_sets_judge_the_same_user_facing_latencies_and_errors() -> None:
    def names(metrics: Sequence) -> set[str]:
        return {m.name for m in metrics if m.counted} - {
            "preemptions_per_s",
            "preemptions_per_request",
        }

    latencies_and_errors = {"ttft_s", "inter_token_s", "e2e_s", "errors_ratio"}
    assert names(DEFAULT_METRICS) == latencies_and_errors | {"goodput_tokens_per_s"}
    assert names(LIVE_METRICS) == latencies_and_errors
    assert [m.name for m in DEFAULT_METRICS if not m.counted] == ["kv_usage_ratio"]
    assert [m.name for m in LIVE_METRICS if not m.counted] == [
        "goodput_tokens_per_s",
        "kv_usage_ratio",
    ]


class WarmingObserver(ScriptedObserver):
    async def warm(self, urls: Sequence[str]) -> Warmup:
        await super().warm(urls)
        return Warmup(requests=3)


async def test_the_rollout_keeps_the_baseline_and_the_warmup_in_the_trial() -> None:
    rig = Rig()
    rig.observer = WarmingObserver(rig.runtime)
    outcome = await rig.rollout().run(rig.trial(), GOOD, Strategy.PARALLEL)
    stored = rig.store.get("t1")
    assert stored is not None and stored.baseline is not None
    assert outcome.baseline is not None
    assert stored.baseline.goodput_tokens_per_s == outcome.baseline.goodput_tokens_per_s
    assert stored.warmup == Warmup(requests=3)
    assert trial_from_dict(json.loads(json.dumps(trial_to_dict(stored)))) == stored


def _trials():
    """An old trial (stored before the baseline was kept) and a new one, judged."""
    judgement = judge(SMALLER_BUDGET, BASELINE)
    old = new_trial("t1", "study", 1, {"max_num_seqs": 16}, 0.0)
    old = old.to(TrialState.RUNNING, at_wall_s=1.0).to(
        TrialState.COMPLETE,
        at_wall_s=2.0,
        result=TrialResult(TrialOutcome.FEASIBLE, 990.123456, 64 * 2**20, None),
        judgement=judgement,
    )
    new = new_trial("t2", "study", 2, {"max_num_seqs": 28}, 3.0)
    new = new.to(TrialState.RUNNING, at_wall_s=4.0).to(
        TrialState.COMPLETE,
        at_wall_s=5.0,
        result=TrialResult(TrialOutcome.FEASIBLE, 1034.4662847904285, 7_130_317, None),
        judgement=judgement,
        baseline=TrialResult(TrialOutcome.FEASIBLE, 1029.871234, 64 * 2**20, None),
        warmup=Warmup(requests=2),
    )
    old_dict = trial_to_dict(old)
    assert "baseline" not in old_dict and "warmup" not in old_dict  # as rows stored before
    return [trial_from_dict(old_dict), new]


def _table_text(verbose: bool) -> str:
    console = Console(record=True, width=240)
    console.print(trials_table(_trials(), verbose=verbose))
    return console.export_text()


def _row(text: str, number: int) -> str:
    return next(line for line in text.splitlines() if re.match(rf"\s*{number}\s+\w", line))


def _note(text: str, number: int) -> str:
    return next(line for line in text.splitlines() if line.startswith(f"{number}: "))


def test_the_trials_table_shows_the_baseline_beside_each_candidate_rounded() -> None:
    text = _table_text(verbose=False)
    row = _row(text, 2)
    assert re.search(r"1034\s.*6\.8 MiB\s.*1030\s.*64\.0 MiB", row), row
    old = _row(text, 1)
    assert "990 " in old and old.count("unknown") == 2  # baseline goodput and memory
    assert "1034.4" not in text and "1029.8" not in text


def test_the_verbose_table_shows_the_warmup_and_kv_usage_as_information() -> None:
    text = _table_text(verbose=True)
    note = _note(text, 2)
    assert "2 requests each" in note and "8% -> 72%" in note
    assert _note(text, 1).count("unknown") == 1  # the warm-up
    assert _row(text, 1).count("unknown") == 2  # baseline goodput and memory


def test_the_report_shows_the_baseline_and_the_warmup() -> None:
    page = render_report(_trials())
    assert "<td>1034</td><td>6.8 MiB</td><td>1030</td><td>64.0 MiB</td>" in page
    assert "<td>990</td><td>64.0 MiB</td><td>unknown</td><td>unknown</td>" in page
    assert "baseline 1030 tok/s, 64.0 MiB; warm-up 2 requests each" in page
    assert "KV usage is shown, never counted" in page
    assert "1034.46" not in page


def test_old_rows_in_the_state_database_read_as_unknown(tmp_path) -> None:
    db = Database.open(tmp_path)
    try:
        store = SqliteTrialStore(db)
        old, new = _trials()
        store.add(old)
        store.add(new)
        got = {t.trial_id: t for t in store.trials()}
        assert got["t1"].baseline is None and got["t1"].warmup is None
        assert got["t2"] == new
    finally:
        db.close()


def _summary(trials, baseline: TrialResult | None) -> SessionSummary:
    from kvpilot.tuner.rollout.canary import Phase, RolloutOutcome, RolloutRecord

    record = RolloutRecord("t2", Strategy.PARALLEL, Phase.ROLLED_BACK, (), (), 5.0)
    outcomes = tuple(RolloutOutcome(t, record, baseline) for t in trials)
    return SessionSummary(outcomes, 0, "3 trials run", 1034.4662847904285)


def test_the_summary_line_is_rounded_and_names_the_baseline() -> None:
    trials = _trials()
    line = summary_line(_summary(trials, trials[1].baseline))
    assert line == (
        "3 trials run; best goodput 1034 tok/s (trial 2: 1034 tok/s, 6.8 MiB);"
        " baseline 1030 tok/s, 64.0 MiB"
    )


def test_the_summary_line_names_the_last_promoted_trial_when_it_is_not_the_best() -> None:
    from kvpilot.tuner.rollout.canary import Phase, RolloutOutcome, RolloutRecord

    old, best = _trials()
    promoted = RolloutRecord("t1", Strategy.PARALLEL, Phase.PROMOTED, (), (), 5.0)
    passed = RolloutRecord("t2", Strategy.PARALLEL, Phase.PROMOTED, (), (), 6.0)
    # Trial 1 promoted last (say, a later run's order): the stable runs its flags.
    outcomes = (RolloutOutcome(best, passed, None), RolloutOutcome(old, promoted, None))
    line = summary_line(SessionSummary(outcomes, 0, "2 trials run", 1034.0))
    assert line.endswith("; the stable runs trial 1's flags (last promoted)"), line
    same = SessionSummary(outcomes[::-1], 0, "2 trials run", 1034.0)
    assert "last promoted" not in summary_line(same)


def test_the_summary_line_without_a_baseline_says_unknown() -> None:
    old = _trials()[0]
    line = summary_line(_summary([old], None))
    assert line.endswith("(trial 1: 990 tok/s, 64.0 MiB); baseline unknown")
    empty = dataclasses.replace(_summary([], None), best_goodput_tokens_per_s=None)
    assert summary_line(empty) == "3 trials run; best goodput unknown"


def test_replay_samples_carry_goodput_and_kv_usage_from_the_scrapes() -> None:
    from kvpilot.agent.tuning.observer import samples
    from kvpilot.collectors.vllm_parse import EngineSample, VllmScrape
    from kvpilot.tuner.load.generator import LoadReport

    def scrape(at: float, tokens: float, usage: float) -> VllmScrape:
        engine = EngineSample(
            "m",
            "0",
            at,
            at,
            kv_usage_ratio=usage,
            preemptions_total=0.0,
            generation_tokens_total=tokens,
        )
        return VllmScrape(at, at, (engine,), None)

    got = samples(LoadReport(0.0, 1.0, ()), [scrape(0.0, 0, 0.1), scrape(0.5, 500, 0.7)])
    assert got["goodput_tokens_per_s"] == (1000.0,)
    assert got["kv_usage_ratio"] == (0.1, 0.7)


def test_kvpilot_trials_verbose_shows_the_baseline_and_the_warmup(tmp_path) -> None:
    from typer.testing import CliRunner

    from kvpilot.agent.cli.main import app
    from kvpilot.agent.config import load_config
    from tests.agent.cli.test_tune_cli import _config

    path = _config(tmp_path)
    db = Database.open(load_config(path).state_dir)
    try:
        for trial in _trials():
            SqliteTrialStore(db).add(trial)
    finally:
        db.close()
    args = ["trials", "--config", str(path), "--verbose"]
    got = CliRunner().invoke(app, args, env={"COLUMNS": "80"})  # piped: 80 columns
    assert got.exit_code == 0, got.output
    row = _row(got.output, 2)
    assert re.search(r"1034\s.*6\.8 MiB\s.*1030\s.*64\.0 MiB\s+pass", row), row
    assert "2 requests each" in _note(got.output, 2)
    assert _row(got.output, 1).count("unknown") == 2
    assert _note(got.output, 1).count("unknown") == 1
