"""The control API's token follows its file: Kubernetes rotates a mounted Secret by flipping a
symlink to a new file, and from then on the new token works and the old one does not. SIGHUP
reads the file again even when a change left its size and time as they were. A file that
gives no token disables the control API (fail closed), never keeps the old token valid."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest
import yaml

from kvpilot.agent.app.control_token import ControlToken
from tests.faults.agent_process import kvpilot, ticks
from tests.faults.misbehaving import Misbehaving, answer, free_port

ROOT = Path(__file__).resolve().parents[2]
PAYLOAD = (ROOT / "tests" / "fixtures" / "vllm" / "v0_32_under_load.prom").read_bytes()
OLD, NEW, THIRD = "old-token-aaaaaaaa", "new-token-bbbbbbbb", "3rd-token-cccccccc"


def _mount(folder: Path, version: str, token: str) -> None:
    """What the kubelet does: a new timestamped folder, then `..data` flipped to it at once."""
    (folder / version).mkdir()
    (folder / version / "token").write_text(token + "\n")
    link = folder / "..data_tmp"
    link.symlink_to(version)
    link.replace(folder / "..data")


def _status(url: str, token: str) -> int:
    """A control POST's status: 401 for a wrong token, 422 for a right one (empty silence)."""
    headers = {"Authorization": f"Bearer {token}"}
    return httpx.post(
        f"{url}/api/v1/silences", content=b"{}", headers=headers, timeout=5
    ).status_code


def _until(test: object, what: str, deadline_s: float = 10.0) -> None:
    assert callable(test)
    end = time.monotonic() + deadline_s
    while not test():
        if time.monotonic() > end:
            pytest.fail(f"{what} within {deadline_s:g} s")
        time.sleep(0.1)


@pytest.mark.slow
def test_a_rotated_secret_and_sighup_change_the_token_that_works(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.mkdir()
    _mount(secret, "..v1", OLD)
    (secret / "token").symlink_to("..data/token")
    port = free_port()
    version = answer(b'{"version": "0.32.0"}', "application/json")
    with Misbehaving({"/metrics": answer(PAYLOAD), "/version": version}) as vllm:
        config = {
            "listen": {"host": "127.0.0.1", "port": port},
            "interval_s": 0.5,
            "state_dir": str(tmp_path / "state"),
            "runtime": {"kind": "process", "port": int(vllm.url.rsplit(":", 1)[1])},
            "api": {"token_file": str(secret / "token")},
        }
        (tmp_path / "kvpilot.yaml").write_text(yaml.safe_dump(config))
        with kvpilot(["run", "--config", str(tmp_path / "kvpilot.yaml")], tmp_path, port) as agent:
            agent.wait_for("a tick", lambda t: ticks(t) >= 1)
            assert _status(agent.url, OLD) == 422
            _mount(secret, "..v2", NEW)  # the rotation
            assert _status(agent.url, NEW) == 422, "the new token is refused"
            assert _status(agent.url, OLD) == 401, "the old token still works"
            # Rewritten in place with the same length and time: only SIGHUP can tell.
            target = secret / "..v2" / "token"
            before = target.stat()
            target.write_text(THIRD + "\n")
            os.utime(target, ns=(before.st_atime_ns, before.st_mtime_ns))
            assert _status(agent.url, NEW) == 422  # the stat says nothing changed
            os.kill(agent.process.pid, signal.SIGHUP)
            _until(lambda: _status(agent.url, THIRD) == 422, "the token read again on SIGHUP")
            assert _status(agent.url, NEW) == 401


def test_a_token_file_that_empties_or_vanishes_disables_control(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text(OLD)
    token = ControlToken(token_file=path)
    assert token.check(f"Bearer {OLD}") == "ok"
    path.write_text("")
    assert token.check(f"Bearer {OLD}") == "disabled"
    path.unlink()
    assert token.check(f"Bearer {OLD}") == "disabled" and token.problem
    path.write_text("x" * (1 << 20))  # not a token: refused, and never read whole
    assert token.check("Bearer " + "x" * (1 << 20)) == "disabled"
    path.write_text(NEW)
    assert token.check(f"Bearer {NEW}") == "ok" and token.check(f"Bearer {OLD}") == "refused"
