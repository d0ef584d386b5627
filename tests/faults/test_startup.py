"""Start-up faults: a taken listen port, a server that exits before it is ready, a Python
without vLLM. Each ends the command with a plain message and a non-zero code, never a
traceback, and leaves no server behind."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.faults.running_agent import (
    Agent,
    base_config,
    free_port,
    kill_all,
    processes_with,
    standin_instance,
    write_config,
)

# Each test starts the agent as a process: the inner loop (-m "not slow") skips them.
pytestmark = pytest.mark.slow

EXIT_S = 30.0


def _tuning() -> dict[str, object]:
    # A small search the planner can bound from the tiny model's config.json.
    return {"tuning": {"trials": 1, "kv_max_bytes": 67_108_864, "max_num_seqs": 16}}


def _assert_no_traceback(lines: list[str]) -> None:
    text = "\n".join(lines)
    assert "Traceback" not in text and "NotReady" not in text, text


def test_a_taken_listen_port_is_one_clear_line_and_nothing_starts(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = base_config(tmp_path, [standin_instance(tmp_path, "tiny", free_port())])
        config["listen"]["port"] = port
        path = write_config(tmp_path / "kvpilot.yaml", config)
        with Agent("run", "--config", str(path)) as agent:
            code = agent.wait(EXIT_S)
            lines = [line for line in agent.output() if line.strip()]
    assert code != 0
    _assert_no_traceback(lines)
    assert not any("listening" in line for line in lines), lines
    assert len(lines) == 1, lines
    assert f"127.0.0.1:{port}" in lines[0] and "address already in use" in lines[0], lines
    assert "choose another with listen.host and listen.port in" in lines[0], lines
    assert not (tmp_path / "tiny.starts").exists()  # no server was started


def test_run_ends_with_the_log_tail_when_the_server_exits_before_ready(tmp_path: Path) -> None:
    instance = standin_instance(tmp_path, "tiny", free_port(), plan="exit")
    path = write_config(tmp_path / "kvpilot.yaml", base_config(tmp_path, [instance]))
    try:
        with Agent("run", "--config", str(path)) as agent:
            code = agent.wait(EXIT_S)
            lines = agent.output()
    finally:
        left = processes_with(str(tmp_path))
        kill_all(left)
    assert code != 0
    _assert_no_traceback(lines)
    plain = [line for line in lines if not line.startswith("{")]  # not the JSON logs
    text = "\n".join(plain)
    assert "stand-in vLLM failed to start (no KV cache memory)" in text, text  # the tail
    assert "kvpilot: the vLLM server 'tiny' exited before it was ready (exit code 3)." in text
    assert left == []


def test_tune_ends_with_the_log_tail_when_the_server_exits_before_ready(tmp_path: Path) -> None:
    instance = standin_instance(tmp_path, "tiny", free_port(), plan="exit")
    config = base_config(tmp_path, [instance], **_tuning())
    path = write_config(tmp_path / "kvpilot.yaml", config)
    with Agent("tune", "--config", str(path)) as agent:
        code = agent.wait(EXIT_S)
        lines = agent.output()
    assert code == 1, lines
    _assert_no_traceback(lines)
    text = "\n".join(lines)
    assert "stand-in vLLM failed to start (no KV cache memory)" in text, text
    sentence = "kvpilot: the vLLM server 'tiny' exited before it was ready (exit code 3)."
    assert lines[-1] == sentence, lines


def test_tune_names_the_python_that_has_no_vllm(tmp_path: Path) -> None:
    """As a new user runs the example: `python` on PATH is an interpreter without vLLM."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    instance = standin_instance(tmp_path, "tiny", free_port())
    instance["argv"][0] = "python"
    instance["env"] = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "PYTHONPATH": ""}
    path = write_config(tmp_path / "kvpilot.yaml", base_config(tmp_path, [instance], **_tuning()))
    with Agent("tune", "--config", str(path)) as agent:
        code = agent.wait(EXIT_S)
        lines = agent.output()
    assert code == 1, lines
    _assert_no_traceback(lines)
    text = "\n".join(lines)
    assert "No module named 'vllm'" in text, text  # the log's tail
    assert f"the argv's 'python' resolved to {venv / 'bin' / 'python'}" in text, text
    assert "which has no vllm; use the virtualenv's python in `argv`" in text, text
