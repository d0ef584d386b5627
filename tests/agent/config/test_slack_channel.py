"""Slack's `channel` is gone: app webhooks post where they were created. A configuration that
still sets it is refused with the reason, wherever the setting comes from."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from kvpilot.agent.cli.main import app
from kvpilot.agent.config import ConfigError, SlackNotifierConfig, load_config

REPO = Path(__file__).resolve().parents[3]
HOOK = "https://hooks.slack.com/services/T0/B0/secret-path-9d1f"


def _write(tmp_path: Path, slack: dict[str, Any]) -> Path:
    path = tmp_path / "kvpilot.yaml"
    data = {"runtime": {"kind": "process", "port": 8000}, "notifiers": [slack]}
    path.write_text(yaml.safe_dump(data))
    return path


def _problems(path: Path, environ: dict[str, str] | None = None) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        load_config(path, environ)
    return list(caught.value.problems)


def test_a_channel_is_refused_with_the_reason(tmp_path: Path) -> None:
    (problem,) = _problems(_write(tmp_path, {"kind": "slack", "url": HOOK, "channel": "#ops"}))
    assert problem.startswith("notifiers.0.channel: no longer supported: ")
    assert "ignore" in problem and "webhook" in problem
    assert HOOK not in problem


def test_a_channel_from_the_environment_names_its_variable(tmp_path: Path) -> None:
    path = _write(tmp_path, {"kind": "slack", "url": HOOK})
    (problem,) = _problems(path, {"KVPILOT_NOTIFIERS__0__CHANNEL": "#ops"})
    assert problem.startswith("notifiers.0.channel: no longer supported: ")
    assert problem.endswith("[from KVPILOT_NOTIFIERS__0__CHANNEL]")


def test_other_unknown_fields_stay_unknown(tmp_path: Path) -> None:
    (problem,) = _problems(_write(tmp_path, {"kind": "slack", "url": HOOK, "chanel": "#ops"}))
    assert problem.startswith("notifiers.0.chanel: unknown field")


def test_config_check_says_why_and_exits_2(tmp_path: Path) -> None:
    path = _write(tmp_path, {"kind": "slack", "url": HOOK, "channel": "#ops"})
    result = CliRunner().invoke(app, ["config", "check", str(path), "--no-env"])
    assert result.exit_code == 2
    assert "notifiers.0.channel: no longer supported: " in result.output


def test_neither_the_model_nor_the_schema_has_a_channel() -> None:
    assert "channel" not in SlackNotifierConfig.model_fields
    schema = json.loads((REPO / "docs" / "kvpilot.schema.json").read_text())
    assert "channel" not in schema["$defs"]["SlackNotifierConfig"]["properties"]
