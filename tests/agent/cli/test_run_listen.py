"""A taken port ends `kvpilot run` with the setting that holds it named: the control API's
own listener (`api.listen`) is not the main one (`listen`)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from kvpilot.agent.cli.main import app
from kvpilot.rig.server import free_port


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield taken.getsockname()[1]


def _run(tmp_path: Path, **listeners: object) -> tuple[int, str]:
    config = {
        "state_dir": str(tmp_path / "state"),
        "runtime": {"kind": "attach", "servers": [{"name": "vllm", "url": "http://127.0.0.1:9"}]},
        **listeners,
    }
    path = tmp_path / "kvpilot.yaml"
    path.write_text(yaml.safe_dump(config))
    result = CliRunner().invoke(app, ["run", "--config", str(path)], env={"COLUMNS": "200"})
    return result.exit_code, result.stderr


def test_a_taken_api_listen_port_names_api_listen(tmp_path: Path, taken_port: int) -> None:
    code, err = _run(
        tmp_path,
        listen={"host": "127.0.0.1", "port": free_port()},
        api={"listen": f"127.0.0.1:{taken_port}"},
    )
    assert code == 1
    assert f"cannot listen on 127.0.0.1:{taken_port}: address already in use" in err, err
    assert "choose another with api.listen in" in err, err
    assert "listen.host and listen.port" not in err, err


def test_a_taken_listen_port_names_listen(tmp_path: Path, taken_port: int) -> None:
    code, err = _run(
        tmp_path,
        listen={"host": "127.0.0.1", "port": taken_port},
        api={"listen": f"127.0.0.1:{free_port()}"},
    )
    assert code == 1
    assert "choose another with listen.host and listen.port in" in err, err
    assert "api.listen" not in err, err
