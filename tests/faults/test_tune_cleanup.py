"""`kvpilot tune` on the local runtime leaves no server it started behind: not after its
end, nor a failure, nor SIGTERM or SIGINT; a server that ran before is left as it was, and
`--keep-servers` hands the stable server over (PID and port said) for `kvpilot run` to adopt.

Real `kvpilot` processes, real stand-in server processes (`standin_vllm_module`).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.faults.running_agent import (
    Agent,
    base_config,
    free_port,
    kill_all,
    processes_with,
    standin_instance,
    wait_until,
    write_config,
)

# Each test runs `kvpilot tune` as a process (4 to 10 s): the inner loop skips them.
pytestmark = pytest.mark.slow

EXIT_S = 60.0
GONE_S = 10.0
# Settings an equal canary can pass (a run that cannot is refused before anything starts):
# five windows of 64 requests show a five-point error margin and the preemption margin.
TUNING = {
    "trials": 1,
    "kv_max_bytes": 67_108_864,
    "max_num_seqs": 16,
    "workload": {"requests": 64, "concurrency": 1, "prompt_len": 8, "output_len": 4},
    "windows": 5,
    "error_margin_ratio": 0.05,
}


def _setup(tmp: Path, plan: str = "serve", **runtime: Any) -> tuple[Path, dict[str, Any]]:
    instance = standin_instance(tmp, "tiny", free_port(), plan=plan)
    config = base_config(tmp, [instance], tuning=TUNING)
    config["runtime"].update(runtime)
    return write_config(tmp / "kvpilot.yaml", config), instance


def _servers(tmp: Path) -> list[int]:
    """The stand-in processes of this test and their children (their command lines name its
    folder, as does the agent's, which is not one of them)."""
    return [pid for pid in processes_with(str(tmp)) if b"kvpilot.agent" not in _cmdline(pid)]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _starts(tmp: Path) -> int:
    path = tmp / "tiny.starts"
    return int(path.read_text() or 0) if path.exists() else 0


def _none_left(tmp: Path) -> None:
    try:
        wait_until(lambda: not _servers(tmp), GONE_S, "no stand-in server left")
    finally:
        kill_all(_servers(tmp))


def _said(lines: list[str], pattern: str) -> re.Match[str]:
    found = next((m for line in lines if (m := re.search(pattern, line))), None)
    assert found is not None, f"no line matching {pattern!r}:\n" + "\n".join(lines)
    return found


def test_the_stable_server_it_started_is_stopped_at_the_end(tmp_path: Path) -> None:
    path, _ = _setup(tmp_path)
    try:
        with Agent("tune", "--config", str(path)) as agent:
            code = agent.wait(EXIT_S)
            lines = agent.output()
        assert code == 0, lines
        said = _said(lines, r"stopped the stable server 'tiny' this run started \(PID (\d+)")
        assert _starts(tmp_path) == 2, lines  # the stable and one canary both ran
        assert int(said.group(1)) not in _servers(tmp_path)
    finally:
        _none_left(tmp_path)


def test_a_stable_server_that_never_became_ready_is_stopped_with_its_children(
    tmp_path: Path,
) -> None:
    path, _ = _setup(tmp_path, plan="hang", ready_timeout_s=3)
    try:
        with Agent("tune", "--config", str(path)) as agent:
            code = agent.wait(EXIT_S)
            lines = agent.output()
        assert code == 1, lines
        assert "Traceback" not in "\n".join(lines), lines
    finally:
        _none_left(tmp_path)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_mid_canary_stops_the_canary_and_the_stable_server(
    tmp_path: Path, sig: signal.Signals
) -> None:
    # The canary (the second start) hangs with a child in its group until the signal.
    path, _ = _setup(tmp_path, plan="serve,hang")
    try:
        with Agent("tune", "--config", str(path)) as agent:
            wait_until(
                lambda: _starts(tmp_path) == 2 and len(_servers(tmp_path)) >= 3,
                EXIT_S,
                "the stable and the hanging canary with its child",
            )
            agent.check_alive("while the canary starts")
            agent.signal(sig)
            code = agent.wait(EXIT_S)
            lines = agent.output()
        assert code == 128 + sig, lines
        assert f"kvpilot tune: stopped by {sig.name}" in lines, lines
        _said(lines, r"stopped the stable server 'tiny' this run started \(PID \d+")
        assert "Traceback" not in "\n".join(lines), lines
    finally:
        _none_left(tmp_path)


def test_a_stable_server_that_ran_before_is_left_running(tmp_path: Path) -> None:
    path, instance = _setup(tmp_path)
    before = subprocess.Popen(
        instance["argv"],
        env={**os.environ, **instance["env"]},
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        port = instance["argv"][-1]
        wait_until(lambda: _starts(tmp_path) == 1, EXIT_S, "the server started before")
        with Agent("tune", "--config", str(path)) as agent:
            code = agent.wait(EXIT_S)
            lines = agent.output()
        assert code == 0, lines
        assert before.poll() is None, lines  # the same process still runs
        said = _said(
            lines,
            r"the stable server 'tiny' ran before this run and still runs "
            r"\(PID (\d+), port (\d+)\)",
        )
        assert said.groups() == (str(before.pid), port)
        assert _servers(tmp_path) == [before.pid]  # the canary is gone
    finally:
        before.kill()
        before.wait()
        _none_left(tmp_path)


def test_keep_servers_hands_the_stable_server_over_and_kvpilot_run_adopts_it(
    tmp_path: Path,
) -> None:
    path, instance = _setup(tmp_path)
    try:
        with Agent("tune", "--config", str(path), "--keep-servers") as agent:
            code = agent.wait(EXIT_S)
            lines = agent.output()
        assert code == 0, lines
        adopt = re.escape(f"`kvpilot run --config {path}` adopts it")
        said = _said(
            lines, rf"kept the stable server 'tiny' running \(PID (\d+), port (\d+)\): {adopt}"
        )
        pid = int(said.group(1))
        assert said.group(2) == instance["argv"][-1]
        assert _servers(tmp_path) == [pid]  # the stable alone: the canary is gone
        starts = _starts(tmp_path)
        with Agent("run", "--config", str(path)) as run:
            run.wait_message("instance tiny: adopted the server an earlier kvpilot left running")
            assert _starts(tmp_path) == starts  # adopted, not started a second time
            run.signal(signal.SIGTERM)
            assert run.wait(EXIT_S) == 0
        # `kvpilot run` stopped what it adopted (a zombie until init reaps it: not alive).
        wait_until(lambda: pid not in _servers(tmp_path), GONE_S, "the adopted server gone")
    finally:
        _none_left(tmp_path)


def test_the_next_run_stops_what_a_killed_run_left(tmp_path: Path) -> None:
    """SIGKILL leaves no time to clean up: the next `kvpilot tune` knows the stable server as
    a killed run's (by the id it carries), stops its canary and, at its end, the server."""
    path, _ = _setup(tmp_path, plan="serve,hang,serve")
    try:
        with Agent("tune", "--config", str(path)) as killed:
            wait_until(
                lambda: _starts(tmp_path) == 2 and len(_servers(tmp_path)) >= 3,
                EXIT_S,
                "the stable and the hanging canary with its child",
            )
            killed.signal(signal.SIGKILL)
            assert killed.wait(EXIT_S) == -signal.SIGKILL
        left = _servers(tmp_path)
        assert len(left) >= 3  # nothing cleaned up
        with Agent("tune", "--config", str(path)) as agent:
            code = agent.wait(EXIT_S)
            lines = agent.output()
        assert code == 0, lines
        assert (
            "the stable server 'tiny' a killed kvpilot tune left running is this run's: "
            "stopped at its end" in lines
        ), lines
        _said(lines, r"stopped the stable server 'tiny' this run started \(PID \d+")
    finally:
        _none_left(tmp_path)
