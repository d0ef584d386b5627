"""Hostile or broken configuration input: every command refuses it with one clear message and
exit code 2, quickly and in little memory, and never starts anything; a rule given in part
keeps the rest of its default.

The product is driven from the outside (`python -m kvpilot.agent` as a child process, which
inherits PYTHONPATH), so these tests run unchanged against any build of the command.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

# Each test starts the agent as a process: the inner loop (-m "not slow") skips them.
pytestmark = pytest.mark.slow

# Each command that reads the agent's configuration, as it is called with `--config F`.
COMMANDS = {
    "run": ["run", "--config", "{F}"],
    "config check": ["config", "check", "{F}"],
    "tune": ["tune", "--config", "{F}", "--dry-run"],
    "tune report": ["tune", "report", "--config", "{F}", "--output", "{T}/report.html"],
    "trials": ["trials", "--config", "{F}"],
    "dashboards build": ["dashboards", "build", "--root", "{T}", "--config", "{F}"],
    "rules": ["rules", "--config", "{F}"],
}
EXIT_INVALID = 2
# Python's start and the command's imports take well under a second on an idle machine; the
# margin is for a busy one. A child still running at KILL_AFTER_S is killed (and fails).
FAST_S = 8.0
KILL_AFTER_S = 20.0
# The command's own footprint is about 60 MiB; the address-space cap keeps a runaway child
# from taking the machine with it (it fails with MemoryError instead).
PEAK_RSS_LIMIT_BYTES = 256 * 2**20
ADDRESS_SPACE_CAP_BYTES = 2 * 2**30

# Starts the command as its own child and writes the child's exit and peak RSS to a file. A
# forked child's peak RSS counts the resident set of its parent at the fork: from this small
# process that is a few MiB, from the test runner it could be hundreds.
LAUNCHER = """
import json, os, resource, sys

cap, report, *argv = sys.argv[1:]
pid = os.fork()
if pid == 0:
    try:
        resource.setrlimit(resource.RLIMIT_AS, (int(cap), int(cap)))
        os.execv(argv[0], argv)
    finally:
        os._exit(127)
_, status, usage = os.wait4(pid, 0)
with open(report, "w") as out:
    json.dump([os.waitstatus_to_exitcode(status), usage.ru_maxrss * 1024], out)
"""


@dataclass(frozen=True)
class Finished:
    returncode: int | None  # None: killed after KILL_AFTER_S
    stdout: str
    stderr: str
    elapsed_s: float
    peak_rss_bytes: int | None

    def output(self) -> str:
        return f"exit {self.returncode} after {self.elapsed_s:.1f} s\n{self.stdout}{self.stderr}"


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # the group is gone already
        os.killpg(pgid, signal.SIGKILL)


def kvpilot(args: list[str], tmp_path: Path, **env: str) -> Finished:
    """Runs the command in its own process group; its exit, output, time and peak RSS."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("KVPILOT_")}
    environ.update(env)
    report = tmp_path / "launcher-report.json"
    report.unlink(missing_ok=True)
    command = [sys.executable, "-m", "kvpilot.agent", *args]
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        started = time.monotonic()
        launcher = subprocess.Popen(
            [sys.executable, "-c", LAUNCHER, str(ADDRESS_SPACE_CAP_BYTES), str(report), *command],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            env=environ,
            cwd=tmp_path,
            start_new_session=True,
        )
        try:
            with contextlib.suppress(subprocess.TimeoutExpired):  # then it is killed
                launcher.wait(timeout=KILL_AFTER_S)
        finally:
            _kill_group(launcher.pid)  # the command, and whatever it may have started
            launcher.wait()
        elapsed_s = time.monotonic() - started
        returncode, peak_rss_bytes = (
            json.loads(report.read_text()) if report.exists() else [None] * 2
        )
        out.seek(0)
        err.seek(0)
        return Finished(
            returncode=returncode,
            stdout=out.read().decode(errors="replace"),
            stderr=err.read().decode(errors="replace"),
            elapsed_s=elapsed_s,
            peak_rss_bytes=peak_rss_bytes,
        )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def base_config(tmp_path: Path) -> str:
    """A valid configuration (one server by port, nothing listening there), as YAML text."""
    return (
        f"state_dir: {tmp_path / 'state'}\n"
        f"listen: {{host: 127.0.0.1, port: {free_port()}}}\n"
        f"runtime: {{kind: process, port: {free_port()}}}\n"
    )


def alias_bomb() -> str:
    """Nine levels of nine aliases: 9**9 (387 million) strings once expanded."""
    lines = ['lol0: &lol0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for level in range(1, 10):
        items = ", ".join([f"*lol{level - 1}"] * 9)
        lines.append(f"lol{level}: &lol{level} [{items}]")
    return "\n".join(lines) + "\n"


def _write(tmp_path: Path, content: bytes) -> Path:
    path = tmp_path / "kvpilot.yaml"
    path.write_bytes(content)
    return path


# name: (the file's content after a valid configuration, what the message must say)
BAD_INPUTS: dict[str, tuple[bytes, str]] = {
    "alias bomb": (alias_bomb().encode(), "more than 100000 values once aliases are expanded"),
    "deep nesting": (
        b"notes: " + b"[" * 5000 + b"]" * 5000 + b"\n",
        "nested deeper than 32 levels",
    ),
    "a cyclic alias": (b"notes: &loop [1, *loop]\n", "refers to a collection that contains it"),
    "not UTF-8": (b"notes: caf\xe9\n", "not UTF-8 text: invalid continuation byte at byte offset"),
    "an integer Python will not parse": (
        b"interval_s: " + b"9" * 5000 + b"\n",
        "not a value kvpilot can read",
    ),
    "over 1 MiB": (
        b"# padding\n" * (1024 * 1024 // 10 + 1),
        "larger than 1048576 bytes (1 MiB)",
    ),
}


def _bad_file(tmp_path: Path, name: str) -> tuple[Path, str]:
    content, says = BAD_INPUTS[name]
    return _write(tmp_path, base_config(tmp_path).encode() + content), says


def assert_refused(done: Finished, path: Path, says: str) -> None:
    """Exit 2 with one message naming the file and the problem; quick, small, no traceback."""
    assert done.returncode == EXIT_INVALID, done.output()
    assert "Traceback" not in done.stdout + done.stderr, done.output()
    assert done.stderr.startswith(f"kvpilot: {path}: invalid configuration\n"), done.output()
    assert f"  {path}: " in done.stderr and says in done.stderr, done.output()
    assert done.elapsed_s < FAST_S, done.output()
    assert done.peak_rss_bytes is not None and done.peak_rss_bytes < PEAK_RSS_LIMIT_BYTES, (
        done.peak_rss_bytes,
        done.output(),
    )


@pytest.mark.parametrize("name", list(BAD_INPUTS))
@pytest.mark.parametrize("command", ["config check", "run"])
def test_bad_input_is_refused_in_one_message(tmp_path: Path, command: str, name: str) -> None:
    path, says = _bad_file(tmp_path, name)
    args = [a.format(F=path, T=tmp_path) for a in COMMANDS[command]]
    done = kvpilot(args, tmp_path)
    assert_refused(done, path, says)
    if command == "run":  # it never got as far as the state directory
        assert not (tmp_path / "state").exists(), done.output()


@pytest.mark.parametrize("command", [c for c in COMMANDS if c not in ("run", "config check")])
def test_every_other_command_refuses_the_alias_bomb_quickly(tmp_path: Path, command: str) -> None:
    path, says = _bad_file(tmp_path, "alias bomb")
    done = kvpilot([a.format(F=path, T=tmp_path) for a in COMMANDS[command]], tmp_path)
    assert_refused(done, path, says)


def test_the_encoding_error_names_the_byte_offset(tmp_path: Path) -> None:
    prefix = base_config(tmp_path).encode() + b"notes: caf"
    path = _write(tmp_path, prefix + b"\xe9\n")
    done = kvpilot(["config", "check", str(path)], tmp_path)
    line = prefix.count(b"\n") + 1
    assert_refused(done, path, f"at byte offset {len(prefix)} (line {line})")


def test_a_huge_number_is_named_not_printed(tmp_path: Path) -> None:
    # Hexadecimal parses to any size, but str() refuses an int of over 4300 decimal digits.
    content = base_config(tmp_path) + "interval_s: 0x" + "f" * 5000 + "\n"
    path = _write(tmp_path, content.encode())
    done = kvpilot(["config", "check", str(path)], tmp_path)
    assert done.returncode == EXIT_INVALID, done.output()
    assert "Traceback" not in done.stdout + done.stderr, done.output()
    assert done.stderr.startswith(f"kvpilot: {path}: invalid configuration\n"), done.output()
    assert "  interval_s: " in done.stderr and "(got an integer of 20000 bits)" in done.stderr


@pytest.mark.parametrize("command", ["config check", "run"])
def test_a_token_file_that_is_not_utf8_is_a_clear_error(tmp_path: Path, command: str) -> None:
    token_file = tmp_path / "token"
    token_file.write_bytes(b"s3cret\xff\n")
    content = base_config(tmp_path) + f"api: {{token_file: {token_file}}}\n"
    path = _write(tmp_path, content.encode())
    done = kvpilot([a.format(F=path, T=tmp_path) for a in COMMANDS[command]], tmp_path)
    assert done.returncode == EXIT_INVALID, done.output()
    assert "Traceback" not in done.stdout + done.stderr, done.output()
    assert done.stderr.startswith(f"kvpilot: {path}: invalid configuration\n"), done.output()
    assert f"  api.token_file: {token_file}: not UTF-8 text at byte offset 6\n" in done.stderr
    assert "s3cret" not in done.stdout + done.stderr


def _rules_line(done: Finished) -> str:
    assert done.returncode == 0, done.output()
    lines = [line for line in done.stdout.splitlines() if line.startswith("rules enabled")]
    assert len(lines) == 1, done.output()
    return lines[0]


def test_a_partial_rule_in_the_yaml_keeps_the_default_action(tmp_path: Path) -> None:
    rules = "rules: {fragmentation: {allocator: {threshold_ratio: 0.4}}}\n"
    path = _write(tmp_path, (base_config(tmp_path) + rules).encode())
    line = _rules_line(kvpilot(["config", "check", str(path)], tmp_path))
    assert "fragmentation.allocator (restart)" in line
    assert "fragmentation.kv_blocks (alert)" in line


def test_a_partial_rule_from_the_environment_keeps_the_default_action(tmp_path: Path) -> None:
    path = _write(tmp_path, base_config(tmp_path).encode())
    env = {"KVPILOT_RULES__FRAGMENTATION__ALLOCATOR__THRESHOLD_RATIO": "0.4"}
    line = _rules_line(kvpilot(["config", "check", str(path)], tmp_path, **env))
    assert "fragmentation.allocator (restart)" in line


def test_a_rule_mapping_from_the_environment_merges_into_the_yamls(tmp_path: Path) -> None:
    rules = "rules: {fragmentation: {allocator: {enabled: false}}}\n"
    path = _write(tmp_path, (base_config(tmp_path) + rules).encode())
    env = {"KVPILOT_RULES__FRAGMENTATION": "{kv_blocks: {action: restart}}"}
    line = _rules_line(kvpilot(["config", "check", str(path)], tmp_path, **env))
    assert "fragmentation.kv_blocks (restart)" in line
    assert "fragmentation.allocator" not in line  # the YAML's `enabled: false` still holds
