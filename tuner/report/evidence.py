"""The report's words on decisions: the memory-priced choice among the trials, and per metric
the evidence the judge used (the test, its samples or counts, the margin and the result)."""

from __future__ import annotations

from collections.abc import Sequence

from kvpilot.tuner.judge.judgement import MetricVerdict
from kvpilot.tuner.problem.objective import Slo, best_index
from kvpilot.tuner.report.svg import esc
from kvpilot.tuner.report.table import format_bytes_or, format_rate
from kvpilot.tuner.trials import Trial


def memory_priced_choice(trials: Sequence[Trial], slo: Slo) -> str:
    """One paragraph: which trial the objective chooses, and why (memory priced)."""
    measured = [(t, t.result) for t in trials if t.result is not None]
    index = best_index([r for _, r in measured], slo)
    if index is None:
        return "<p class='muted'>No feasible trial yet: nothing to choose.</p>"
    chosen, result = measured[index]
    top, best = max(
        ((t, r) for t, r in measured if r.feasible),
        key=lambda pair: pair[1].goodput_tokens_per_s or 0.0,
    )
    text = (
        f"The memory-priced choice is trial {chosen.number}: "
        f"{format_rate(result.goodput_tokens_per_s)} tok/s with "
        f"{format_bytes_or(result.memory_bytes, 'memory unknown')}"
    )
    if top is not chosen:
        text += (
            f", the least memory within {slo.memory_tie_ratio:.0%} of the best goodput "
            f"(trial {top.number}: {format_rate(best.goodput_tokens_per_s)} tok/s with "
            f"{format_bytes_or(best.memory_bytes, 'memory unknown')})"
        )
    else:
        text += f"; no trial within {slo.memory_tie_ratio:.0%} of its goodput holds less memory"
    return f"<p>{esc(text)}.</p>"


def evidence_table(metrics: Sequence[MetricVerdict]) -> str:
    """Per metric: verdict, the sides' sizes, the margin, and the tests' figures in words."""
    if not metrics:
        return ""
    rows = "".join(
        "<tr>"
        f"<td class='l'>{esc(m.name)}</td><td class='l'>{esc(m.verdict.value)}"
        f"{' (against)' if m.counts_against else ''}</td>"
        f"<td>{m.canary_count}</td><td>{m.baseline_count}</td>"
        f"<td>{'-' if m.margin is None else f'{m.margin:.3g}'}</td>"
        f"<td class='l'>{esc(m.reason)}</td>"
        "</tr>"
        for m in metrics
    )
    head = (
        "<tr><th class='l'>metric</th><th class='l'>verdict</th><th>canary n</th>"
        "<th>baseline n</th><th>margin</th><th class='l'>evidence</th></tr>"
    )
    return f"<table>{head}{rows}</table>"
