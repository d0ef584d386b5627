"""The report names the memory-priced choice and, per metric, the evidence the judge used."""

from __future__ import annotations

import dataclasses

from kvpilot.tuner.judge.evidence import Counts
from kvpilot.tuner.judge.judgement import judge
from kvpilot.tuner.problem.objective import TrialOutcome, TrialResult
from kvpilot.tuner.report.html import render_report
from kvpilot.tuner.trials import TrialState, new_trial

MIB = 1 << 20


def trial(number: int, goodput: float, memory: int):
    made = new_trial(f"t{number}", "study", number, {"kv_cache_memory_bytes": memory}, 0.0)
    result = TrialResult(TrialOutcome.FEASIBLE, goodput, memory, None)
    running = made.to(TrialState.RUNNING, at_wall_s=0.5)
    return running.to(TrialState.COMPLETE, at_wall_s=1.0, result=result)


def test_the_report_names_the_least_memory_within_five_percent_of_the_best() -> None:
    page = render_report([trial(1, 1000.0, 64 * MIB), trial(2, 970.0, 8 * MIB)])
    assert (
        "The memory-priced choice is trial 2: 970 tok/s with 8.0 MiB, the least memory "
        "within 5% of the best goodput (trial 1: 1000 tok/s with 64.0 MiB)."
    ) in page
    alone = render_report([trial(1, 1000.0, 64 * MIB), trial(2, 900.0, 8 * MIB)])
    assert "The memory-priced choice is trial 1: 1000 tok/s with 64.0 MiB; no trial" in alone


def test_each_judged_trial_shows_the_evidence_per_metric() -> None:
    same = [0.2 + 0.001 * i for i in range(40)]
    samples = {"ttft_s": same, "errors_ratio": Counts(0, 80), "preemptions_per_s": Counts(0, 30)}
    judged = dataclasses.replace(trial(1, 1000.0, 8 * MIB), judgement=judge(samples, samples))
    page = render_report([judged])
    assert "<th>margin</th><th class='l'>evidence</th>" in page
    errors = page[page.index("<td class='l'>errors_ratio</td>") :].split("</tr>")[0]
    assert "<td>80</td><td>80</td><td>0.005</td>" in errors and "upper bound +0.0327" in errors
    goodput = page[page.index("<td class='l'>goodput_tokens_per_s</td>") :].split("</tr>")[0]
    assert "nodata" in goodput and "too few samples" in goodput
