"""`kvpilot state check` and `kvpilot state repair`: the state database, checked and recovered.

`check` reads only (it may run beside the agent). `repair` takes the state directory's lock,
so it never runs under a live agent, and moves a damaged database aside with a timestamp:
nothing is deleted; the next start of the agent creates a fresh database.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, NoReturn

import typer

from kvpilot.agent.cli.config_load import load_or_exit
from kvpilot.agent.state import (
    DB_FILENAME,
    DatabaseCheck,
    StateError,
    StateLock,
    check_database,
    move_aside,
)

PROBLEM_EXIT = 1

ConfigFile = Annotated[
    Path,
    typer.Option("--config", envvar="KVPILOT_CONFIG", help="The agent's YAML configuration."),
]
Full = Annotated[
    bool,
    typer.Option("--full", help="SQLite's integrity_check (slower) instead of quick_check."),
]


def register(app: typer.Typer) -> None:
    state_app = typer.Typer(
        help="Check the state database; move a damaged one aside.", no_args_is_help=True
    )
    app.add_typer(state_app, name="state")

    @state_app.command("check")
    def check(config: ConfigFile, full: Full = False) -> None:
        """Is the state database sound, and does an agent hold it? Exit 1 when damaged."""
        state_dir = _state_dir(config)
        holder = StateLock.holder(state_dir) if state_dir.is_dir() else None
        print(f"agent: PID {holder} holds {state_dir}" if holder else "agent: none running")
        verdict = check_database(state_dir / DB_FILENAME, full=full)
        _show(verdict, full=full)
        if verdict.damaged:
            print(
                f"to recover: `kvpilot state repair --config {config}` moves it aside (kept) "
                "and the next start creates a fresh database",
                file=sys.stderr,
            )
        if not verdict.sound and verdict.exists:
            raise typer.Exit(PROBLEM_EXIT)

    @state_app.command("repair")
    def repair(config: ConfigFile, full: Full = False) -> None:
        """Move a damaged state database aside (renamed, never deleted); not while it runs."""
        state_dir = _state_dir(config)
        if not state_dir.is_dir():
            print(f"{state_dir}: no state directory yet: nothing to repair")
            return
        try:
            lock = StateLock.acquire(state_dir)
        except StateError as exc:
            _fail(f"{exc}")
        with lock:
            verdict = check_database(state_dir / DB_FILENAME, full=full)
            _show(verdict, full=full)
            if verdict.unreadable is not None:
                raise typer.Exit(PROBLEM_EXIT)
            if not verdict.damaged:
                print("nothing to repair")
                return
            try:
                moved = move_aside(verdict.path)
            except OSError as exc:
                _fail(f"cannot move {verdict.path} aside: {exc.strerror or exc}")
        for source, target in moved:
            print(f"moved {source} to {target.name} (kept: delete it when no longer needed)")
        print(
            "the agent's next start creates a fresh database: alert states, the outbox and "
            "the history start empty"
        )


def _state_dir(config: Path) -> Path:
    loaded, _ = load_or_exit(config, warn=False)
    state_dir = loaded.state_dir
    if state_dir.exists() and not state_dir.is_dir():
        _fail(f"state_dir {state_dir}: is a file, not a directory")
    return state_dir


def _show(verdict: DatabaseCheck, *, full: bool) -> None:
    check = "integrity_check" if full else "quick_check"
    if not verdict.exists:
        print(f"database: {verdict.path}: none yet (the agent creates it on its first start)")
    elif verdict.unreadable is not None:
        print(f"database: {verdict.path}: cannot be read: {verdict.unreadable}", file=sys.stderr)
    elif verdict.damaged:
        print(f"database: {verdict.path}: DAMAGED ({check}):", file=sys.stderr)
        for problem in verdict.problems:
            print(f"  {problem}", file=sys.stderr)
    else:
        print(f"database: {verdict.path}: sound ({check})")


def _fail(message: str) -> NoReturn:
    print(f"kvpilot: {message}", file=sys.stderr)
    raise typer.Exit(PROBLEM_EXIT)
