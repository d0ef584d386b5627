"""Faults of the state directory, driven from outside: real `kvpilot run --config` processes,
a recorded vLLM and a webhook receiver on loopback.

Two agents on one directory would each notify (every notification twice): the second must
stop, naming the first. A damaged, read-only or misplaced database must be one clear
message and a non-zero exit, never a traceback, and a damaged file is never recreated.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import yaml

from kvpilot.agent.state import StateStore
from kvpilot.rig.server import free_port
from tests.agent.notify.notify_receiver import Receiver
from tests.agent.state.loopback import (
    SATURATION_ALERT,
    LoopbackVllm,
    agent_config,
    firing_notifications,
)

# Each test starts the agent as a process: the inner loop (-m "not slow") skips them.
pytestmark = pytest.mark.slow

T = TypeVar("T")
DB = "kvpilot.db"


def wait_for(what: str, probe: Callable[[], T | None], timeout_s: float = 30.0) -> T:
    """Poll `probe` until it returns something truthy; fail naming `what` at the deadline."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


class Kvpilot:
    """One `kvpilot ...` command in its own process group, its output in a file."""

    def __init__(self, args: list[str], folder: Path, name: str) -> None:
        self.output_path = folder / f"{name}.out"
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVPILOT_")}
        with self.output_path.open("wb") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "kvpilot.agent", *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env=env,
                cwd=folder,
            )

    @property
    def pid(self) -> int:
        return self.process.pid

    def output(self) -> str:
        return self.output_path.read_text(errors="replace")

    def wait_exit(self, timeout_s: float = 30.0) -> int:
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"kvpilot still runs after {timeout_s:.0f} s:\n{self.output()[-3000:]}"
            ) from None

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)


def _metric(url: str, name: str) -> float | None:
    try:
        text = httpx.get(f"{url}/metrics", timeout=2.0).text
    except httpx.HTTPError:
        return None
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def _ticks(url: str) -> float:
    return _metric(url, "kvpilot_ticks_total") or 0.0


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    server = Receiver().start()
    yield server
    server.stop()


@pytest.fixture
def vllm() -> Iterator[LoopbackVllm]:
    with LoopbackVllm() as server:
        yield server


@pytest.fixture
def started() -> Iterator[list[Kvpilot]]:
    """Every command a test starts, stopped at the end whatever happened."""
    processes: list[Kvpilot] = []
    yield processes
    for process in processes:
        process.stop()


def _write_config(folder: Path, name: str, config: dict[str, Any]) -> Path:
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _config_for(
    tmp_path: Path, state_dir: Path, vllm: LoopbackVllm, receiver: Receiver, name: str = "a"
) -> tuple[Path, str]:
    port = free_port()
    config = agent_config(state_dir, vllm_url=vllm.url, receiver_url=receiver.url, listen_port=port)
    return _write_config(tmp_path, name, config), f"http://127.0.0.1:{port}"


def test_a_second_agent_on_the_same_state_dir_exits_and_each_notification_goes_once(
    tmp_path: Path, vllm: LoopbackVllm, receiver: Receiver, started: list[Kvpilot]
) -> None:
    state_dir = tmp_path / "state"
    first_config, first_url = _config_for(tmp_path, state_dir, vllm, receiver, "first")
    second_config, second_url = _config_for(tmp_path, state_dir, vllm, receiver, "second")
    first = Kvpilot(["run", "--config", str(first_config)], tmp_path, "first")
    started.append(first)
    wait_for("the first agent's /healthz", lambda: _healthy(first_url))

    second = Kvpilot(["run", "--config", str(second_config)], tmp_path, "second")
    started.append(second)
    # The second either stops (one agent per directory) or comes up beside the first.
    wait_for(
        "the second agent to exit or answer",
        lambda: second.process.poll() is not None or _healthy(second_url),
    )
    vllm.saturate()  # a new alert, while both would be running
    wait_for("a firing notification", lambda: firing_notifications(receiver, SATURATION_ALERT))
    ticks = _ticks(first_url)
    wait_for("three more ticks of the first agent", lambda: _ticks(first_url) >= ticks + 3)

    notified = firing_notifications(receiver, SATURATION_ALERT)
    assert len(notified) == 1, f"the receiver got the alert {len(notified)} times: {notified}"
    code = second.wait_exit(timeout_s=5)
    output = second.output()
    assert code != 0
    assert f"PID {first.pid}" in output, output
    assert "one agent per state directory" in output.lower(), output
    assert "Traceback" not in output, output
    assert not _healthy(second_url)  # it never listened
    assert first.process.poll() is None, "the first agent must go on"


def _damaged_by_garbage(db: Path) -> None:
    db.write_bytes(os.urandom(3) + b"not a database at all " * 200)


def _damaged_by_truncation(db: Path) -> None:
    """Half of a real state database, as a crash mid-copy or a full disk leaves it."""
    with StateStore.open(db.parent) as store:
        for i in range(200):
            store.set_fact(f"fact-{i}", {"value": "x" * 400}, now_wall_s=1.0)
    data = db.read_bytes()
    db.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize(
    "damage", [_damaged_by_garbage, _damaged_by_truncation], ids=["garbage", "truncated"]
)
def test_a_damaged_database_is_refused_with_the_recovery_step_and_left_untouched(
    tmp_path: Path,
    vllm: LoopbackVllm,
    receiver: Receiver,
    started: list[Kvpilot],
    damage: Callable[[Path], None],
) -> None:
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    damage(state_dir / DB)
    before = (state_dir / DB).read_bytes()
    config, url = _config_for(tmp_path, state_dir, vllm, receiver)
    agent = Kvpilot(["run", "--config", str(config)], tmp_path, "agent")
    started.append(agent)

    code = agent.wait_exit()
    output = agent.output()
    assert code != 0, output
    assert "is damaged" in output, output
    assert "kvpilot state repair --config" in output, output
    assert "Traceback" not in output, output
    assert (state_dir / DB).read_bytes() == before, "the damaged file was changed"
    assert not _healthy(url)


def test_state_check_and_repair_move_a_damaged_database_aside_and_the_agent_starts_afresh(
    tmp_path: Path, vllm: LoopbackVllm, receiver: Receiver, started: list[Kvpilot]
) -> None:
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    _damaged_by_garbage(state_dir / DB)
    before = (state_dir / DB).read_bytes()
    config, url = _config_for(tmp_path, state_dir, vllm, receiver)

    check = Kvpilot(["state", "check", "--config", str(config)], tmp_path, "check")
    assert check.wait_exit() == 1, check.output()
    assert "DAMAGED" in check.output() and "Traceback" not in check.output(), check.output()

    repair = Kvpilot(["state", "repair", "--config", str(config)], tmp_path, "repair")
    assert repair.wait_exit() == 0, repair.output()
    kept = [p for p in state_dir.iterdir() if p.name.startswith(f"{DB}.damaged-")]
    assert len(kept) == 1, sorted(p.name for p in state_dir.iterdir())
    assert kept[0].read_bytes() == before, "the damaged file must be kept as it was"

    agent = Kvpilot(["run", "--config", str(config)], tmp_path, "agent")
    started.append(agent)
    wait_for("the agent's /healthz on a fresh database", lambda: _healthy(url))
    again = Kvpilot(["state", "check", "--config", str(config)], tmp_path, "check-again")
    assert again.wait_exit() == 0, again.output()
    assert f"PID {agent.pid}" in again.output(), again.output()

    refused = Kvpilot(["state", "repair", "--config", str(config)], tmp_path, "repair-live")
    assert refused.wait_exit() == 1, refused.output()
    assert f"PID {agent.pid}" in refused.output(), refused.output()
    assert kept[0].read_bytes() == before


def _read_only_to_the_agent(db: Path) -> list[str] | None:
    """chmod 0444, and the argv prefix under which that holds: none for a user; for root,
    whom chmod does not stop, a user namespace of the agent's own, where root keeps no
    capability over the host's files. None where that namespace cannot be made."""
    db.chmod(0o444)
    if os.geteuid() != 0:
        return []
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    probe = subprocess.run([unshare, "--user", "true"], capture_output=True, check=False)
    return [unshare, "--user"] if probe.returncode == 0 else None


def test_a_read_only_database_is_one_clear_message(
    tmp_path: Path, vllm: LoopbackVllm, receiver: Receiver
) -> None:
    state_dir = tmp_path / "state"
    StateStore.open(state_dir).close()  # a sound database, as a first start leaves it
    wrapper = _read_only_to_the_agent(state_dir / DB)
    if wrapper is None:
        pytest.skip("root writes through chmod 0444, and no user namespace can be made here")
    config, url = _config_for(tmp_path, state_dir, vllm, receiver)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPILOT_")}
    argv = [*wrapper, sys.executable, "-m", "kvpilot.agent", "run", "--config", str(config)]
    done = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
        cwd=tmp_path,
        stdin=subprocess.DEVNULL,
    )
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert "read-only" in output and DB in output, output
    assert "Traceback" not in output, output
    assert not _healthy(url)


def test_a_state_dir_that_is_a_file_is_one_clear_message(
    tmp_path: Path, vllm: LoopbackVllm, receiver: Receiver, started: list[Kvpilot]
) -> None:
    state_dir = tmp_path / "state"
    state_dir.write_text("not a directory\n")
    config, _ = _config_for(tmp_path, state_dir, vllm, receiver)
    agent = Kvpilot(["run", "--config", str(config)], tmp_path, "agent")
    started.append(agent)

    code = agent.wait_exit()
    output = agent.output()
    assert code != 0, output
    assert f"state_dir {state_dir}: is a file, not a directory" in output, output
    assert "Traceback" not in output, output
    assert state_dir.read_text() == "not a directory\n"
