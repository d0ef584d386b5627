"""What the agent costs the machine it runs on: CPU time and resident memory of the whole
`kvpilot run` process (scheduler, HTTP server, collectors; rules too under a configuration)
watching 1, 8 and 32 servers, for a baseline commit and the current tree, in the same run.

    .venv/bin/python benchmarks/agent_footprint.py                    # 1, 8, 32 servers, 60 s
    .venv/bin/python benchmarks/agent_footprint.py --quick            # 1, 2 servers, 4 s
    .venv/bin/python benchmarks/agent_footprint.py --servers 1,8 --span 120 --baseline REV
    .venv/bin/python benchmarks/agent_footprint.py --baseline REV --baseline-attach

The servers are stand-ins. One helper process (its CPU is not counted) serves on loopback,
per server, one port with the recorded `tests/fixtures/vllm/v0_32_under_load.prom` as
`/metrics` (gzipped when the client accepts it, as vLLM's prometheus_client does), `/health`
and `/version`, and one port with a kvpool payload made by the plugin's own exposition code
(`collectors/kvpool/server.py`) from that recording's figures plus the allocator fixtures,
on any path, as the plugin's server does. Connections are kept alive. Every server
serves the same bytes: N replicas of one model (in one process, the parser's caches of
line heads serve them all; servers of different models would not share them). The moment
is frozen: counters never advance, so rates are zero and the stall rule sees a stalled,
loaded engine (its worst case: it walks the whole window every tick).

The baseline is REV (default 2494667) checked out in a temporary `git worktree`. It
watched one server per `kvpilot run --vllm-url URL --kvpool-url URL` process, so N servers
cost N processes, whose CPU and RSS are summed. The candidate is the current tree: one
process watching the N servers from a YAML configuration with the attach runtime; when
`kvpilot config check` refuses that configuration the candidate falls back to N processes
too, and says so. At one server the candidate's `kvpilot run --vllm-url` is measured as
well. Each tree runs from an import root of symlinks (`kvpilot/` -> the tree's folders), so
the installed package never matters, under this same Python. With `--baseline-attach` the
baseline runs as the candidate does (one process, the attach runtime) wherever its tree's
`kvpilot config check` accepts that configuration: the same work by two versions, for a ratio
that shows what a change saved.

One run: start the agents, wait until each has ticked WARMUP times, read the CPU time of
the agents and their children (utime + stime + cutime + cstime in /proc/PID/stat), wait the
span, read it again. RSS is the peak, over once-a-second samples during the span, of the
summed VmRSS. Every agent's `kvpilot_ticks_total` must have advanced by about the span and
every server's vllm and kvpool sources must be up at the end: otherwise the run is an
error, not a figure. Fairness: one run at a time; each round runs baseline then candidate,
the next candidate then baseline (A B, B A, ...), and the figures are means over rounds.

The agent keeps 600 s of scrapes per server: after the default warm-up the windows are
part-filled, and both RSS and the rules' walks over them still grow. `--warmup 610`
measures the steady state.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import random
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("agent", "collectors", "tuner", "dashboards", "rig")
VLLM_PAYLOAD = ROOT / "tests" / "fixtures" / "vllm" / "v0_32_under_load.prom"
ALLOCATOR_FIXTURES = ROOT / "tests" / "fixtures" / "allocator"
DEFAULT_BASELINE = "2494667"
INTERVAL_S = 1.0
MIB = 1 << 20
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
# Where this started: one server, `kvpilot run --vllm-url`, 1 Hz.
START_CPU_PERCENT, START_RSS_MIB = 0.75, 64.7
# The goals: (servers, CPU % of one core, RSS MiB), and how far CPU per server may grow.
GOALS = ((1, 0.25, 80.0), (32, 2.0, 150.0))
LINEAR_SLACK = 1.25
BASELINE, CANDIDATE, CANDIDATE_CLI = "baseline", "candidate", "candidate --vllm-url"


class BenchError(Exception):
    """A failure, reported in one line: the run gives no figure."""


# The stand-in servers (the helper process).


def kvpool_payload() -> bytes:
    """The plugin's exposition at the recording's moment: 1023 usable blocks of 32 tokens,
    5 free, 33 running requests, 17 preemptions; plus one GPU's allocator from the fixtures."""
    from prometheus_client import CollectorRegistry, generate_latest

    from kvpilot.collectors.fragmentation import kv_blocks_fragmentation
    from kvpilot.collectors.kvpool.allocator import allocator_stats_from
    from kvpilot.collectors.kvpool.blocks import (
        BlockCounts,
        BlockPoolSnapshot,
        InternalFragmentation,
    )
    from kvpilot.collectors.kvpool.server import (
        AllocatorReading,
        EngineReading,
        KvPoolCollector,
        PartErrors,
    )

    wall_s = time.time()
    counts = BlockCounts(
        blocks_total=1023,
        blocks_free=5,
        blocks_free_cached=3,
        blocks_empty=2,
        longest_free_run_blocks=2,
        fragmentation=kv_blocks_fragmentation(5, 2, 1023),
    )
    internal = InternalFragmentation(
        running_requests=33,
        reserved_slots=32576,
        unused_slots=512,
        ratio=512 / 32576,
        reason=None,
    )
    engine = EngineReading(
        engine="0",
        model_name="rig/models/tiny-llama",
        snapshot=BlockPoolSnapshot(0.0, wall_s, 32, counts, internal),
        preemptions_total=17,
        last_preemption_wall_s=wall_s - 1.0,
        scheduler_steps_total=10014,
    )
    stats = allocator_stats_from(
        0,
        json.loads((ALLOCATOR_FIXTURES / "memory_stats_device0.json").read_text()),
        json.loads((ALLOCATOR_FIXTURES / "memory_snapshot.json").read_text()),
        taken_at_s=0.0,
        wall_time_s=wall_s,
    )
    registry = CollectorRegistry(auto_describe=False)
    registry.register(
        KvPoolCollector(
            engines=lambda: [engine],
            allocators=lambda: [AllocatorReading(rank="0", stats=stats)],
            errors=PartErrors(),
            clock=lambda: 0.25,
        )
    )
    return generate_latest(registry)


def _serve(body: bytes, *, vllm: bool) -> int:
    """Serve `body` on a loopback port from daemon threads; vLLM's port also answers
    /health and /version, the plugin's port serves `body` on any path. Returns the port."""
    zipped = gzip.compress(body)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as both real servers do

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            status, data, content_type = 200, body, "text/plain; version=0.0.4; charset=utf-8"
            if vllm and path == "/health":
                data = b""
            elif vllm and path == "/version":
                data, content_type = b'{"version": "0.32.0"}', "application/json"
            elif vllm and path != "/metrics":
                status, data = 404, b"not found"
            gzipped = data is body and "gzip" in self.headers.get("Accept-Encoding", "")
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            if gzipped:
                data = zipped
                self.send_header("Content-Encoding", "gzip")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return int(server.server_address[1])


def serve_payloads(count: int) -> None:
    """The helper: `count` stand-in servers; prints their ports as one JSON line, then
    serves until its stdin closes (the benchmark stopped or died)."""
    vllm, kvpool = VLLM_PAYLOAD.read_bytes(), kvpool_payload()
    ports = {
        "vllm": [_serve(vllm, vllm=True) for _ in range(count)],
        "kvpool": [_serve(kvpool, vllm=False) for _ in range(count)],
    }
    print(json.dumps(ports), flush=True)
    sys.stdin.read()


# Processes, trees and /proc.


def _start(argv: list[str], log: Path, env: dict[str, str], **kwargs) -> subprocess.Popen:
    with log.open("ab") as out:
        return subprocess.Popen(
            argv,
            stdout=kwargs.pop("stdout", out),
            stderr=out,
            env=env,
            cwd=log.parent,
            start_new_session=True,
            **kwargs,
        )


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM to the process group, SIGKILL after 15 s; a no-op once it has been waited."""
    if process.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    for stream in (process.stdin, process.stdout):
        if stream is not None:
            stream.close()


def _tail(log: Path, lines: int = 8) -> str:
    try:
        text = log.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no log)"
    cut = [line if len(line) <= 300 else line[:300] + "..." for line in text[-lines:]]
    return "\n".join(f"    {line}" for line in cut) or "    (empty log)"


def _git(*args: str) -> str:
    try:
        result = subprocess.run(
            ["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=False
        )
    except OSError as exc:
        raise BenchError(f"cannot run git: {exc}") from None
    if result.returncode != 0:
        raise BenchError(f"git {' '.join(args)}: {result.stderr.strip() or 'failed'}")
    return result.stdout.strip()


@contextlib.contextmanager
def worktree(rev: str, where: Path) -> Iterator[str]:
    """REV checked out at `where` (detached) for the duration; yields its short hash."""
    try:
        sha = _git("rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    except BenchError:
        raise BenchError(f"--baseline {rev}: no such commit in {ROOT}") from None
    _git("worktree", "add", "--detach", "--quiet", str(where), sha)
    try:
        yield sha[:7]
    finally:
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(where)],
            capture_output=True,
            check=False,
        )
        subprocess.run(["git", "-C", str(ROOT), "worktree", "prune"], check=False)


def import_root(tree: Path, where: Path) -> Path:
    """A folder where `kvpilot.*` resolves to `tree`'s folders (PYTHONPATH for its agents)."""
    package = where / "kvpilot"
    package.mkdir(parents=True)
    (package / "__init__.py").symlink_to(tree / "kvpilot_ns" / "__init__.py")
    for name in PACKAGES:
        if (tree / name).is_dir():
            (package / name).symlink_to(tree / name)
    return where


def _env(root: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPILOT_")}
    env["PYTHONPATH"] = str(root)
    return env


def _stat(pid: int) -> list[str]:
    """/proc/PID/stat's fields after the command name (field 3, state, is index 0)."""
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rindex(")") + 2 :].split()


def _tree(pids: list[int]) -> list[int]:
    """The processes and all their descendants that are still alive."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                children.setdefault(int(_stat(int(entry.name))[1]), []).append(int(entry.name))
    found, todo = [], list(pids)
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, ()))
    return found


def cpu_seconds(pids: list[int]) -> float:
    """User and system CPU of the processes, their live descendants and reaped children."""
    total = 0
    for pid in _tree(pids):
        with contextlib.suppress(OSError):
            fields = _stat(pid)
            total += sum(int(v) for v in fields[11:15])  # utime stime cutime cstime
    return total / CLOCK_TICKS


def rss_bytes(pids: list[int]) -> int:
    total = 0
    for pid in _tree(pids):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
    return total


_GIVEN_PORTS: set[int] = set()


def _free_port() -> int:
    """A free loopback port for an agent, below the kernel's ephemeral range (the outgoing
    connections of the agents already running can never take it before the agent binds),
    and never one given before in this run (the agents of one run bind them all at once)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(200):
        port = random.randrange(max(1024, low - 10000), low)
        if port in _GIVEN_PORTS:
            continue
        _GIVEN_PORTS.add(port)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise BenchError(f"no free port found below {low}")


# The agents.


@dataclass
class Agent:
    """One agent process, the port of its /metrics and the servers it watches."""

    process: subprocess.Popen
    port: int
    servers: int
    log: Path

    def check_alive(self, label: str) -> None:
        if self.process.poll() is not None:
            raise BenchError(
                f"{label}: the agent on :{self.port} exited with {self.process.returncode}:\n"
                + _tail(self.log)
            )

    def read(self) -> tuple[int, int]:
        """(kvpilot_ticks_total, vllm and kvpool sources up) from its /metrics."""
        text = httpx.get(f"http://127.0.0.1:{self.port}/metrics", timeout=5).text
        ticks, up = -1, 0
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "kvpilot_ticks_total":
                    ticks = int(sample.value)
                elif sample.name == "kvpilot_collector_up" and sample.value == 1:
                    up += sample.labels.get("source") in ("vllm", "kvpool")
        return ticks, up


@dataclass
class Setup:
    """Where everything lives for the whole benchmark."""

    tmp: Path
    baseline_root: Path
    candidate_root: Path
    baseline_rev: str
    vllm_ports: list[int]
    kvpool_ports: list[int]
    fell_back: set[int] = field(default_factory=set)
    baseline_attach: set[int] = field(default_factory=set)  # where the baseline runs one process


def _agent_argv(i: int, port: int, setup: Setup) -> list[str]:
    return [
        sys.executable,
        "-m",
        "kvpilot.agent",
        "run",
        "--vllm-url",
        f"http://127.0.0.1:{setup.vllm_ports[i]}",
        "--kvpool-url",
        f"http://127.0.0.1:{setup.kvpool_ports[i]}",
        "--listen",
        f"127.0.0.1:{port}",
        "--interval",
        f"{INTERVAL_S:g}",
    ]


def candidate_config(setup: Setup, servers: int, port: int, kind: str = CANDIDATE) -> Path:
    """The one-process configuration: the attach runtime over `servers` servers (each kind
    keeps its own state directory: two versions never share a database)."""
    config = {
        "listen": {"host": "127.0.0.1", "port": port},
        "interval_s": INTERVAL_S,
        "state_dir": str(setup.tmp / f"state-{kind.split()[0]}-{servers}"),
        "runtime": {
            "kind": "attach",
            "servers": [
                {
                    "name": f"s{i}",
                    "url": f"http://127.0.0.1:{setup.vllm_ports[i]}",
                    "kvpool_url": f"http://127.0.0.1:{setup.kvpool_ports[i]}",
                }
                for i in range(servers)
            ],
        },
    }
    path = setup.tmp / f"{kind.split()[0]}-{servers}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def config_accepted(setup: Setup, path: Path, root: Path | None = None) -> tuple[bool, str]:
    argv = [sys.executable, "-m", "kvpilot.agent", "config", "check", str(path)]
    result = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        env=_env(root or setup.candidate_root),
        check=False,
        cwd=setup.tmp,
        timeout=60,
    )
    lines = (result.stderr or result.stdout).strip().splitlines()
    return result.returncode == 0, " / ".join(line.strip() for line in lines[:3])


def start_agents(kind: str, servers: int, setup: Setup) -> list[Agent]:
    root = setup.baseline_root if kind == BASELINE else setup.candidate_root
    env = _env(root)
    logs = setup.tmp / "logs"
    logs.mkdir(exist_ok=True)
    one_process = (kind == CANDIDATE and servers not in setup.fell_back) or (
        kind == BASELINE and servers in setup.baseline_attach
    )
    if one_process:
        port = _free_port()
        log = logs / f"{kind}-{servers}.log".replace(" ", "_")
        argv = [sys.executable, "-m", "kvpilot.agent", "run", "--config"]
        argv.append(str(candidate_config(setup, servers, port, kind)))
        return [Agent(_start(argv, log, env), port, servers, log)]
    agents = []
    for i in range(servers):
        port = _free_port()
        log = logs / f"{kind}-{servers}-{i}.log".replace(" ", "_")
        agents.append(Agent(_start(_agent_argv(i, port, setup), log, env), port, 1, log))
    return agents


def _wait_for_ticks(label: str, agents: list[Agent], ticks: int, timeout_s: float) -> None:
    """Until every agent's /metrics shows at least `ticks` ticks; a deadline, no guessing."""
    deadline = time.monotonic() + timeout_s
    waiting = list(agents)
    while waiting:
        for agent in list(waiting):
            agent.check_alive(label)
            with contextlib.suppress(httpx.HTTPError):
                if agent.read()[0] >= ticks:
                    waiting.remove(agent)
        if not waiting:
            return
        if time.monotonic() > deadline:
            agent = waiting[0]
            raise BenchError(
                f"{label}: the agent on :{agent.port} did not reach {ticks} ticks within "
                f"{timeout_s:.0f} s:\n{_tail(agent.log)}"
            )
        time.sleep(0.5)  # poll period of the condition above


@dataclass(frozen=True)
class Figure:
    cpu_percent: float
    rss_mib: float
    processes: int
    ticks: int


def measure(kind: str, servers: int, setup: Setup, span_s: float, warmup: int) -> Figure:
    label = f"{kind}, {servers} server(s)"
    agents = start_agents(kind, servers, setup)
    try:
        _wait_for_ticks(label, agents, warmup, timeout_s=60 + 2 * len(agents) + 3 * warmup)
        pids = [a.process.pid for a in agents]
        before = [a.read() for a in agents]
        cpu0, t0 = cpu_seconds(pids), time.monotonic()
        peak = rss_bytes(pids)
        while (left := span_s - (time.monotonic() - t0)) > 0:
            time.sleep(min(1.0, left))  # the measured span itself
            peak = max(peak, rss_bytes(pids))
        cpu1, t1 = cpu_seconds(pids), time.monotonic()
        for agent in agents:
            agent.check_alive(label)
        after = [a.read() for a in agents]
    finally:
        for agent in agents:
            _stop(agent.process)
    elapsed = t1 - t0
    expected = elapsed / INTERVAL_S
    ticked = [a[0] - b[0] for a, b in zip(after, before, strict=True)]
    for agent, count, (_, up) in zip(agents, ticked, after, strict=True):
        if count < 0.8 * expected - 1:
            raise BenchError(
                f"{label}: the agent on :{agent.port} ticked {count} times in {elapsed:.1f} s "
                f"(expected about {expected:.0f}): not a figure\n{_tail(agent.log)}"
            )
        if up != 2 * agent.servers:
            raise BenchError(
                f"{label}: the agent on :{agent.port} has {up} of {2 * agent.servers} vllm "
                f"and kvpool sources up: it does not read the stand-ins\n{_tail(agent.log)}"
            )
    return Figure(
        cpu_percent=100 * (cpu1 - cpu0) / elapsed,
        rss_mib=peak / MIB,
        processes=len(agents),
        ticks=min(ticked),
    )


# The report.


def _mean(figures: list[Figure]) -> Figure:
    n = len(figures)
    return Figure(
        cpu_percent=sum(f.cpu_percent for f in figures) / n,
        rss_mib=sum(f.rss_mib for f in figures) / n,
        processes=figures[0].processes,
        ticks=min(f.ticks for f in figures),
    )


def _describe(kind: str, servers: int, setup: Setup) -> str:
    if kind == BASELINE and servers in setup.baseline_attach:
        return f"baseline {setup.baseline_rev} (one process, attach runtime)"
    if kind == BASELINE:
        return f"baseline {setup.baseline_rev} (one --vllm-url process per server)"
    if kind == CANDIDATE_CLI:
        return "candidate (kvpilot run --vllm-url)"
    if servers in setup.fell_back:
        return "candidate (fell back: one --vllm-url process per server)"
    return "candidate (one process, attach runtime)"


def print_table(servers: int, rows: dict[str, Figure], setup: Setup) -> None:
    print(f"\n{servers} server(s)")
    print(f"  {'agent':<58} {'procs':>5} {'CPU % of a core':>16} {'RSS MiB':>8}")
    for kind, figure in rows.items():
        print(
            f"  {_describe(kind, servers, setup):<58} {figure.processes:>5} "
            f"{figure.cpu_percent:>16.3f} {figure.rss_mib:>8.1f}"
        )
    base, cand = rows[BASELINE], rows[CANDIDATE]
    print(
        f"  {'ratio candidate / baseline':<58} {'':>5} "
        f"{cand.cpu_percent / base.cpu_percent:>16.2f} {cand.rss_mib / base.rss_mib:>8.2f}"
    )


def print_goals(results: dict[int, dict[str, Figure]]) -> None:
    print()
    one = results.get(1)
    if one is not None and CANDIDATE_CLI in one:
        cli = one[CANDIDATE_CLI]
        print(
            f"one server, kvpilot run --vllm-url: {cli.cpu_percent:.3f} % of a core, "
            f"{cli.rss_mib:.1f} MiB (at the start: {START_CPU_PERCENT} %, {START_RSS_MIB} MiB)"
        )
    for servers, cpu_goal, rss_goal in GOALS:
        name = f"goal {servers} server(s), CPU under {cpu_goal:g} % of a core at 1 Hz"
        rss_name = f"goal {servers} server(s), RSS under {rss_goal:g} MiB"
        if servers not in results:
            print(f"{name}: not measured")
            print(f"{rss_name}: not measured")
            continue
        got = results[servers][CANDIDATE]
        print(f"{name}: {_verdict(got.cpu_percent < cpu_goal)} ({got.cpu_percent:.3f} %)")
        print(f"{rss_name}: {_verdict(got.rss_mib < rss_goal)} ({got.rss_mib:.1f} MiB)")
    name = f"goal linear growth, CPU per server at most {LINEAR_SLACK:g}x one server's"
    more = sorted(n for n in results if n > 1)
    if one is None or not more:
        print(f"{name}: not measured (needs 1 and more servers)")
        return
    per_one = one[CANDIDATE].cpu_percent
    ratios = {n: results[n][CANDIDATE].cpu_percent / n / per_one for n in more}
    shown = ", ".join(f"at {n}: {r:.2f}x" for n, r in ratios.items())
    print(f"{name}: {_verdict(max(ratios.values()) <= LINEAR_SLACK)} ({shown})")


def _verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


# Putting it together.


def _start_payloads(setup_tmp: Path, root: Path, count: int) -> tuple[subprocess.Popen, dict]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--serve-payloads", str(count)]
    log = setup_tmp / "payloads.log"
    process = _start(argv, log, _env(root), stdout=subprocess.PIPE, stdin=subprocess.PIPE)
    assert process.stdout is not None
    ready, _, _ = select.select([process.stdout], [], [], 60)
    line = process.stdout.readline() if ready else b""
    try:
        return process, json.loads(line)
    except ValueError:
        _stop(process)
        raise BenchError(f"the stand-in servers did not start:\n{_tail(log)}") from None


def run(args: argparse.Namespace) -> None:
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvpilot-footprint-")))
        rev = stack.enter_context(worktree(args.baseline, tmp / "baseline-tree"))
        candidate_root = import_root(ROOT, tmp / "candidate-root")
        payloads, ports = _start_payloads(tmp, candidate_root, max(args.servers))
        stack.callback(_stop, payloads)
        setup = Setup(
            tmp=tmp,
            baseline_root=import_root(tmp / "baseline-tree", tmp / "baseline-root"),
            candidate_root=candidate_root,
            baseline_rev=rev,
            vllm_ports=ports["vllm"],
            kvpool_ports=ports["kvpool"],
        )
        print(
            f"agent footprint: {args.span:g} s measured after {args.warmup} ticks of warm-up, "
            f"ticking every {INTERVAL_S:g} s, {args.rounds} round(s) alternating the order; "
            f"baseline {rev}, candidate the working tree at {ROOT}",
            flush=True,
        )
        results: dict[int, dict[str, Figure]] = {}
        for servers in args.servers:
            path = candidate_config(setup, servers, _free_port())
            accepted, why = config_accepted(setup, path)
            if not accepted:
                setup.fell_back.add(servers)
                print(
                    f"{servers} server(s): kvpilot config check refused the attach "
                    f"configuration ({why}); the candidate fell back to one "
                    "kvpilot run --vllm-url process per server",
                    flush=True,
                )
            if args.baseline_attach and config_accepted(setup, path, setup.baseline_root)[0]:
                setup.baseline_attach.add(servers)
            kinds = [BASELINE, CANDIDATE]
            runs: dict[str, list[Figure]] = {}
            for round_ in range(args.rounds):
                order = kinds if round_ % 2 == 0 else kinds[::-1]
                if servers == 1 and servers not in setup.fell_back:
                    order = [*order, CANDIDATE_CLI]
                for kind in order:
                    figure = measure(kind, servers, setup, args.span, args.warmup)
                    runs.setdefault(kind, []).append(figure)
                    print(
                        f"  {servers} server(s), round {round_ + 1}, {kind}: "
                        f"{figure.cpu_percent:.3f} % of a core, {figure.rss_mib:.1f} MiB, "
                        f"{figure.processes} process(es), at least {figure.ticks} ticks each",
                        flush=True,
                    )
            results[servers] = {k: _mean(runs[k]) for k in (*kinds, CANDIDATE_CLI) if k in runs}
        for servers, rows in results.items():
            print_table(servers, rows, setup)
        print_goals(results)


def _servers(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 1,8,32, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected server counts of at least 1, got {text!r}")
    return sorted(set(values))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 s, 1 and 2 servers, one round")
    parser.add_argument("--span", type=float, help="measured seconds per run (default 60)")
    parser.add_argument("--servers", type=_servers, help="server counts (default 1,8,32)")
    parser.add_argument("--baseline", default=DEFAULT_BASELINE, help="the baseline commit")
    parser.add_argument(
        "--baseline-attach",
        action="store_true",
        help="run the baseline as the candidate runs (one process, attach runtime) where its "
        "tree accepts that configuration: the same work, to compare two versions of it",
    )
    parser.add_argument("--rounds", type=int, help="rounds per server count (default 2)")
    parser.add_argument("--warmup", type=int, help="ticks before measuring (default 10)")
    parser.add_argument("--serve-payloads", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_payloads is not None:
        serve_payloads(args.serve_payloads)
        return
    quick = args.quick
    args.span = args.span if args.span is not None else (4.0 if quick else 60.0)
    args.servers = args.servers or ([1, 2] if quick else [1, 8, 32])
    args.rounds = args.rounds if args.rounds is not None else (1 if quick else 2)
    args.warmup = args.warmup if args.warmup is not None else (2 if quick else 10)
    if args.span < 2 or args.rounds < 1 or args.warmup < 1:
        parser.error("--span must be at least 2 s, --rounds and --warmup at least 1")
    # SIGTERM unwinds like Ctrl-C: every process, the worktree and the temp folder go.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        run(args)
    except BenchError as exc:
        print(f"agent_footprint: {exc}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("agent_footprint: interrupted; cleaned up", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
