"""The learned workload's window outlives a restart of kvpilot: kept in the real state
database once a minute, read back by a new process (another monotonic clock) with what aged
out dropped; a damaged record leaves the window empty and says why."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import httpx
import pytest

from kvpilot.agent.app.compose import run_sidecar
from kvpilot.agent.config import AgentConfig, validate_config
from kvpilot.agent.state.store import StateStore
from kvpilot.agent.tuning.workload.keep import WINDOW_FACT, WindowKeeper
from kvpilot.agent.tuning.workload.window import WorkloadWindow
from kvpilot.rig.server import free_port
from tests.agent.state.loopback import CALM, agent_config
from tests.agent.tuning.workload_scrapes import served
from tests.http_helpers import ServedInThread

WALL0 = 1_800_000_000.0  # the wall clock of the first kvpilot at its monotonic 0


class Clocks:
    """A monotonic clock and a wall clock the test moves; `offset`: wall - monotonic."""

    def __init__(self, monotonic: float, offset: float) -> None:
        self.monotonic, self.offset = monotonic, offset

    def clock(self) -> float:
        return self.monotonic

    def wall(self) -> float:
        return self.monotonic + self.offset


def _fed(window: WorkloadWindow, requests: int, seconds: int) -> None:
    """A server that finishes `requests` evenly over `seconds`, scraped each 10 s."""
    for t in range(0, seconds + 1, 10):
        window.observe(served(requests * t // seconds, at_s=float(t)))


def test_a_new_kvpilot_reads_back_the_window_the_last_one_kept(tmp_path: Path) -> None:
    store = StateStore.open(tmp_path)
    first = WorkloadWindow(3600)
    _fed(first, 300, 600)
    clocks = Clocks(600.0, WALL0)
    WindowKeeper(first, store, clock=clocks.clock, wall=clocks.wall).save()
    before = first.shape()
    store.close()

    # Another process, 30 s later by the wall clock, its monotonic clock at 5 s.
    store = StateStore.open(tmp_path)
    second = WorkloadWindow(3600)
    later = Clocks(5.0, WALL0 + 625.0)
    said = WindowKeeper(second, store, clock=later.clock, wall=later.wall).restore()
    after = second.shape()
    assert said == "restored 300 requests of the kept window"
    assert before is not None and after is not None
    assert after.requests == before.requests == 300
    assert after.prompt_tokens == before.prompt_tokens
    assert after.generation_tokens == before.generation_tokens
    assert after.rate_rps == pytest.approx(before.rate_rps)
    assert after.block_size == 16
    # The next scrape of the running server sets its base: nothing counted twice.
    second.observe(served(300, at_s=15.0))
    second.observe(served(310, at_s=25.0))
    assert second.requests() == 310
    store.close()


def test_minutes_older_than_the_window_are_dropped_on_restore(tmp_path: Path) -> None:
    store = StateStore.open(tmp_path)
    first = WorkloadWindow(3600)
    _fed(first, 600, 1200)  # 30 requests a minute for 20 minutes
    clocks = Clocks(1200.0, WALL0)
    WindowKeeper(first, store, clock=clocks.clock, wall=clocks.wall).save()

    second = WorkloadWindow(3600)
    # Back 50 minutes after the last scrape: only the last 10 minutes are within the hour.
    later = Clocks(10.0, WALL0 + 1200.0 + 3000.0 - 10.0)
    WindowKeeper(second, store, clock=later.clock, wall=later.wall).restore()
    assert 270 <= second.requests() <= 330  # 10 minutes' worth, give or take a minute
    store.close()


def test_the_keeper_saves_at_most_once_a_minute(tmp_path: Path) -> None:
    store = StateStore.open(tmp_path)
    window = WorkloadWindow(3600)
    clocks = Clocks(0.0, WALL0)
    keeper = WindowKeeper(window, store, clock=clocks.clock, wall=clocks.wall)
    window.observe(served(0, at_s=0.0))
    window.observe(served(10, at_s=10.0))
    keeper.maybe_save()
    assert len(store.get_fact(WINDOW_FACT)["minutes"]) == 1
    window.observe(served(20, at_s=70.0))
    clocks.monotonic = 59.0
    keeper.maybe_save()  # too soon: the record still holds the first minute only
    assert len(store.get_fact(WINDOW_FACT)["minutes"]) == 1
    clocks.monotonic = 70.0
    keeper.maybe_save()
    assert len(store.get_fact(WINDOW_FACT)["minutes"]) == 2
    store.close()


def _record(**minute: object) -> dict[str, object]:
    """A window record of one minute, with `minute`'s fields changed."""
    one = {
        "wall_s": WALL0,
        "prompt": None,
        "generation": None,
        "finished": 1.0,
        "hits": 0.0,
        "queries": 0.0,
    }
    return {"format": 1, "first_wall_s": WALL0, "block_size": 16, "minutes": [one | minute]}


NAN_HISTOGRAM = {"buckets": [["+Inf", float("nan")]], "sum": 1, "count": 1}


@pytest.mark.parametrize(
    ("record", "why"),
    [
        ({"format": 99}, "not a window record"),
        ("a string", "not a window record"),
        (_record() | {"first_wall_s": "soon"}, "finite"),
        (_record() | {"block_size": -1}, "block size"),
        (_record(finished=-5.0), "negative"),
        (_record(prompt=NAN_HISTOGRAM), "non-finite"),
        (_record() | {"minutes": [{}]}, "wall_s"),
    ],
)
def test_a_damaged_record_leaves_the_window_empty_and_says_why(
    tmp_path: Path, record: object, why: str
) -> None:
    store = StateStore.open(tmp_path)
    store.set_fact(WINDOW_FACT, record, WALL0)
    window = WorkloadWindow(3600)
    clocks = Clocks(5.0, WALL0)
    said = WindowKeeper(window, store, clock=clocks.clock, wall=clocks.wall).restore()
    assert said.startswith("the kept window is unreadable (") and why in said, said
    assert window.shape() is None and window.requests() == 0
    store.close()


def test_nothing_kept_is_an_empty_window(tmp_path: Path) -> None:
    store = StateStore.open(tmp_path)
    window = WorkloadWindow(3600)
    assert WindowKeeper(window, store).restore() == "no kept window; it starts empty"
    WindowKeeper(window, store).save()  # an empty window writes nothing
    assert store.get_fact(WINDOW_FACT) is None
    store.close()


class GrowingVllm(ServedInThread):
    """The recorded vLLM `/metrics`, its request counters and length histograms multiplied
    by the number of scrapes so far: a server that keeps finishing requests."""

    def __init__(self) -> None:
        self.scrapes = 0
        server = self
        grows = re.compile(
            rb"^(vllm:(?:request_prompt_tokens|request_generation_tokens|request_success_total)"
            rb"\S*) (\S+)$",
            re.M,
        )

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path == "/metrics":
                    server.scrapes += 1
                    n = server.scrapes
                    body = grows.sub(lambda m: m[1] + b" %r" % (float(m[2]) * n), CALM)
                else:
                    body = b'{"version": "0.32.0"}' if self.path == "/version" else b""
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                """Quiet."""

        super().__init__(Handler)


def test_kvpilot_run_keeps_the_window_across_its_restart(tmp_path: Path) -> None:
    """Through the real `run_sidecar`: the first kvpilot learns from a growing server and
    keeps its window as it stops; the second, whose server no longer answers, serves the
    same window on `GET /api/v1/workload` from its first tick."""
    port = free_port()

    def config(vllm_url: str) -> AgentConfig:
        data = agent_config(
            tmp_path / "state",
            vllm_url=vllm_url,
            receiver_url="http://127.0.0.1:9",
            listen_port=port,
            interval_s=0.2,
        )
        data["notifiers"] = []
        return validate_config(data, {}, warn=False)

    def window_requests() -> int:
        answer = httpx.get(f"http://127.0.0.1:{port}/api/v1/workload", timeout=5.0)
        return int(answer.json()["window"]["requests"])

    async def run(cfg: AgentConfig, until: Callable[[], bool]) -> int:
        stop = asyncio.Event()
        ticked: list[object] = []
        agent = asyncio.create_task(run_sidecar(cfg, stop=stop, on_tick=ticked.append))
        try:
            deadline = time.monotonic() + 30.0
            while not (ticked and until()):
                assert time.monotonic() < deadline and not agent.done(), "no progress"
                await asyncio.sleep(0.1)
            return await asyncio.to_thread(window_requests)
        finally:
            stop.set()
            await asyncio.wait_for(agent, timeout=30)

    with GrowingVllm() as vllm:
        url = f"http://127.0.0.1:{vllm.port}"
        learned = asyncio.run(run(config(url), lambda: vllm.scrapes >= 5))
    assert learned > 0
    kept = asyncio.run(run(config(f"http://127.0.0.1:{free_port()}"), lambda: True))
    assert kept >= learned  # the ticks after the first's last answer are kept too


def test_a_row_that_is_not_json_leaves_the_window_empty(tmp_path: Path) -> None:
    store = StateStore.open(tmp_path)
    with store.db.transaction() as conn:  # what a torn write could leave
        conn.execute(
            "INSERT INTO kv (key, value_json, updated_wall_s) VALUES (?, ?, ?)",
            (WINDOW_FACT, "{not json", WALL0),
        )
    window = WorkloadWindow(3600)
    said = WindowKeeper(window, store).restore()
    assert said.startswith("the kept window is unreadable (") and window.requests() == 0
    store.close()
