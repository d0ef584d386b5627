"""How every command that takes `--config` reads it.

The YAML, then the `KVPILOT_*` environment overrides (so `KVPILOT_STATE_DIR` moves `tune`'s
database exactly as it moves `run`'s), validated. An invalid configuration is one message,
a line per field naming the problem, and exit code 2: never a traceback.
"""

from __future__ import annotations

import os
import sqlite3
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NoReturn

import typer

from kvpilot.agent.config import AgentConfig, ApiConfig, ConfigError, load_config, validate_config
from kvpilot.agent.config.extras import missing_extras
from kvpilot.agent.state.db import Database
from kvpilot.agent.state.migrations import SchemaTooNewError
from kvpilot.agent.tuning.promoted import configured_hash

INVALID_CONFIG_EXIT = 2


def exit_invalid(path: Path | str, problems: Iterable[str]) -> NoReturn:
    """Print the problems of the configuration at `path` and exit with code 2."""
    print(f"kvpilot: {path}: invalid configuration", file=sys.stderr)
    for problem in problems:
        print(f"  {problem}", file=sys.stderr)
    raise typer.Exit(INVALID_CONFIG_EXIT)


def exit_missing_extras(needed: dict[str, str]) -> None:
    """Exit 2 with the pip command when an extra the configuration needs (`needed_extras`)
    is not installed."""
    missing = missing_extras(needed)
    if missing is not None:
        print(f"kvpilot: {missing}", file=sys.stderr)
        raise typer.Exit(INVALID_CONFIG_EXIT)


def _read_token(api: ApiConfig) -> None:
    """Reads `api.token_file` now, so that a bad one is a configuration error at start-up."""
    try:
        api.control_token()
    except UnicodeDecodeError as exc:  # the file is input too: no traceback for its bytes
        where = f"api.token_file: {api.token_file}"
        raise ConfigError([f"{where}: not UTF-8 text at byte offset {exc.start}"]) from None


def load_or_exit(
    path: Path, *, use_env: bool = True, warn: bool = True, read_token: bool = False
) -> tuple[AgentConfig, str]:
    """The validated configuration and its hash for promotions (`configured_hash`), or exit 2.

    `read_token` also reads `api.token_file`: for the commands that serve the control API.
    """
    try:
        config = load_config(path, os.environ if use_env else None, warn=warn)
        if read_token:
            _read_token(config.api)
        return config, configured_hash(config.runtime)
    except ConfigError as exc:
        exit_invalid(path, exc.problems)
    except OSError as exc:  # the file went away between reading and hashing
        exit_invalid(path, [f"cannot read: {exc.strerror or exc}"])


def validate_or_exit(data: dict[str, Any]) -> AgentConfig:
    """Settings built from command-line options, with the same overrides and errors."""
    try:
        config = validate_config(data, os.environ)
        _read_token(config.api)
        return config
    except ConfigError as exc:
        exit_invalid("the command line", exc.problems)


def open_state_or_exit(state_dir: Path) -> Database:
    """The state database under `state_dir`, or a clear message and exit 2."""
    try:
        return Database.open(state_dir)
    except (OSError, sqlite3.Error, SchemaTooNewError) as exc:
        print(
            f"kvpilot: state_dir {state_dir}: cannot open the database: {exc}",
            file=sys.stderr,
        )
        raise typer.Exit(INVALID_CONFIG_EXIT) from None
