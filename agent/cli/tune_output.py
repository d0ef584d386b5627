"""What `kvpilot tune` prints: how each trial is judged, the live progress line, the
trials' outcomes with the closing summary, and what became of the stable server."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live

from kvpilot.agent.config.tuning import TuningConfig
from kvpilot.agent.tuning.local.adapter import StableEnd
from kvpilot.collectors.secrets import mask_argv, mask_text
from kvpilot.tuner.report.table import format_rate, summary_line
from kvpilot.tuner.session import Progress, SessionSummary, TuningSession

MakeSession = Callable[[Callable[[Progress], None]], TuningSession]


def judging_line(tuning: TuningConfig, windows_flag: bool) -> str:
    """How much evidence the judge gets per trial, and which setting says so."""
    if tuning.canary.traffic != "replay":  # live traffic is one analysis of many intervals
        return (
            f"each trial: judged over {tuning.canary.analysis_s:g} s of live traffic "
            f"(canary.analysis_s; windows apply to replayed traffic only)"
        )
    source = "--windows" if windows_flag else "tuning.windows"
    plural = "window" if tuning.windows == 1 else "windows"
    return f"each trial: {tuning.windows} replayed {plural} a side, judged together ({source})"


async def run_with_progress(console: Console, make: MakeSession, trials: int) -> SessionSummary:
    """The session `make` builds (given its progress callback), run under a live line."""
    with Live(console=console, refresh_per_second=4) as live:

        def show(p: Progress) -> None:
            shown = format_rate(p.best_goodput_tokens_per_s)
            flags = " ".join(f"{k}={v}" for k, v in p.values)
            live.update(
                f"trial {p.trial_number}  {flags}  phase {p.phase.value}  best {shown} tok/s"
            )

        summary = await make(show).run(trials)
    if not console.is_terminal:
        console.line()  # Live leaves its last line open where output is not a terminal
    return summary


def print_summary(
    console: Console, summary: SessionSummary, stable_argv: Sequence[str], secrets: Any
) -> None:
    """Each trial's outcome with its reason (secrets masked), the summary, the stable flags."""
    for outcome in summary.outcomes:
        t = outcome.trial
        reason = mask_text(str(outcome.record.reason), secrets)
        console.print(f"trial {t.number}: {outcome.record.phase.value}: {reason}")
    console.print(summary_line(summary))
    console.print(f"stable flags now: {' '.join(mask_argv(stable_argv, secrets))}")


def print_end(console: Console, end: StableEnd, config_path: Path) -> None:
    """What the run did with the stable server at its end."""
    where = f"PID {end.pid}, port {end.port}"
    lines = {
        "stopped": f"stopped the stable server {end.name!r} this run started ({where})",
        "kept": f"kept the stable server {end.name!r} running ({where}): "
        f"`kvpilot run --config {config_path}` adopts it",
        "left": f"the stable server {end.name!r} ran before this run and still runs ({where})",
    }
    if end.action in lines:
        console.print(lines[end.action], highlight=False, markup=False, soft_wrap=True)
