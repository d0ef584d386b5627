"""Every command that takes `--config` loads it the same way: the YAML, then the `KVPILOT_*`
environment overrides, and one clear message with exit code 2 when it is invalid."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from kvpilot.agent.cli.main import app
from kvpilot.rig.server import free_port
from tests.agent.sidecar_harness import agent_config, server_spec

# Each command that reads the agent's configuration, as it is called with `--config F`.
COMMANDS = {
    "run": ["run", "--config", "{F}"],
    "tune": ["tune", "--config", "{F}", "--dry-run"],
    "tune report": ["tune", "report", "--config", "{F}", "--output", "{T}/report.html"],
    "trials": ["trials", "--config", "{F}"],
    "dashboards build": ["dashboards", "build", "--root", "{T}", "--config", "{F}"],
    "rules": ["rules", "--config", "{F}"],
    "config check": ["config", "check", "{F}"],
}
# The ones that keep the state database (and so must find it where `run` does).
STATEFUL = ["tune", "tune report", "trials"]


def _config(tmp_path: Path, **changes: Any) -> Path:
    path = agent_config(
        tmp_path,
        spec=server_spec(),
        rules={},
        notifiers=[],
        remediation={},
        listen_port=free_port(),
    )
    if changes:
        data = yaml.safe_load(path.read_text())
        data.update(changes)
        path.write_text(yaml.safe_dump(data))
    return path


def _args(command: str, path: Path, tmp_path: Path) -> list[str]:
    return [a.format(F=path, T=tmp_path) for a in COMMANDS[command]]


def _clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without KVPILOT_* settings, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPILOT_")}
    return {**env, **extra}


def _kvpilot(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvpilot.agent", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )


@pytest.mark.parametrize("command", STATEFUL)
def test_the_state_dir_override_moves_the_database_for_tuning_commands(
    tmp_path: Path, command: str
) -> None:
    path = _config(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    result = CliRunner().invoke(
        app, _args(command, path, tmp_path), env={"KVPILOT_STATE_DIR": str(elsewhere)}
    )
    assert result.exit_code == 0, result.output
    assert (elsewhere / "kvpilot.db").exists()
    assert not (tmp_path / "state").exists(), "the YAML's state_dir was used"


@pytest.mark.parametrize("command", ["rules", "dashboards build"])
def test_rule_settings_from_the_environment_reach_rules_and_dashboards(
    tmp_path: Path, command: str
) -> None:
    path = _config(tmp_path)
    env = {"KVPILOT_RULES__FRAGMENTATION__KV_BLOCKS__THRESHOLD_RATIO": "0.45"}
    result = CliRunner().invoke(app, _args(command, path, tmp_path), env=env)
    assert result.exit_code == 0, result.output
    rules = (
        result.stdout
        if command == "rules"
        else (tmp_path / "dashboards/rules/kvpilot.rules.yaml").read_text()
    )
    assert "> 0.45" in rules


@pytest.mark.parametrize("command", list(COMMANDS))
def test_an_invalid_config_is_one_clear_message_and_exit_2(tmp_path: Path, command: str) -> None:
    path = _config(tmp_path, remediaton={})
    done = _kvpilot(_args(command, path, tmp_path), _clean_env())
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    lines = done.stderr.splitlines()
    assert lines[0] == f"kvpilot: {path}: invalid configuration"
    assert "  remediaton: unknown field; did you mean 'remediation'?" in lines


@pytest.mark.parametrize("command", ["tune", "dashboards build"])
def test_an_invalid_override_names_its_variable(tmp_path: Path, command: str) -> None:
    path = _config(tmp_path)
    done = _kvpilot(_args(command, path, tmp_path), _clean_env(KVPILOT_INTERVAL_S="often"))
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    assert done.stderr.startswith(f"kvpilot: {path}: invalid configuration\n")
    assert "interval_s: " in done.stderr and "[from KVPILOT_INTERVAL_S]" in done.stderr


@pytest.mark.parametrize("command", ["tune", "trials"])
def test_a_state_dir_that_cannot_hold_the_database_is_a_clear_error(
    tmp_path: Path, command: str
) -> None:
    not_a_dir = tmp_path / "a-file"
    not_a_dir.write_text("")
    path = _config(tmp_path, state_dir=str(not_a_dir))
    done = _kvpilot(_args(command, path, tmp_path), _clean_env())
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    assert done.stderr.startswith(f"kvpilot: state_dir {not_a_dir}: cannot open the database")


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (None, "cannot read: No such file or directory"),
        (b"\xff\xfe\x00runtime: {}", "not UTF-8 text"),
        (b"runtime: [unclosed", "not valid YAML"),
        (b"- a list\n", "the top level must be a mapping, not list"),
    ],
)
def test_a_file_that_is_no_configuration_is_a_clear_error(
    tmp_path: Path, content: bytes | None, says: str
) -> None:
    path = tmp_path / "kvpilot.yaml"
    if content is not None:
        path.write_bytes(content)
    done = _kvpilot(_args("tune", path, tmp_path), _clean_env())
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    assert done.stderr.startswith(f"kvpilot: {path}: invalid configuration\n")
    assert says in done.stderr
