"""Soak: one `kvpilot run` at 1 Hz against servers that flap in rotation, for half an hour.

    .venv/bin/python benchmarks/soak.py                  # 30 minutes, 7 servers
    .venv/bin/python benchmarks/soak.py --quick          # 45 s, every mode seen at least once
    .venv/bin/python benchmarks/soak.py --minutes 10 --rotate-s 15
    .venv/bin/python benchmarks/soak.py --hostile --minutes 5 --warmup-s 30
    .venv/bin/python benchmarks/soak.py --hostile --clock-step --minutes 5 --warmup-s 30

The servers are stand-ins on loopback, all served by one helper process (this file with
`serve`; its CPU is not counted). Each server steps through the modes below every
`--rotate-s` seconds, each starting at another mode, so at every moment some server is in
each state:

* ok: the recorded `tests/fixtures/vllm/v0_32_under_load.prom`;
* restart: the idle recording, whose counters are lower (a restarted server: counters reset);
* garbage: random bytes;
* drip: a valid payload, a few bytes every half second (slower than any scrape deadline);
* huge: a 64 MiB body, streamed;
* refused: nothing listens on the port;
* nan: the recording with NaN and +Inf values.

`--hostile` adds an attacker's mix: a mode `labels` whose body carries a 400-digit
`num_gpu_blocks` and a 32 KiB label value that changes on every scrape; a receiver whose
answers are by turns slow (5 s), huge (a 64 MiB body) or a 503; and the control API's token
file rotated every 10 s, with the new token checked to work and the old one refused. It
prints memory and tick latency for the first and the last minute of the span. It also adds
what a scraped server can send beside the modes: `gzip` (the recording compressed although
identity was asked), `gzip-bomb` (64 MiB of newlines in 64 KiB of gzip), `not-gzip` (says
gzip, is the plain recording), and on every server a `/version` nested 60,000 levels deep
(read again after each failed scrape); and three more webhook receivers, two answering at
once and one after 2 s, each with a repeat every 30 s. The agent runs with its loop watched
(`KVPILOT_WATCH_LOOP=1`: asyncio's debug mode, callbacks over 100 ms logged, each tick
start logged with its monotonic time).

`--clock-step` steps the agent's wall clock, and only the agent's, an hour back a third into
the span and forward again at two thirds, with libfaketime preloaded into the agent (Debian's
`faketime`) and its monotonic clock left alone; the machine's clock is never touched. The
offset is a file that libfaketime reads at every call. Both flags print a table by phase
(before the step, an hour back, forward again): the largest gap between tick starts on the
monotonic clock (goal at most 2 s), `/healthz` polled every 0.5 s (goal: 200 within 1 s
throughout), the agent's wall clock as its Date header shows it, and the callbacks that held
the loop over 100 ms (goal none); and per receiver what it got: every alert's events in order
(an incident's firing events, repeats included, before its resolved; no incident back after
the next began) and none missing that another receiver had a minute before the end.

The agent watches them through the `attach` runtime (its servers are known by URL), with a
webhook notifier pointed at a receiver in the same helper that fails every third request.
It measures, after a warm-up: RSS growth (VmRSS of the agent, sampled every 5 s; goal under
5 MiB), ticks that overran their interval (`kvpilot_tick_overruns_total`; the scrape
deadline is 0.8 s, so a tick within its deadline never overruns; goal none), the
ticks completed against the span (none lost), exceptions in the agent's log (lines with a
traceback; goal none), and the state directory's size (bounded by retention: it may grow
with the audit trail of alerts, never with the scrapes).

With a warm-up shorter than the agent's windows (600 s of samples), the RSS growth includes
their filling, which is bounded: the soak also prints the RSS at each minute of the span and
the growth once the windows are full. `--tracemalloc` runs the agent under tracemalloc and
prints where memory grew between the span's start and end.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gzip
import itertools
import json
import math
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "vllm"
MODES = ("ok", "restart", "garbage", "drip", "huge", "refused", "nan")
HOSTILE_MODES = (*MODES, "labels", "gzip", "gzip-bomb", "not-gzip")
SLOW_ANSWER_S = 5.0
# Receivers beside the failing "hook": two that answer at once and one that answers slowly.
HOSTILE_RECEIVERS = ("hook", "fast-a", "fast-b", "slow")
SLOW_RECEIVER_S = 2.0
REPEAT_S = 30.0  # each receiver's repeat interval: firing alerts repeat within the span
DEEP_JSON = b'{"version": ' + b"[" * 60_000  # under the agent's 64 KiB cap for /version
STEP_S = 3600  # the agent's wall clock goes this far back, then forward again
FAKETIME_LIBRARIES = (
    "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1",
    "/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1",
    "/usr/lib/faketime/libfaketime.so.1",
    "/usr/local/lib/faketime/libfaketime.so.1",
)
WATCH_LOOP_ENV = "KVPILOT_WATCH_LOOP"  # the agent's `loop_watch`
HEALTH_EVERY_S = 0.5
TICK_GAP_GOAL_S = 2.0
HEALTH_GOAL_S = 1.0
CATCH_UP_S = 60.0  # a receiver has this long to get what another receiver got
HUGE_BYTES = 64 << 20
MIB = 1 << 20
WINDOWS_S = 600.0  # the agent's rolling windows keep this much: memory grows until they fill


# -- the stand-ins (run in a child process) ---------------------------------------------


@functools.cache  # one set for every stand-in: the bomb takes a moment to pack
def _payloads() -> dict[str, bytes]:
    ok = (FIXTURES / "v0_32_under_load.prom").read_bytes()
    nan = b"\n".join(
        line.rsplit(b" ", 1)[0] + (b" NaN" if i % 2 else b" +Inf")
        if line and not line.startswith(b"#")
        else line
        for i, line in enumerate(ok.splitlines())
    )
    return {
        "ok": ok,
        "restart": (FIXTURES / "v0_32_idle.prom").read_bytes(),
        "garbage": random.Random(7).randbytes(40_000),
        "nan": nan + b"\n",
        "gzip": gzip.compress(ok),
        "gzip-bomb": _gzip_bomb(HUGE_BYTES),
    }


def _gzip_bomb(inflated_bytes: int) -> bytes:
    """`inflated_bytes` of blank lines, gzipped: about a thousandth of the size."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    line = b"\n" * MIB
    return b"".join(packer.compress(line) for _ in range(inflated_bytes // MIB)) + packer.flush()


_scrapes = [0]


def _hostile_labels(ok: bytes) -> bytes:
    """The recording with a 400-digit block count and a fresh 32 KiB label value."""
    _scrapes[0] += 1
    huge = ok.replace(b'num_gpu_blocks="', b'num_gpu_blocks="' + b"9" * 400 + b"0", 1)
    fresh = b"%08d" % _scrapes[0] + b"x" * (32 * 1024)
    extra = b'vllm:num_requests_waiting{engine="0",model_name="m",trace="' + fresh + b'"} 1\n'
    return huge + extra


async def _answer(writer: asyncio.StreamWriter, mode: str, payloads: dict[str, bytes]) -> None:
    if mode in ("gzip", "gzip-bomb", "not-gzip"):  # compressed unasked, or says so falsely
        body = payloads["ok" if mode == "not-gzip" else mode]
        head = b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n"
        writer.write(head % len(body) + body)
        return
    if mode == "labels":
        body = _hostile_labels(payloads["ok"])
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        return
    if mode == "huge":
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % HUGE_BYTES)
        chunk = b"# " + b"x" * (MIB - 3) + b"\n"
        for _ in range(HUGE_BYTES // MIB):
            writer.write(chunk)
            await writer.drain()
        return
    if mode == "refused":
        return  # the mode began while this connection was accepted: close it unanswered
    body = payloads["ok" if mode == "drip" else mode]
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body))
    if mode != "drip":
        writer.write(body)
        return
    for start in range(0, len(body), 64):
        writer.write(body[start : start + 64])
        await writer.drain()
        await asyncio.sleep(0.5)


async def _serve_port(
    port: int, offset: int, rotate_s: float, started: float, modes: tuple[str, ...]
) -> None:
    payloads = _payloads()
    hostile = "labels" in modes

    def mode_now() -> str:
        return modes[(int((time.monotonic() - started) / rotate_s) + offset) % len(modes)]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await reader.readuntil(b"\r\n\r\n")
            if request.startswith(b"GET /metrics"):
                await _answer(writer, mode_now(), payloads)
            elif hostile and request.startswith(b"GET /version"):
                head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                writer.write(head + b"Content-Length: %d\r\n\r\n" % len(DEEP_JSON) + DEEP_JSON)
            else:
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()

    def until_next_mode() -> float:
        return rotate_s - (time.monotonic() - started) % rotate_s + 0.01

    server: asyncio.Server | None = None
    while True:
        refused = mode_now() == "refused"
        if refused and server is not None:
            server.close()  # connections in flight finish; new ones are refused
            server = None
        elif not refused and server is None:
            try:
                server = await asyncio.start_server(handle, "127.0.0.1", port, reuse_address=True)
            except OSError:  # taken meanwhile by someone's outgoing connection: try next turn
                server = None
        await asyncio.sleep(until_next_mode())


async def _serve_receiver(port: int, hostile: bool, record: Path) -> None:
    """Every receiver on one port, told apart by path; each request's event is recorded (a
    JSON line in `record`) as it arrives, before the answer. `/hook` fails every third
    request (hostile: by turns slow with a huge body, and a 503); `/slow` answers after
    `SLOW_RECEIVER_S`; any other path at once."""
    count = 0
    out = record.open("a", encoding="utf-8")

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal count
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(
                (
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                ),
                0,
            )
            body = await reader.readexactly(length)
            path = head.split(b" ", 2)[1].decode("ascii", "replace")
            out.write(json.dumps(_received(path.strip("/"), body, time.monotonic())) + "\n")
            out.flush()
            if path == "/slow":
                await asyncio.sleep(SLOW_RECEIVER_S)
            if path != "/hook":
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
                await writer.drain()
                return
            count += 1
            if hostile and count % 3 == 1:  # slow, then a body no agent should read
                await asyncio.sleep(SLOW_ANSWER_S)
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % HUGE_BYTES)
                chunk = b"x" * MIB
                for _ in range(HUGE_BYTES // MIB):
                    writer.write(chunk)
                    await writer.drain()
                return
            status = b"503 Service Unavailable" if count % 3 == 0 else b"200 OK"
            writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Length: 0\r\n\r\n")
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, ValueError, IndexError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


def _received(receiver: str, body: bytes, at_s: float) -> dict[str, object]:
    """What a receiver records of one webhook request (Alertmanager's payload, version 4)."""
    try:
        alert = json.loads(body)["alerts"][0]
        return {
            "receiver": receiver,
            "at_s": at_s,
            "fingerprint": str(alert["fingerprint"]),
            "incident": str(alert["annotations"].get("kvpilot_incident_id", "")),
            "status": str(alert["status"]),
            "alertname": str(alert["labels"].get("alertname", "")),
        }
    except (ValueError, LookupError, TypeError, AttributeError):
        return {"receiver": receiver, "at_s": at_s, "unreadable": body[:200].hex()}


async def _serve(
    ports: list[int], receiver_port: int, rotate_s: float, hostile: bool, record: Path
) -> None:
    started = time.monotonic()
    modes = HOSTILE_MODES if hostile else MODES
    await asyncio.gather(
        _serve_receiver(receiver_port, hostile, record),
        *(_serve_port(port, i, rotate_s, started, modes) for i, port in enumerate(ports)),
    )


# -- the agent under tracemalloc (run in a child process) --------------------------------

TRACE_FRAMES = 12


def _traced_agent(out: Path, argv: list[str]) -> None:
    """`kvpilot.agent` with tracemalloc on; each SIGUSR2 writes a snapshot into `out`."""
    import runpy

    tracemalloc.start(TRACE_FRAMES)
    taken = [0]

    def dump(_sig: int, _frame: object) -> None:
        taken[0] += 1
        tracemalloc.take_snapshot().dump(str(out / f"snapshot-{taken[0]}.trace"))
        (out / f"snapshot-{taken[0]}.done").touch()

    signal.signal(signal.SIGUSR2, dump)
    sys.argv = ["kvpilot", *argv]
    runpy.run_module("kvpilot.agent", run_name="__main__", alter_sys=True)


class Snapshots:
    """Asks the traced agent for a snapshot at the span's start and end, and prints where
    memory grew between them (tracemalloc's own accounting, by allocation site)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.taken = 0

    def take(self, pid: int) -> Path:
        self.taken += 1
        os.kill(pid, signal.SIGUSR2)
        done = self.folder / f"snapshot-{self.taken}.done"
        deadline = time.monotonic() + 120.0
        while not done.exists():
            if time.monotonic() > deadline:
                raise SystemExit("the traced agent wrote no snapshot in 120 s")
            time.sleep(0.2)
        return self.folder / f"snapshot-{self.taken}.trace"

    @staticmethod
    def report(first: Path, last: Path, top: int = 15) -> None:
        ignore = [tracemalloc.Filter(False, tracemalloc.__file__)]
        before = tracemalloc.Snapshot.load(str(first)).filter_traces(ignore)
        after = tracemalloc.Snapshot.load(str(last)).filter_traces(ignore)
        total = sum(s.size for s in after.statistics("filename")) - sum(
            s.size for s in before.statistics("filename")
        )
        print(f"tracemalloc: traced memory {total / MIB:+.2f} MiB between the snapshots")
        for stat in after.compare_to(before, "traceback")[:top]:
            print(f"  {stat.size_diff / 1024:+9.1f} KiB {stat.count_diff:+7d} blocks")
            for line in stat.traceback.format(limit=4, most_recent_first=True):
                print(f"      {line.strip()}")


# -- the measuring side ------------------------------------------------------------------


def _free_ports(count: int) -> list[int]:
    """`count` distinct free ports below the kernel's range for outgoing connections, so that
    no client takes one while its stand-in refuses connections. Drawn together: ports drawn
    one at a time at random repeat (a birthday collision, about 1 in 60 for 25 of them)."""
    ports: list[int] = []
    while len(ports) < count:
        port = _free_port()
        if port not in ports:
            ports.append(port)
    return ports


def _free_port() -> int:
    """A free port below the kernel's range for outgoing connections."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for port in random.Random().sample(range(max(1024, low - 20_000), low), 2_000):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return math.nan


def _dir_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)


def run(
    minutes: float,
    servers: int,
    rotate_s: float,
    warmup_s: float,
    hostile: bool,
    trace: bool = False,
    clock_step: bool = False,
) -> int:
    library = libfaketime()
    if clock_step and library is None:
        raise SystemExit(
            "--clock-step needs libfaketime (Debian: apt-get install faketime); looked in "
            + ", ".join(FAKETIME_LIBRARIES)
        )
    *ports, receiver, listen = _free_ports(servers + 2)
    with tempfile.TemporaryDirectory(prefix="kvpilot-soak-") as scratch:
        folder = Path(scratch)
        config = {
            "listen": {"host": "127.0.0.1", "port": listen},
            "interval_s": 1.0,
            # The scrape deadline stays under the interval, so a tick that waits on a
            # dripping server still ends before the next one is due.
            "scrape": {"timeout_s": 0.8},
            "state_dir": str(folder / "state"),
            "runtime": {
                "kind": "attach",
                "servers": [
                    {"name": f"s{i}", "url": f"http://127.0.0.1:{port}"}
                    for i, port in enumerate(ports)
                ],
            },
            "notifiers": [
                {"name": "hook", "kind": "webhook", "url": f"http://127.0.0.1:{receiver}/hook"}
            ],
        }
        receivers = HOSTILE_RECEIVERS if hostile else ("hook",)
        if hostile:
            config["notifiers"] = [
                {
                    "name": name,
                    "kind": "webhook",
                    "url": f"http://127.0.0.1:{receiver}/{name}",
                    "repeat_interval_s": REPEAT_S,
                }
                for name in receivers
            ]
        token = TokenRotation(folder / "secret", listen) if hostile else None
        if token is not None:
            config["api"] = {"token_file": str(token.path)}
        (folder / "kvpilot.yaml").write_text(yaml.safe_dump(config))
        received = folder / "received.jsonl"
        received.touch()
        argv = [
            sys.executable,
            __file__,
            "serve",
            "hostile" if hostile else "plain",
            str(receiver),
            str(rotate_s),
            str(received),
            *map(str, ports),
        ]
        stand_ins = subprocess.Popen(argv, start_new_session=True)
        log_path = folder / "agent.log"
        snapshots = Snapshots(folder) if trace else None
        launch = [__file__, "traced-agent", str(folder)] if trace else ["-m", "kvpilot.agent"]
        clock = ClockStep(folder, library) if clock_step and library is not None else None
        env = dict(os.environ)
        witnesses = None
        if hostile or clock is not None:
            env[WATCH_LOOP_ENV] = "1"
            env |= clock.env() if clock is not None else {}
            health = f"http://127.0.0.1:{listen}/healthz"
            witnesses = Witnesses(health, log_path, received, receivers, clock)
        with log_path.open("ab") as log:
            agent = subprocess.Popen(
                [sys.executable, *launch, "run", "--config", str(folder / "kvpilot.yaml")],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=folder,
                env=env,
            )
        url = f"http://127.0.0.1:{listen}/metrics"
        try:
            return _measure(
                agent,
                url,
                folder,
                minutes * 60,
                warmup_s,
                log_path,
                token,
                snapshots,
                witnesses,
            )
        finally:
            _stop(agent)
            _stop(stand_ins)


def _measure(
    agent: subprocess.Popen[bytes],
    url: str,
    folder: Path,
    span_s: float,
    warmup_s: float,
    log_path: Path,
    token: TokenRotation | None = None,
    snapshots: Snapshots | None = None,
    witnesses: Witnesses | None = None,
) -> int:
    deadline = time.monotonic() + warmup_s
    while time.monotonic() < deadline:
        if agent.poll() is not None:
            print(log_path.read_text(errors="replace")[-3000:])
            raise SystemExit(f"the agent exited during the warm-up ({agent.returncode})")
        time.sleep(1.0)
    first = httpx.get(url, timeout=10).text
    ticks0, overruns0 = (
        _metric(first, "kvpilot_ticks_total"),
        _metric(first, "kvpilot_tick_overruns_total"),
    )
    trace0 = None if snapshots is None else snapshots.take(agent.pid)
    rss0, db0 = _rss_bytes(agent.pid), _dir_bytes(folder / "state")
    peak = rss0
    started = time.monotonic()
    if witnesses is not None:
        witnesses.start(started, span_s)
    phases = Phases(url, started, span_s, windows_full_s=WINDOWS_S + 20.0 - warmup_s)
    while time.monotonic() - started < span_s:
        time.sleep(5.0)
        if agent.poll() is not None:
            raise SystemExit(f"the agent exited during the soak ({agent.returncode})")
        rss = _rss_bytes(agent.pid)
        peak = max(peak, rss)
        phases.sample(rss)
        if token is not None:
            token.maybe_rotate()
    elapsed = time.monotonic() - started
    last = httpx.get(url, timeout=10).text
    rss1 = _rss_bytes(agent.pid)
    if snapshots is not None and trace0 is not None:
        Snapshots.report(trace0, snapshots.take(agent.pid))
        print("(under tracemalloc: RSS includes the tracer's own bookkeeping)")
    ticks = _metric(last, "kvpilot_ticks_total") - ticks0
    overruns = _metric(last, "kvpilot_tick_overruns_total") - overruns0
    tracebacks = log_path.read_text(errors="replace").count("Traceback")
    db1 = _dir_bytes(folder / "state")
    growth_mib = (rss1 - rss0) / MIB
    modes = HOSTILE_MODES if token is not None else MODES
    print(f"span: {elapsed:.0f} s after a {warmup_s:.0f} s warm-up, modes {', '.join(modes)}")
    print(
        f"rss: {rss0 / MIB:.1f} MiB after warm-up, {rss1 / MIB:.1f} MiB at the end, "
        f"peak {peak / MIB:.1f} MiB, growth {growth_mib:+.2f} MiB"
    )
    print(f"ticks: {ticks:.0f} in {elapsed:.0f} s; overran their interval: {overruns:.0f}")
    print(f"tracebacks in the agent's log: {tracebacks}")
    print(f"state directory: {db0 / 1024:.0f} KiB after warm-up, {db1 / 1024:.0f} KiB at the end")
    files = sorted((folder / "state").rglob("*"))
    sizes = [f"{p.name} {p.stat().st_size / 1024:.0f} KiB" for p in files if p.is_file()]
    print("  " + ", ".join(sizes))
    goals = {
        "RSS growth after warm-up under 5 MiB": growth_mib < 5.0,
        "no tick longer than its interval": overruns == 0,
        "no tick lost (at least 90 % of the span's seconds ticked)": ticks >= 0.9 * elapsed,
        "no exception escaping into the log": tracebacks == 0,
    }
    phases.report()
    if token is not None:
        print(
            f"token rotations: {token.rotations}, checked {token.checked} (new token works, "
            f"old refused), failed checks: {token.failed}"
        )
        goals["every token rotation took effect"] = token.failed == 0 and token.checked > 0
    if witnesses is not None:
        goals |= witnesses.finish(time.monotonic())
    for goal, met in goals.items():
        print(f"goal {goal}: {'met' if met else 'NOT met'}")
    return 0


class Phases:
    """Memory and tick latency in the span's first and last minute. Tick latency here: the
    seconds between ticks (kvpilot_ticks_total read each 5 s) and the slowest source of the
    latest tick (kvpilot_collector_scrape_duration_seconds; sources are read concurrently)."""

    def __init__(self, url: str, started: float, span_s: float, windows_full_s: float) -> None:
        self.url, self.started, self.span_s = url, started, span_s
        self.windows_full_s = windows_full_s  # into the span: the agent's windows are full
        self.once_full: list[float] = []  # RSS (MiB) sampled since then
        self.rows: dict[str, list[tuple[float, float, float, float]]] = {"first": [], "last": []}
        self._prev: tuple[float, float] | None = None
        self.by_minute: dict[int, float] = {}  # the span's minute -> RSS (MiB) at its start

    def sample(self, rss: int) -> None:
        now = time.monotonic()
        self.by_minute.setdefault(int((now - self.started) // 60), rss / MIB)
        if now - self.started >= self.windows_full_s:
            self.once_full.append(rss / MIB)
        began = time.monotonic()
        text = httpx.get(self.url, timeout=10).text
        answer_s = time.monotonic() - began
        ticks = _metric(text, "kvpilot_ticks_total")
        slowest = max(
            (
                float(ln.rsplit(" ", 1)[1])
                for ln in text.splitlines()
                if ln.startswith("kvpilot_collector_scrape_duration_seconds{")
            ),
            default=math.nan,
        )
        prev, self._prev = self._prev, (now, ticks)
        if prev is None or ticks <= prev[1]:
            return
        per_tick_s = (now - prev[0]) / (ticks - prev[1])
        at = now - self.started
        row = (rss / MIB, per_tick_s, slowest, answer_s)
        if at <= 60.0:
            self.rows["first"].append(row)
        if at >= self.span_s - 60.0:
            self.rows["last"].append(row)

    def report(self) -> None:
        if len(self.once_full) >= 2:  # what a warm-up shorter than the windows cannot tell
            growth = self.once_full[-1] - self.once_full[0]
            span_min = (len(self.once_full) - 1) * 5.0 / 60
            print(f"rss once the windows are full: {growth:+.2f} MiB over {span_min:.1f} min")
        minutes = ", ".join(f"{m}: {v:.1f}" for m, v in sorted(self.by_minute.items()))
        print(f"rss by minute of the span (MiB): {minutes}")
        for phase, rows in self.rows.items():
            if not rows:
                continue
            rss = [r[0] for r in rows]
            print(
                f"{phase} minute: rss {min(rss):.1f}..{max(rss):.1f} MiB, seconds per tick "
                f"{statistics.fmean(r[1] for r in rows):.3f}, slowest source "
                f"{max(r[2] for r in rows):.3f} s, /metrics answered in "
                f"{max(r[3] for r in rows) * 1e3:.0f} ms at most ({len(rows)} samples)"
            )


class TokenRotation:
    """The control API's token file, rotated every 10 s as a Kubernetes Secret is (a new
    folder, then the `..data` link flipped); each rotation is checked on the live API."""

    EVERY_S = 10.0

    def __init__(self, folder: Path, port: int) -> None:
        folder.mkdir()
        self.folder, self.port = folder, port
        self.path = folder / "token"
        self.rotations = self.checked = self.failed = 0
        self.current = self._mount()
        self.path.symlink_to("..data/token")
        self._last = time.monotonic()

    def _mount(self) -> str:
        token = os.urandom(16).hex()
        version = self.folder / f"..v{self.rotations}"
        version.mkdir()
        (version / "token").write_text(token + "\n")
        link = self.folder / "..data_tmp"
        link.symlink_to(version.name)
        link.replace(self.folder / "..data")
        return token

    def _status(self, token: str) -> int:
        url = f"http://127.0.0.1:{self.port}/api/v1/silences"
        headers = {"Authorization": f"Bearer {token}"}
        return httpx.post(url, content=b"{}", headers=headers, timeout=10).status_code

    def maybe_rotate(self) -> None:
        if time.monotonic() - self._last < self.EVERY_S:
            return
        self._last = time.monotonic()
        old = self.current
        self.rotations += 1
        self.current = self._mount()
        self.checked += 1
        if not (self._status(self.current) == 422 and self._status(old) == 401):
            self.failed += 1


# -- the clock step, /healthz and what the agent and the receivers recorded ---------------


def libfaketime() -> Path | None:
    """libfaketime's preload library where Debian's `faketime` package puts it, if installed."""
    return next((Path(p) for p in FAKETIME_LIBRARIES if Path(p).exists()), None)


class ClockStep:
    """The agent's wall clock, through libfaketime preloaded into the agent alone: an hour
    back a third into the span, forward again at two thirds. The monotonic clock is left
    alone (FAKETIME_DONT_FAKE_MONOTONIC); the offset file is read at every call
    (FAKETIME_NO_CACHE), so a step takes effect at once."""

    def __init__(self, folder: Path, library: Path) -> None:
        self.path = folder / "faketime.rc"
        self.library = library
        self.steps: list[tuple[float, int]] = []  # (monotonic s, offset s) as written
        self._write(0)

    def env(self) -> dict[str, str]:
        return {
            "LD_PRELOAD": str(self.library),
            "FAKETIME_DONT_FAKE_MONOTONIC": "1",
            "FAKETIME_TIMESTAMP_FILE": str(self.path),
            "FAKETIME_NO_CACHE": "1",
        }

    def start(self, started_s: float, span_s: float) -> None:
        plan = [(started_s + span_s / 3, -STEP_S), (started_s + 2 * span_s / 3, 0)]
        threading.Thread(target=self._run, args=(plan,), name="clock-step", daemon=True).start()

    def _run(self, plan: list[tuple[float, int]]) -> None:
        for at_s, offset_s in plan:
            time.sleep(max(0.0, at_s - time.monotonic()))
            self._write(offset_s)
            self.steps.append((time.monotonic(), offset_s))

    def _write(self, offset_s: int) -> None:
        """Written whole, then renamed: libfaketime never reads half a file."""
        draft = self.path.with_suffix(".draft")
        draft.write_text(f"{offset_s:+d}\n")
        draft.replace(self.path)


@dataclass(frozen=True, slots=True)
class HealthSample:
    at_s: float  # monotonic, when the request began
    latency_s: float
    status: int  # 0: no answer (refused, timed out)
    clock_offset_s: float | None  # the agent's Date header less this machine's wall clock


class HealthProbe:
    """`/healthz` every `HEALTH_EVERY_S` on a fixed grid, from a thread of its own."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.samples: list[HealthSample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="healthz", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        with httpx.Client(timeout=5.0) as client:
            due_s = time.monotonic()
            while not self._stop.is_set():
                self.samples.append(self._one(client))
                due_s += HEALTH_EVERY_S
                self._stop.wait(max(0.0, due_s - time.monotonic()))

    def _one(self, client: httpx.Client) -> HealthSample:
        began = time.monotonic()
        try:
            answer = client.get(self.url)
        except httpx.HTTPError:
            return HealthSample(began, time.monotonic() - began, 0, None)
        latency_s = time.monotonic() - began
        offset = None
        if "date" in answer.headers:
            offset = parsedate_to_datetime(answer.headers["date"]).timestamp() - time.time()
        return HealthSample(began, latency_s, answer.status_code, offset)


@dataclass(frozen=True, slots=True)
class SlowCallback:
    took_s: float
    what: str
    cpu_s: float | None = None  # the loop thread's CPU time in it (the agent's own measure)
    at_s: float | None = None  # monotonic, when it began


def _log_entries(text: str) -> Iterable[dict[str, object]]:
    """The agent's JSON log lines (anything else on its stderr is skipped)."""
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if isinstance(entry, dict):
                yield entry


def tick_starts(log_text: str) -> list[float]:
    """The monotonic time of each tick start the agent logged (`loop_watch`'s line)."""
    return [
        float(str(e["monotonic_s"]))
        for e in _log_entries(log_text)
        if e.get("message") == "tick started" and "monotonic_s" in e
    ]


_SLOW = re.compile(r"^Executing (?P<what>.*) took (?P<took>[0-9.]+) seconds$", re.DOTALL)


def slow_callbacks(log_text: str) -> list[SlowCallback]:
    """asyncio debug mode's warnings: a callback that held the loop past its threshold."""
    found = []
    for entry in _log_entries(log_text):
        match = _SLOW.match(str(entry.get("message", "")))
        if entry.get("logger") == "asyncio" and match:
            found.append(SlowCallback(float(match["took"]), match["what"]))
    return found


def cpu_slow_callbacks(log_text: str) -> list[SlowCallback]:
    """The agent's own measure (`loop_watch`): callbacks over 100 ms of the loop thread's CPU,
    which a machine too busy to run the agent cannot fake."""
    return [
        SlowCallback(
            float(str(e["wall_s"])),
            str(e.get("callback", "")),
            float(str(e["cpu_s"])),
            float(str(e["monotonic_s"])),
        )
        for e in _log_entries(log_text)
        if str(e.get("message", "")).startswith("a callback held the loop") and "cpu_s" in e
    ]


def slow_collections(log_text: str) -> list[tuple[float, float]]:
    """(seconds, seconds of CPU) of each garbage collection over 50 ms the agent said."""
    return [
        (float(str(e["took_s"])), float(str(e.get("cpu_s", "nan"))))
        for e in _log_entries(log_text)
        if str(e.get("message", "")).startswith("a garbage collection") and "took_s" in e
    ]


def largest_gap(starts: Sequence[float], begin_s: float, end_s: float) -> float:
    """The longest time in [begin_s, end_s] with no tick start: between two starts, or from
    the last start to `end_s` (ticks that stopped count until the window ends)."""
    inside = sorted(t for t in starts if begin_s <= t <= end_s)
    before = [t for t in starts if t < begin_s]
    points = [max(before)] if before else [begin_s]
    points += [*inside, end_s]
    return max(b - a for a, b in itertools.pairwise(points))


@dataclass(frozen=True, slots=True)
class Received:
    receiver: str
    fingerprint: str
    incident: str
    status: str
    at_s: float

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.fingerprint, self.incident, self.status)


def read_received(path: Path) -> tuple[list[Received], int]:
    """The receivers' record in arrival order, and how many requests were unreadable."""
    got, unreadable = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        entry = json.loads(line)
        if "unreadable" in entry:
            unreadable += 1
            continue
        got.append(
            Received(
                entry["receiver"],
                entry["fingerprint"],
                entry["incident"],
                entry["status"],
                float(entry["at_s"]),
            )
        )
    return got, unreadable


def order_faults(received: Sequence[Received]) -> list[str]:
    """What arrived out of order, per receiver and alert (fingerprint): a resolved with no
    firing of its incident before it, a firing after its incident's resolved, a new incident
    before the last one's resolved, an incident back after the next began. Re-sends of the
    same event (at-least-once) are in order."""
    faults: list[str] = []
    current: dict[tuple[str, str], tuple[str, bool]] = {}  # -> (incident, resolved yet)
    left: dict[tuple[str, str], set[str]] = {}
    for event in received:
        alert = (event.receiver, event.fingerprint)
        where = f"{event.receiver}, alert {event.fingerprint}, incident {event.incident}"
        incident, resolved = current.get(alert, ("", True))
        if event.incident in left.get(alert, set()):
            faults.append(f"{where}: {event.status} after a later incident began")
            continue
        if event.incident != incident:
            if incident:
                left.setdefault(alert, set()).add(incident)
                if not resolved:
                    faults.append(f"{where}: began before incident {incident} resolved")
            if event.status == "resolved":
                faults.append(f"{where}: resolved before any firing")
            current[alert] = (event.incident, event.status == "resolved")
            continue
        if event.status == "firing" and resolved:
            faults.append(f"{where}: firing after its resolved")
        current[alert] = (incident, resolved or event.status == "resolved")
    return faults


def missing(
    received: Sequence[Received], receivers: Sequence[str], before_s: float
) -> dict[str, int]:
    """Per receiver, the events (alert, incident, status) that some receiver had got by
    `before_s` and this one never got."""
    owed = {e.key for e in received if e.at_s <= before_s}
    got: dict[str, set[tuple[str, str, str]]] = {r: set() for r in receivers}
    for event in received:
        got.setdefault(event.receiver, set()).add(event.key)
    return {r: len(owed - got[r]) for r in receivers}


class Witnesses:
    """What the hostile and clock-step runs add to the soak's measures: the clock step,
    /healthz, the tick starts and slow callbacks from the agent's log, and what every
    receiver got. `finish` prints the table and returns its goals."""

    PHASES = ("before the step", f"{STEP_S} s back", "forward again")

    def __init__(
        self,
        health_url: str,
        log_path: Path,
        received_path: Path,
        receivers: Sequence[str],
        clock: ClockStep | None,
    ) -> None:
        self.health = HealthProbe(health_url)
        self.log_path, self.received_path = log_path, received_path
        self.receivers, self.clock = tuple(receivers), clock
        self.started_s = self.span_s = 0.0

    def start(self, started_s: float, span_s: float) -> None:
        self.started_s, self.span_s = started_s, span_s
        self.health.start()
        if self.clock is not None:
            self.clock.start(started_s, span_s)

    def _phases(self, end_s: float) -> list[tuple[str, float, float]]:
        if self.clock is None:
            return [("span", self.started_s, end_s)]
        edges = [self.started_s, *(at for at, _ in self.clock.steps), end_s]
        return list(zip(self.PHASES, edges, edges[1:], strict=False))

    def finish(self, end_s: float) -> dict[str, bool]:
        self.health.stop()
        log_text = self.log_path.read_text(errors="replace")
        starts = tick_starts(log_text)
        slow = slow_callbacks(log_text)
        on_cpu = cpu_slow_callbacks(log_text)
        goals: dict[str, bool] = {}
        if self.clock is not None:
            steps = ", ".join(
                f"{off:+d} s at {at - self.started_s:.0f} s" for at, off in self.clock.steps
            )
            print(f"agent wall-clock steps (into the span): {steps or 'none made'}")
            goals["the agent's wall clock stepped back and forward"] = len(self.clock.steps) == 2
        print(
            f"{'phase':<16} {'span s':>6} {'ticks':>5} {'max gap s':>9} {'healthz worst ms':>16} "
            f"{'non-200':>7} {'agent clock offset s':>20} {'callbacks >100ms CPU':>20}"
        )
        worst_gap = worst_health = 0.0
        bad_health = 0
        for name, begin_s, finish_s in self._phases(end_s):
            gap = largest_gap(starts, begin_s, finish_s)
            ticks = sum(1 for t in starts if begin_s <= t < finish_s)
            seen = [h for h in self.health.samples if begin_s <= h.at_s < finish_s]
            worst = max((h.latency_s for h in seen), default=math.nan)
            non_200 = sum(1 for h in seen if h.status != 200)
            offsets = [h.clock_offset_s for h in seen if h.clock_offset_s is not None]
            # The Date header has whole seconds and is refreshed once a second: the median.
            shown = f"{statistics.median(offsets):+.0f}" if offsets else "?"
            held = sum(1 for c in on_cpu if c.at_s is not None and begin_s <= c.at_s < finish_s)
            print(
                f"{name:<16} {finish_s - begin_s:>6.0f} {ticks:>5} {gap:>9.3f} "
                f"{worst * 1e3:>16.0f} {non_200:>7} {shown:>20} {held:>20}"
            )
            worst_gap, bad_health = max(worst_gap, gap), bad_health + non_200
            worst_health = max(worst_health, worst if seen else math.inf)
        print(f"/healthz polled {len(self.health.samples)} times every {HEALTH_EVERY_S} s")
        long_gaps = [
            f"{b - a:.3f} s at {b - self.started_s:.0f} s"
            for a, b in itertools.pairwise(starts)
            if b >= self.started_s and b - a > 1.5
        ]
        print(f"gaps between tick starts over 1.5 s: {', '.join(long_gaps) or 'none'}")
        print(
            f"callbacks over 100 ms of wall time (asyncio debug mode, whole run): {len(slow)}"
            + (f", longest {max(c.took_s for c in slow):.3f} s" if slow else "")
        )
        for callback in sorted(slow, key=lambda c: -c.took_s)[:3]:
            print(f"  {callback.took_s:.3f} s  {callback.what[:150]}")
        print(f"callbacks over 100 ms of the loop thread's CPU (whole run): {len(on_cpu)}")
        for callback in sorted(on_cpu, key=lambda c: -(c.cpu_s or 0.0))[:5]:
            print(
                f"  {callback.cpu_s or 0.0:.3f} s CPU ({callback.took_s:.3f} s wall)  "
                f"{callback.what[:150]}"
            )
        collections = slow_collections(log_text)
        if collections:
            print(
                f"garbage collections over 50 ms of wall time: {len(collections)}, longest "
                f"{max(took for took, _ in collections):.3f} s, most CPU "
                f"{max(cpu for _, cpu in collections):.3f} s"
            )
        print(f"load average at the end: {Path('/proc/loadavg').read_text().split()[:3]}")
        goals[f"no gap between tick starts over {TICK_GAP_GOAL_S:.0f} s"] = (
            bool(starts) and worst_gap <= TICK_GAP_GOAL_S
        )
        goals[f"/healthz 200 within {HEALTH_GOAL_S:.0f} s throughout"] = (
            bad_health == 0 and worst_health <= HEALTH_GOAL_S
        )
        # Judged on CPU time: the wall-clock count above includes the kernel's preemptions on
        # a busy machine, which no code of the agent's can avoid.
        goals["no callback holding the loop over 100 ms (of CPU)"] = not on_cpu
        goals |= self._deliveries(end_s)
        return goals

    def _deliveries(self, end_s: float) -> dict[str, bool]:
        received, unreadable = read_received(self.received_path)
        faults = order_faults(received)
        lacking = missing(received, self.receivers, end_s - CATCH_UP_S)
        for receiver in self.receivers:
            mine = [e for e in received if e.receiver == receiver]
            print(
                f"receiver {receiver}: {len(mine)} requests, {len({e.key for e in mine})} "
                f"distinct events, {len({e.fingerprint for e in mine})} alerts, "
                f"{len({e.incident for e in mine})} incidents, "
                f"{sum(1 for f in faults if f.startswith(receiver + ','))} out of order, "
                f"{lacking[receiver]} missing (had elsewhere {CATCH_UP_S:.0f} s before the end)"
            )
        for fault in faults[:10]:
            print(f"  out of order: {fault}")
        if unreadable:
            print(f"  unreadable requests: {unreadable}")
        return {
            "every receiver's events in order per alert": not faults and bool(received),
            "every receiver got every event": not any(lacking.values()),
        }


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "traced-agent":
        _traced_agent(Path(sys.argv[2]), sys.argv[3:])
        return
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        mix, receiver, rotate_s, record, *ports = sys.argv[2:]
        asyncio.run(
            _serve(
                [int(p) for p in ports],
                int(receiver),
                float(rotate_s),
                mix == "hostile",
                Path(record),
            )
        )
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--servers", type=int, default=len(MODES))
    parser.add_argument("--rotate-s", type=float, default=20.0)
    # The windows keep 600 s of samples: growth is measured once they are full.
    parser.add_argument("--warmup-s", type=float, default=620.0)
    parser.add_argument("--quick", action="store_true", help="45 s, rotating every 3 s")
    parser.add_argument(
        "--hostile", action="store_true", help="add huge labels, bad receivers, token rotation"
    )
    parser.add_argument(
        "--clock-step",
        action="store_true",
        help="step the agent's wall clock (libfaketime) an hour back, then forward",
    )
    parser.add_argument(
        "--tracemalloc",
        action="store_true",
        help="run the agent under tracemalloc and print where memory grew over the span",
    )
    args = parser.parse_args()
    if args.quick:
        args.minutes, args.rotate_s, args.warmup_s = 0.6, 3.0, 8.0
    if args.hostile and args.servers == len(MODES):
        args.servers = len(HOSTILE_MODES)
    raise SystemExit(
        run(
            args.minutes,
            args.servers,
            args.rotate_s,
            args.warmup_s,
            args.hostile,
            args.tracemalloc,
            args.clock_step,
        )
    )


if __name__ == "__main__":
    main()
