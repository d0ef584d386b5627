"""The trial history as a rich table, for `kvpilot trials`."""

from __future__ import annotations

from collections.abc import Sequence

from rich.table import Table
from rich.text import Text

from kvpilot.collectors.secrets import mask_text
from kvpilot.tuner.trials import Trial, TrialState

_STATE_STYLE = {
    TrialState.PLANNED: "dim",
    TrialState.RUNNING: "cyan",
    TrialState.COMPLETE: "green",
    TrialState.INFEASIBLE: "yellow",
    TrialState.FAILED: "red",
    TrialState.ABORTED: "magenta",
}


def trials_table(trials: Sequence[Trial], *, best_trial_id: str | None = None) -> Table:
    """One row per trial: number, state, knob values, goodput, memory, verdict, reason."""
    knobs = list(dict.fromkeys(name for t in trials for name, _ in t.values))
    table = Table(title="Tuning trials", header_style="bold")
    table.add_column("#", justify="right")
    table.add_column("state")
    for name in knobs:
        table.add_column(name, justify="right")
    table.add_column("goodput tok/s", justify="right")
    table.add_column("memory", justify="right")
    table.add_column("canary")
    table.add_column("reason", overflow="fold")
    for trial in trials:
        values = dict(trial.values)
        result = trial.result
        goodput = result.goodput_tokens_per_s if result is not None else None
        memory = result.memory_bytes if result is not None else None
        number = f"{trial.number}" + (" *" if trial.trial_id == best_trial_id else "")
        table.add_row(
            number,
            Text(trial.state.value, style=_STATE_STYLE[trial.state]),
            *(_value(values.get(name)) for name in knobs),
            "-" if goodput is None else f"{goodput:.1f}",
            "-" if memory is None else format_bytes(memory),
            "-" if trial.judgement is None else trial.judgement.classification.value,
            mask_text(trial.reason or ""),
        )
    if best_trial_id is not None:
        table.caption = "* best feasible trial"
    return table


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
