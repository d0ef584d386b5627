"""What the shipped image and manifests rely on, in the quick set: `run --config` needs no
temporary directory, `listen` takes the HOST:PORT form the image's users write, a setting that
needs an extra that is not installed is refused with the pip command, and the version is
written once (pyproject.toml)."""

from __future__ import annotations

import importlib
import importlib.metadata
import tempfile
import tomllib
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml
from typer.testing import CliRunner

import kvpilot
from kvpilot.agent.cli.config_load import exit_missing_extras, load_or_exit
from kvpilot.agent.cli.main import app
from kvpilot.agent.config import extras
from kvpilot.agent.config.agent import DEFAULT_PORT, parse_host_port
from kvpilot.agent.config.extras import needed_extras
from kvpilot.rig.server import free_port
from tests.agent.sidecar_harness import agent_config, server_spec

ROOT = Path(__file__).resolve().parents[3]
cli_main = importlib.import_module("kvpilot.agent.cli.main")
POD_CONFIG = ROOT / "deploy" / "overlays" / "tuning" / "kvpilot-config.yaml"


def _config(tmp_path: Path) -> Path:
    return agent_config(
        tmp_path,
        spec=server_spec(),
        rules={},
        notifiers=[],
        remediation={},
        listen_port=free_port(),
    )


def _no_temporary_directory(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """As in a container with a read-only root and no /tmp: tempfile finds nowhere to write."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "no-such-dir"))


def test_run_with_a_file_makes_no_temporary_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_temporary_directory(monkeypatch, tmp_path)
    with cli_main._scratch_state_dir(needed=False) as scratch:
        assert scratch == ""  # the file's state_dir decides; nothing was made
    monkeypatch.setenv("KVPILOT_STATE_DIR", str(tmp_path))
    with cli_main._scratch_state_dir(needed=True) as scratch:
        assert scratch == ""  # KVPILOT_STATE_DIR decides


def test_run_without_a_file_or_a_temporary_directory_says_what_to_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_temporary_directory(monkeypatch, tmp_path)
    monkeypatch.delenv("KVPILOT_STATE_DIR", raising=False)
    monkeypatch.delenv("KVPILOT_CONFIG", raising=False)
    result = CliRunner().invoke(app, ["run", "--vllm-url", "http://127.0.0.1:1"])
    assert result.exit_code == 2
    assert "KVPILOT_STATE_DIR" in result.output and "Traceback" not in result.output


def test_the_images_listen_variable_is_read_as_host_and_port(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVPILOT_LISTEN", f"0.0.0.0:{DEFAULT_PORT}")
    result = CliRunner().invoke(app, ["config", "check", str(_config(tmp_path))])
    assert result.exit_code == 0, result.output
    assert f"listen: 0.0.0.0:{DEFAULT_PORT}" in result.output


@pytest.mark.parametrize(
    ("text", "expected"),
    [("0.0.0.0:8474", ("0.0.0.0", 8474)), ("[::1]:8475", ("::1", 8475))],
)
def test_host_port_strings(text: str, expected: tuple[str, int]) -> None:
    parsed = parse_host_port(text)
    assert (parsed["host"], parsed["port"]) == expected


@pytest.mark.parametrize("text", ["8474", "host:", ":8474", "host:port", "host:８４７４"])
def test_host_port_strings_that_are_not(text: str) -> None:
    with pytest.raises(ValueError, match="expected HOST:PORT"):
        parse_host_port(text)


def test_the_api_listener_may_not_share_the_metrics_port(tmp_path: Path) -> None:
    path = _config(tmp_path)
    data: dict[str, Any] = yaml.safe_load(path.read_text())
    data["api"]["listen"] = f"127.0.0.1:{data['listen']['port']}"
    path.write_text(yaml.safe_dump(data))
    result = CliRunner().invoke(app, ["config", "check", str(path)])
    assert result.exit_code == 2 and "both want port" in result.output


def _missing(*modules: str) -> Any:
    real = extras.importlib.util.find_spec

    def find_spec(name: str) -> Any:
        return None if name in modules else real(name)

    return find_spec


def test_a_missing_extra_is_refused_with_its_pip_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tuning overlay's settings (pod runtime, a schedule) without the extras installed."""
    config_map = yaml.safe_load(POD_CONFIG.read_text())
    path = tmp_path / "kvpilot.yaml"
    path.write_text(config_map["data"]["kvpilot.yaml"])
    monkeypatch.setenv("KVPILOT_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setattr(extras.importlib.util, "find_spec", _missing("kubernetes", "skopt"))
    result = CliRunner().invoke(app, ["config", "check", str(path)])
    assert result.exit_code == 0
    assert "pip install 'kvpilot[kubernetes,tuner]'" in result.output
    config, _ = load_or_exit(path)
    with pytest.raises(typer.Exit) as exit_info:
        exit_missing_extras(
            needed_extras(config)
        )  # what `run --config` does before anything starts
    assert exit_info.value.exit_code == 2


def test_the_version_is_written_once() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert kvpilot.__version__ == importlib.metadata.version("kvpilot") == pyproject
    assert f'"{pyproject}"' not in (ROOT / "kvpilot_ns" / "__init__.py").read_text()
