"""How many kvpilot modules one tick crosses, and how many lie on its spine.

The agent runs in this process (``run_sidecar``) watching one recorded vLLM (a constant
``/metrics`` under load, served on loopback) at 2 Hz, with one webhook receiver. Method:

- **a steady tick**: after three warm ticks, ``sys.setprofile`` (and ``threading.setprofile``
  for the runtime's read threads) records the module of every Python function called from one
  tick's end to the next one's end; the kvpilot modules among them are the modules a tick
  crosses, grouped into rooms (``agent.tick``, ``agent.rules``, ``collectors``...).
- **the spine**: the engine-stall rule (load present, the iteration counter never moves) fires
  after a second; when the webhook's POST starts, the kvpilot modules on the call stack are
  taken, then those on the stack that created the running task, and so on up to the task
  APScheduler's job created: scheduler to webhook POST, through every task hand-over.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/tick_path.py [--list]
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys
import tempfile
import threading
from collections.abc import Coroutine
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import FrameType
from typing import Any

from kvpilot.agent.app.compose import run_sidecar
from kvpilot.agent.config import AgentConfig

PAYLOAD = (
    Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "vllm" / "v0_32_under_load.prom"
).read_bytes()
POST_FUNCTION = ("kvpilot.agent.notify.base", "post")
WARM_TICKS = 3
DEADLINE_S = 60.0


class _RecordedVllm(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = {"/metrics": PAYLOAD, "/health": b"", "/version": b'{"version": "0.32.0"}'}.get(
            self.path
        )
        self.send_response(404 if body is None else 200)
        self.send_header("Content-Length", str(len(body or b"")))
        self.end_headers()
        self.wfile.write(body or b"")

    def log_message(self, *args: object) -> None:
        pass


class _Receiver(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def _serve(handler: type[BaseHTTPRequestHandler]) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    return server


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _stack_modules(frame: FrameType | None) -> list[str]:
    out = []
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name.startswith("kvpilot."):
            out.append(name)
        frame = frame.f_back
    return out


class _Trace:
    """The modules called while on; the spine once the webhook's POST starts."""

    def __init__(self) -> None:
        self.modules: set[str] = set()
        self.spine: set[str] = set()
        self.created_by: dict[asyncio.Task[Any], tuple[asyncio.Task[Any] | None, list[str]]] = {}
        self.posted = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    def task_factory(
        self, loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any], **kw: Any
    ) -> asyncio.Task[Any]:
        task = asyncio.Task(coro, loop=loop, **kw)
        parent = asyncio.current_task(loop)
        self.created_by[task] = (parent, _stack_modules(sys._getframe(1)))
        return task

    def on(self) -> None:
        threading.setprofile(self._profile)
        sys.setprofile(self._profile)

    def off(self) -> None:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]

    def _profile(self, frame: FrameType, event: str, arg: object) -> None:
        if event != "call":
            return
        module = frame.f_globals.get("__name__", "")
        if not module.startswith("kvpilot."):
            return
        self.modules.add(module)
        if (module, frame.f_code.co_name) == POST_FUNCTION and not self.spine:
            self._take_spine(frame)

    def _take_spine(self, frame: FrameType) -> None:
        self.spine.update(_stack_modules(frame))
        task: asyncio.Task[Any] | None = asyncio.current_task()
        seen = set()
        while task is not None and task not in seen:
            seen.add(task)
            parent, stack = self.created_by.get(task, (None, []))
            self.spine.update(stack)
            task = parent
        self.posted.set()


def _room(module: str) -> str:
    parts = module.split(".")
    if parts[1] == "agent" and len(parts) > 3:
        return f"agent.{parts[2]}"
    return parts[1]


def _config(vllm_port: int, hook_port: int, state: Path) -> AgentConfig:
    return AgentConfig.model_validate(
        {
            "listen": {"host": "127.0.0.1", "port": _free_port()},
            "interval_s": 0.5,
            "state_dir": str(state),
            "runtime": {
                "kind": "attach",
                "servers": [{"name": "vllm", "url": f"http://127.0.0.1:{vllm_port}"}],
            },
            "rules": {"engine_stall": {"stall_s": 1.0, "for_s": 0.0, "action": "alert"}},
            "notifiers": [{"kind": "webhook", "url": f"http://127.0.0.1:{hook_port}/hook"}],
        }
    )


async def _measure(config: AgentConfig) -> tuple[set[str], set[str]]:
    trace = _Trace()
    asyncio.get_running_loop().set_task_factory(trace.task_factory)
    stop = asyncio.Event()
    ticks = 0
    steady: set[str] = set()

    def on_tick(_: object) -> None:
        nonlocal ticks, steady
        ticks += 1
        if ticks == WARM_TICKS:
            trace.on()
        elif ticks == WARM_TICKS + 1:
            trace.off()
            steady = set(trace.modules)
            trace.on()  # on again until the POST: the spine

    agent = asyncio.create_task(run_sidecar(config, stop=stop, on_tick=on_tick))
    try:
        await asyncio.wait_for(trace.posted.wait(), DEADLINE_S)
    finally:
        trace.off()
        stop.set()
        await agent
    return steady, trace.spine


def _report(title: str, modules: set[str], listing: bool) -> None:
    rooms = sorted({_room(m) for m in modules})
    print(f"{title}: {len(modules)} modules in {len(rooms)} rooms ({', '.join(rooms)})")
    if listing:
        for module in sorted(modules):
            print(f"  {module}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="list the modules too")
    args = parser.parse_args()
    vllm, hook = _serve(_RecordedVllm), _serve(_Receiver)
    try:
        with tempfile.TemporaryDirectory() as folder:
            config = _config(vllm.server_address[1], hook.server_address[1], Path(folder))
            steady, spine = asyncio.run(_measure(config))
    finally:
        vllm.shutdown()
        hook.shutdown()
    _report("one steady tick", steady, args.list)
    _report("spine, scheduler to webhook POST", spine, args.list)


if __name__ == "__main__":
    main()
