"""`kvpilot tune report`, and what it draws besides the trials: the study's search space with its
constraints (the planner's bounds among them) and the stable configuration's knob values
(the promoted flags when they stand, else the configured ones)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from kvpilot.agent.app.parts import tuned_server
from kvpilot.agent.cli.config_load import load_or_exit, open_state_or_exit
from kvpilot.agent.config.tuning import TuningConfig
from kvpilot.agent.state.db import Database
from kvpilot.agent.state.store import StateStore
from kvpilot.agent.state.trials import SqliteTrialStore
from kvpilot.agent.tuning.promoted import PROMOTED_FACT, live_argv
from kvpilot.agent.tuning.server import TunedServer
from kvpilot.agent.tuning.study import StudyError, build_study, read_gpu, require_server
from kvpilot.agent.tuning.workload.record import ReplayedWorkload, last_workload
from kvpilot.collectors.vllm_argv import flag_value, parse_human_int
from kvpilot.tuner.problem.constraints import Value
from kvpilot.tuner.problem.space import KnobKind, SearchSpace
from kvpilot.tuner.report.html import ReportContext, write_report


def report_context(
    tuning: TuningConfig, server: TunedServer | None, db: Database, config_sha256: str | None
) -> ReportContext:
    """The space under `tuning` and the stable `server`'s values; where the study cannot be
    built, a note saying why (the page then draws no infeasible region and no stable mark on
    the knob map)."""
    try:
        study = build_study(require_server(server), tuning, read_gpu())
    except (StudyError, ValueError, OSError) as exc:
        note = f"No planner region or stable mark on the knob map: {exc}"
        return ReportContext(notes=(note,))
    store = StateStore(db)
    live = live_argv(study.stable.argv, store.get_fact(PROMOTED_FACT), config_sha256)
    replayed = last_workload(store)
    w = tuning.workload
    return ReportContext(
        study.space,
        stable_values(study.space, live.argv),
        workload=replayed.shape if replayed else None,
        workload_note=_replayed_note(replayed),
        configured_lengths=(w.prompt_len, w.output_len),
    )


def _replayed_note(replayed: ReplayedWorkload | None) -> str | None:
    if replayed is None:
        return None
    return f"The last run replayed the {replayed.source} workload: {replayed.reason}."


def stable_values(space: SearchSpace, argv: Sequence[str]) -> dict[str, Value]:
    """The numeric knob values the stable argv sets; a knob it leaves to vLLM's default is
    absent (the chart then marks no point)."""
    values: dict[str, Value] = {}
    for knob in space.knobs:
        text = flag_value(argv, knob.flag) if knob.kind is not KnobKind.FLAG else None
        if text is None:
            continue
        if knob.kind is KnobKind.INTEGER:
            number = parse_human_int(text)
            if number is not None:
                values[knob.name] = number
        elif knob.kind is KnobKind.REAL:
            try:
                values[knob.name] = float(text)
            except ValueError:
                continue
    return values


def report(
    config: Annotated[Path, typer.Option("--config", "-c", help="The agent's YAML file.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="The HTML file.")] = Path(
        "report.html"
    ),
) -> None:
    """Write the tuning history as one self-contained HTML page: convergence, the knob map
    with the planner's infeasible region, the workload replayed, the stable beside each canary."""
    cfg, config_sha256 = load_or_exit(config)
    db = open_state_or_exit(cfg.state_dir)
    try:
        context = report_context(cfg.tuning, tuned_server(cfg), db, config_sha256)
        path = write_report(output, SqliteTrialStore(db).trials(), context=context)
    finally:
        db.close()
    Console().print(f"wrote {path}")
