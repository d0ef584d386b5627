"""Soak: one `kvpilot run` at 1 Hz against servers that flap in rotation, for half an hour.

    .venv/bin/python benchmarks/soak.py                  # 30 minutes, 7 servers
    .venv/bin/python benchmarks/soak.py --quick          # 45 s, every mode seen at least once
    .venv/bin/python benchmarks/soak.py --minutes 10 --rotate-s 15

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

The agent watches them through the `attach` runtime (its servers are known by URL), with a
webhook notifier pointed at a receiver in the same helper that fails every third request.
It measures, after a warm-up: RSS growth (VmRSS of the agent, sampled every 5 s; goal under
5 MiB), ticks that overran their interval (`kvpilot_tick_overruns_total`; the scrape
deadline is 0.8 s, so a tick within its deadline never overruns; goal none), the
ticks completed against the span (none lost), exceptions in the agent's log (lines with a
traceback; goal none), and the state directory's size (bounded by retention: it may grow
with the audit trail of alerts, never with the scrapes).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "vllm"
MODES = ("ok", "restart", "garbage", "drip", "huge", "refused", "nan")
HUGE_BYTES = 64 << 20
MIB = 1 << 20


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


async def _answer(writer: asyncio.StreamWriter, mode: str, payloads: dict[str, bytes]) -> None:
    if mode == "huge":
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % HUGE_BYTES)
        chunk = b"# " + b"x" * (MIB - 3) + b"\n"
        for _ in range(HUGE_BYTES // MIB):
            writer.write(chunk)
            await writer.drain()
        return
    body = payloads["ok" if mode == "drip" else mode]
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body))
    if mode != "drip":
        writer.write(body)
        return
    for start in range(0, len(body), 64):
        writer.write(body[start : start + 64])
        await writer.drain()
        await asyncio.sleep(0.5)


async def _serve_port(port: int, offset: int, rotate_s: float, started: float) -> None:
    payloads = _payloads()

    def mode_now() -> str:
        return MODES[(int((time.monotonic() - started) / rotate_s) + offset) % len(MODES)]

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


async def _serve_receiver(port: int) -> None:
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


async def _serve(ports: list[int], receiver_port: int, rotate_s: float) -> None:
    started = time.monotonic()
    await asyncio.gather(
        _serve_receiver(receiver_port),
        *(_serve_port(port, i, rotate_s, started) for i, port in enumerate(ports)),
    )


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


def run(minutes: float, servers: int, rotate_s: float, warmup_s: float) -> int:
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
        (folder / "kvpilot.yaml").write_text(yaml.safe_dump(config))
        argv = [sys.executable, __file__, "serve", str(receiver), str(rotate_s), *map(str, ports)]
        stand_ins = subprocess.Popen(argv, start_new_session=True)
        log_path = folder / "agent.log"
        with log_path.open("ab") as log:
            agent = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "kvpilot.agent",
                    "run",
                    "--config",
                    str(folder / "kvpilot.yaml"),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=folder,
            )
        url = f"http://127.0.0.1:{listen}/metrics"
        try:
            return _measure(agent, url, folder, minutes * 60, warmup_s, log_path)
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
    rss0, db0 = _rss_bytes(agent.pid), _dir_bytes(folder / "state")
    peak = rss0
    started = time.monotonic()
    while time.monotonic() - started < span_s:
        time.sleep(5.0)
        if agent.poll() is not None:
            raise SystemExit(f"the agent exited during the soak ({agent.returncode})")
        peak = max(peak, _rss_bytes(agent.pid))
    elapsed = time.monotonic() - started
    last = httpx.get(url, timeout=10).text
    rss1 = _rss_bytes(agent.pid)
    ticks = _metric(last, "kvpilot_ticks_total") - ticks0
    overruns = _metric(last, "kvpilot_tick_overruns_total") - overruns0
    tracebacks = log_path.read_text(errors="replace").count("Traceback")
    db1 = _dir_bytes(folder / "state")
    growth_mib = (rss1 - rss0) / MIB
    print(f"span: {elapsed:.0f} s after a {warmup_s:.0f} s warm-up, modes {', '.join(MODES)}")
    print(
        f"rss: {rss0 / MIB:.1f} MiB after warm-up, {rss1 / MIB:.1f} MiB at the end, "
        f"peak {peak / MIB:.1f} MiB, growth {growth_mib:+.2f} MiB"
    )
    print(f"ticks: {ticks:.0f} in {elapsed:.0f} s; overran their interval: {overruns:.0f}")
    print(f"tracebacks in the agent's log: {tracebacks}")
    print(f"state directory: {db0 / 1024:.0f} KiB after warm-up, {db1 / 1024:.0f} KiB at the end")
    goals = {
        "RSS growth after warm-up under 5 MiB": growth_mib < 5.0,
        "no tick longer than its interval": overruns == 0,
        "no tick lost (at least 90 % of the span's seconds ticked)": ticks >= 0.9 * elapsed,
        "no exception escaping into the log": tracebacks == 0,
    }
    for goal, met in goals.items():
        print(f"goal {goal}: {'met' if met else 'NOT met'}")
    return 0


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        receiver, rotate_s, *ports = sys.argv[2:]
        asyncio.run(_serve([int(p) for p in ports], int(receiver), float(rotate_s)))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--servers", type=int, default=len(MODES))
    parser.add_argument("--rotate-s", type=float, default=20.0)
    # The windows keep 600 s of samples: growth is measured once they are full.
    parser.add_argument("--warmup-s", type=float, default=620.0)
    parser.add_argument("--quick", action="store_true", help="45 s, rotating every 3 s")
    args = parser.parse_args()
    if args.quick:
        args.minutes, args.rotate_s, args.warmup_s = 0.6, 3.0, 8.0
    raise SystemExit(run(args.minutes, args.servers, args.rotate_s, args.warmup_s))


if __name__ == "__main__":
    main()
