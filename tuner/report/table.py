"""The trial history as a rich table, for `kvpilot trials`."""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from kvpilot.collectors.secrets import mask_text
from kvpilot.tuner.session import SessionSummary
from kvpilot.tuner.trials import Trial, TrialState

_STATE_STYLE = {
    TrialState.PLANNED: "dim",
    TrialState.RUNNING: "cyan",
    TrialState.COMPLETE: "green",
    TrialState.INFEASIBLE: "yellow",
    TrialState.FAILED: "red",
    TrialState.ABORTED: "magenta",
}


# Short headers for the knobs, so that the table reads at 80 columns.
_KNOB_LABEL = {
    "kv_cache_memory_bytes": "KV cache",
    "gpu_memory_utilization": "GPU util",
    "max_num_seqs": "seqs",
    "max_num_batched_tokens": "batch tok",
    "block_size": "block",
    "kv_cache_dtype": "KV dtype",
    "enable_prefix_caching": "prefix",
}


def trials_table(
    trials: Sequence[Trial], *, best_trial_id: str | None = None, verbose: bool = False
) -> RenderableType:
    """One row per trial: number, state, knob values, goodput and memory beside the stable
    instance's (the baseline) from the same window, and the canary's verdict; each trial's
    reason follows the table as a line of its own, so that the table reads at 80 columns
    (piped, logged) and a long reason wraps as prose. `verbose` adds the warm-up and the KV
    usage medians (shown, never counted by the judge) to those lines."""
    knobs = list(dict.fromkeys(name for t in trials for name, _ in t.values))
    table = Table(
        title="Tuning trials",
        header_style="bold",
        box=None,  # no rules: at 80 columns every column is worth its text
        pad_edge=False,
        padding=(0, 1),
    )
    table.add_column("#", justify="right", no_wrap=True)
    table.add_column("state", no_wrap=True, min_width=len("infeasible"))
    for name in knobs:
        table.add_column(_KNOB_LABEL.get(name, name), justify="right", no_wrap=True)
    for column in ("tok/s", "memory", "stable\ntok/s", "stable\nmemory"):
        table.add_column(column, justify="right", no_wrap=True)
    table.add_column("canary", no_wrap=True, min_width=len("inconclusive"))
    notes: list[Text] = []
    for trial in trials:
        values = dict(trial.values)
        number = f"{trial.number}" + (" *" if trial.trial_id == best_trial_id else "")
        table.add_row(
            number,
            Text(trial.state.value, style=_STATE_STYLE[trial.state]),
            *(_value(values.get(name)) for name in knobs),
            *result_cells(trial),
            "-" if trial.judgement is None else trial.judgement.classification.value,
        )
        said = [mask_text(trial.reason)] if trial.reason else []
        if verbose:
            said += [f"warm-up {warmup_text(trial)}", f"KV usage (info) {kv_usage_text(trial)}"]
        if said:
            notes.append(Text(f"{number.rstrip(' *')}: " + "; ".join(said)))
    if best_trial_id is not None:
        table.caption = "* best feasible trial"
    return Group(table, *notes)


def result_cells(trial: Trial) -> tuple[str, str, str, str]:
    """Goodput and memory of the candidate, then of the baseline ("unknown" where a trial
    stored before the baseline was kept has none, "-" where nothing was measured)."""
    result, base = trial.result, trial.baseline
    measured = trial.judgement is not None
    missing = "unknown" if measured else "-"
    return (
        format_rate(result.goodput_tokens_per_s if result else None),
        format_bytes_or(result.memory_bytes if result else None),
        format_rate(base.goodput_tokens_per_s, missing) if base else missing,
        format_bytes_or(base.memory_bytes, missing) if base else missing,
    )


def warmup_text(trial: Trial) -> str:
    return "unknown" if trial.warmup is None else trial.warmup.describe()


def kv_usage_text(trial: Trial) -> str:
    """Baseline -> canary median KV usage, from the judgement (information only)."""
    judgement = trial.judgement
    found = [m for m in judgement.metrics if m.name == "kv_usage_ratio"] if judgement else []
    if not found or found[0].baseline_median is None or found[0].canary_median is None:
        return "-"
    return f"{found[0].baseline_median:.0%} -> {found[0].canary_median:.0%}"


def summary_line(summary: SessionSummary) -> str:
    """The end of `kvpilot tune`, rounded for people: the best goodput, and the best trial's
    goodput and memory of this run beside the baseline's from the same window."""
    text = f"{summary.stopped_reason}; best goodput {_tok_s(summary.best_goodput_tokens_per_s)}"
    ranked = [
        (o.trial.result.feasible, o.trial.result.goodput_tokens_per_s or 0.0, i)
        for i, o in enumerate(summary.outcomes)
        if o.trial.result is not None
    ]
    if not ranked:
        return text
    top = summary.outcomes[max(ranked)[2]]
    cand, base = top.trial.result, top.baseline or top.trial.baseline
    assert cand is not None
    text += (
        f" (trial {top.trial.number}: {_tok_s(cand.goodput_tokens_per_s)},"
        f" {format_bytes_or(cand.memory_bytes, 'memory unknown')})"
    )
    if base is None:
        text += "; baseline unknown"
    else:
        text += (
            f"; baseline {_tok_s(base.goodput_tokens_per_s)},"
            f" {format_bytes_or(base.memory_bytes, 'memory unknown')}"
        )
    # Each promotion passed against the stable of its time, so the stable ends on the last
    # one, which need not be the trial with the highest goodput: say which it is.
    promoted = summary.promoted
    if promoted and promoted[-1] is not top:
        text += f"; the stable runs trial {promoted[-1].trial.number}'s flags (last promoted)"
    return text


def _tok_s(value: float | None) -> str:
    return "unknown" if value is None else f"{format_rate(value)} tok/s"


def format_rate(value: float | None, missing: str = "-") -> str:
    """Tokens per second for people: whole numbers, three significant figures below 100."""
    if value is None:
        return missing
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}"


def format_bytes_or(value: float | None, missing: str = "-") -> str:
    return missing if value is None else format_bytes(value)


def format_bytes(n: float) -> str:
    """Bytes in binary units, e.g. 1.5 GiB."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


def _value(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1024**2:
        return format_bytes(value)
    return str(value)
