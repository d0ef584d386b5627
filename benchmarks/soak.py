"""Soak: one `kvpilot run` at 1 Hz against servers that flap in rotation, for half an hour.

    .venv/bin/python benchmarks/soak.py                  # 30 minutes, 7 servers
    .venv/bin/python benchmarks/soak.py --quick          # 45 s, every mode seen at least once
    .venv/bin/python benchmarks/soak.py --minutes 10 --rotate-s 15
    .venv/bin/python benchmarks/soak.py --hostile --minutes 5 --warmup-s 30

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
prints memory and tick latency for the first and the last minute of the span.

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
import math
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "vllm"
MODES = ("ok", "restart", "garbage", "drip", "huge", "refused", "nan")
HOSTILE_MODES = (*MODES, "labels")
SLOW_ANSWER_S = 5.0
HUGE_BYTES = 64 << 20
MIB = 1 << 20
WINDOWS_S = 600.0  # the agent's rolling windows keep this much: memory grows until they fill


# -- the stand-ins (run in a child process) ---------------------------------------------


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
    }


_scrapes = [0]


def _hostile_labels(ok: bytes) -> bytes:
    """The recording with a 400-digit block count and a fresh 32 KiB label value."""
    _scrapes[0] += 1
    huge = ok.replace(b'num_gpu_blocks="', b'num_gpu_blocks="' + b"9" * 400 + b"0", 1)
    fresh = b"%08d" % _scrapes[0] + b"x" * (32 * 1024)
    extra = b'vllm:num_requests_waiting{engine="0",model_name="m",trace="' + fresh + b'"} 1\n'
    return huge + extra


async def _answer(writer: asyncio.StreamWriter, mode: str, payloads: dict[str, bytes]) -> None:
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

    def mode_now() -> str:
        return modes[(int((time.monotonic() - started) / rotate_s) + offset) % len(modes)]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await reader.readuntil(b"\r\n\r\n")
            if request.startswith(b"GET /metrics"):
                await _answer(writer, mode_now(), payloads)
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


async def _serve_receiver(port: int, hostile: bool) -> None:
    count = 0

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
            await reader.readexactly(length)
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
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


async def _serve(ports: list[int], receiver_port: int, rotate_s: float, hostile: bool) -> None:
    started = time.monotonic()
    modes = HOSTILE_MODES if hostile else MODES
    await asyncio.gather(
        _serve_receiver(receiver_port, hostile),
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
) -> int:
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
        token = TokenRotation(folder / "secret", listen) if hostile else None
        if token is not None:
            config["api"] = {"token_file": str(token.path)}
        (folder / "kvpilot.yaml").write_text(yaml.safe_dump(config))
        argv = [
            sys.executable,
            __file__,
            "serve",
            "hostile" if hostile else "plain",
            str(receiver),
            str(rotate_s),
            *map(str, ports),
        ]
        stand_ins = subprocess.Popen(argv, start_new_session=True)
        log_path = folder / "agent.log"
        snapshots = Snapshots(folder) if trace else None
        launch = [__file__, "traced-agent", str(folder)] if trace else ["-m", "kvpilot.agent"]
        with log_path.open("ab") as log:
            agent = subprocess.Popen(
                [sys.executable, *launch, "run", "--config", str(folder / "kvpilot.yaml")],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=folder,
            )
        url = f"http://127.0.0.1:{listen}/metrics"
        try:
            return _measure(agent, url, folder, minutes * 60, warmup_s, log_path, token, snapshots)
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


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "traced-agent":
        _traced_agent(Path(sys.argv[2]), sys.argv[3:])
        return
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        mix, receiver, rotate_s, *ports = sys.argv[2:]
        asyncio.run(
            _serve([int(p) for p in ports], int(receiver), float(rotate_s), mix == "hostile")
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
        )
    )


if __name__ == "__main__":
    main()
