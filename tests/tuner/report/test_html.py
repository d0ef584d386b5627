"""The HTML report is one self-contained page; the trials table renders every trial."""

from __future__ import annotations

import dataclasses
import re
import xml.etree.ElementTree as ET
from pathlib import Path

from rich.console import Console

from kvpilot.tuner.judge.judgement import judge
from kvpilot.tuner.problem.objective import TrialOutcome, TrialResult
from kvpilot.tuner.problem.space import Knob, KnobKind, SearchSpace
from kvpilot.tuner.report.html import render_report, write_report
from kvpilot.tuner.report.table import format_bytes, trials_table
from kvpilot.tuner.trials import Trial, TrialState, new_trial

SPACE = SearchSpace(
    (
        Knob("kv_cache_memory_bytes", KnobKind.INTEGER, 1 << 20, 1 << 26, log_scale=True),
        Knob("max_num_seqs", KnobKind.INTEGER, 1, 256, log_scale=True),
    )
)


def history() -> list[Trial]:
    trials = []
    cases = [
        (1 << 21, 8, TrialResult(TrialOutcome.FEASIBLE, 120.0, 1 << 21, None)),
        (
            1 << 20,
            64,
            TrialResult(TrialOutcome.PREEMPTED, 90.0, 1 << 20, "0.9 preemptions <per> request"),
        ),
        (1 << 24, 32, TrialResult(TrialOutcome.FEASIBLE, 310.0, 1 << 24, None)),
        (1 << 25, 16, TrialResult(TrialOutcome.FEASIBLE, 250.0, 1 << 25, None)),
    ]
    for i, (kv, seqs, result) in enumerate(cases, 1):
        trial = new_trial(f"t{i}", "s", i, {"kv_cache_memory_bytes": kv, "max_num_seqs": seqs}, i)
        trial = trial.to(TrialState.RUNNING, at_wall_s=i + 0.1).finish(result, at_wall_s=i + 0.5)
        trials.append(trial)
    canary = {"ttft_s": [1.5 + 0.01 * i for i in range(20)], "e2e_s": [2.0] * 20}
    baseline = {"ttft_s": [1.0 + 0.01 * i for i in range(20)], "e2e_s": [2.0] * 20}
    trials[2] = dataclasses.replace(trials[2], judgement=judge(canary, baseline))
    aborted = new_trial("t5", "s", 5, {"kv_cache_memory_bytes": 1 << 22, "max_num_seqs": 4}, 5)
    trials.append(aborted.to(TrialState.ABORTED, at_wall_s=6, reason="kvpilot restarted"))
    return trials


def test_page_is_self_contained_with_well_formed_svg_plots(tmp_path: Path) -> None:
    page = render_report(history(), space=SPACE)
    assert "<script" not in page and "<link" not in page and "@font-face" not in page
    urls = set(re.findall(r"https?://[^\s'\"]+", page))
    assert urls == {"http://www.w3.org/2000/svg"}  # the SVG namespace, never fetched
    svgs = re.findall(r"<svg.*?</svg>", page, flags=re.S)
    assert len(svgs) == 3  # best-so-far, the knob scatter, one canary
    for svg in svgs:
        ET.fromstring(svg)  # noqa: S314 (our own markup) raises if malformed
    path = write_report(tmp_path / "report.html", history(), space=SPACE)
    assert path.read_text(encoding="utf-8") == page


def test_plots_carry_the_trials() -> None:
    page = render_report(history(), space=SPACE)
    best = re.search(r"<svg[^>]*aria-label='best goodput so far'.*?</svg>", page, flags=re.S)
    assert best is not None
    # Three feasible points, one cross, and a step line that ends at the best (310).
    assert best.group(0).count("<circle") == 3 and best.group(0).count("<g stroke") == 1
    scatter = re.search(r"<svg[^>]*aria-label='trials over .*?</svg>", page, flags=re.S)
    assert scatter is not None
    assert scatter.group(0).count("<circle") == 3
    assert scatter.group(0).count("<g stroke") == 2  # the preempted and the aborted trial
    assert "0.9 preemptions &lt;per&gt; request" in page  # escaped, never raw markup
    assert "Trial 3: fail" in page  # TTFT against, e2e not: 50 %
    assert ">high ✗<" in page  # the canary's TTFT is clearly higher


def test_an_empty_history_still_renders() -> None:
    page = render_report([])
    assert "No measured trials yet" in page


def test_trials_table_shows_every_trial_and_marks_the_best() -> None:
    console = Console(record=True, width=200)
    console.print(trials_table(history(), best_trial_id="t3"))
    text = console.export_text()
    for needle in (
        "3 *",
        "310",
        "infeasible",
        "aborted",
        "kvpilot restarted",
        "16.0 MiB",
        "best feasible trial",
    ):
        assert needle in text
    assert format_bytes(1536) == "1.5 KiB" and format_bytes(12) == "12 B"


def test_trials_table_reads_at_80_columns() -> None:
    # Piped or logged, rich renders at 80 columns: no cell cut to "comp…", no reason folded
    # one word a line; the reasons follow the table as prose.
    trials = history()
    long = "judged inconclusive: insufficient evidence: not shown within the margin: ttft_s"
    trials[0] = dataclasses.replace(trials[0], reason=long)
    console = Console(record=True, width=80, force_terminal=False)
    console.print(trials_table(trials, best_trial_id="t3", verbose=True))
    text = console.export_text()
    lines = text.splitlines()
    assert max(len(line.rstrip()) for line in lines) <= 80
    assert "…" not in text
    for state in {t.state.value for t in trials}:
        assert re.search(rf"\s{state}\s", text), state
    assert "1: judged inconclusive: insufficient evidence: not shown within the margin" in text
    header = next(line for line in lines if "state" in line)
    assert "KV cache" in header and "seqs" in header and "canary" in header
