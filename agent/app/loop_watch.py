"""An opt-in watch on the event loop, for soaks and hunts for a stall; off unless asked.

`KVPILOT_WATCH_LOOP=1` turns on asyncio's debug mode with its slow-callback warning at
100 ms (asyncio logs "Executing <callback> took N seconds": one scrape, decode or parse that
held every other server's tick), and a line at each tick start carrying the monotonic
time, so that the gaps between ticks can be read from the log across a wall-clock step.
asyncio's measure is wall time: on a shared machine a callback that the kernel set aside
looks slow without holding the loop, so each callback's CPU time in the loop's thread is
measured too, and a garbage collection over 50 ms is said (it holds whatever callback ran
it). Debug mode costs CPU (it records where each callback was created): never on by default.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import time

WATCH_LOOP_ENV = "KVPILOT_WATCH_LOOP"
SLOW_CALLBACK_S = 0.1
SLOW_COLLECTION_S = 0.05

log = logging.getLogger(__name__)


def watch_loop_if_asked(loop: asyncio.AbstractEventLoop) -> bool:
    """Turn the watch on for `loop` when the environment asks; whether it is on."""
    if os.environ.get(WATCH_LOOP_ENV) != "1":
        return False
    loop.set_debug(True)
    loop.slow_callback_duration = SLOW_CALLBACK_S
    _time_callbacks()
    gc.callbacks.append(_time_collections)
    log.warning(
        "%s=1: asyncio debug mode on, callbacks over %.0f ms logged, each tick start logged "
        "(costs CPU: for soaks, not production)",
        WATCH_LOOP_ENV,
        SLOW_CALLBACK_S * 1e3,
    )
    return True


def log_tick_start(monotonic_s: float) -> None:
    """A line at each tick start carrying the monotonic time (given to the tick loop while
    the watch is on): the gaps between ticks read from the log across a wall-clock step."""
    log.warning("tick started", extra={"monotonic_s": monotonic_s})


def _time_callbacks() -> None:
    """Every callback the loop runs, timed on its thread's CPU clock."""
    run = asyncio.events.Handle._run
    if getattr(run, "cpu_timed", False):
        return

    def timed(handle: asyncio.Handle) -> None:
        began_s, cpu_s = time.monotonic(), time.thread_time()
        run(handle)
        cpu_s = time.thread_time() - cpu_s
        if cpu_s >= SLOW_CALLBACK_S:
            callback = getattr(handle, "_callback", None)
            owner = getattr(callback, "__self__", None)  # a task's step: say which task
            log.warning(
                "a callback held the loop for %.3f s of CPU",
                cpu_s,
                extra={
                    "monotonic_s": began_s,
                    "cpu_s": cpu_s,
                    "wall_s": time.monotonic() - began_s,
                    "callback": repr(owner if isinstance(owner, asyncio.Future) else handle),
                },
            )

    timed.cpu_timed = True  # type: ignore[attr-defined]
    asyncio.events.Handle._run = timed  # type: ignore[method-assign,assignment]


_collection_began = [0.0, 0.0]  # monotonic, and the collecting thread's CPU clock


def _time_collections(phase: str, info: dict[str, int]) -> None:
    """A collection holds the GIL, so the loop, whichever thread runs it: wall and CPU."""
    if phase == "start":
        _collection_began[:] = [time.monotonic(), time.thread_time()]
        return
    took_s = time.monotonic() - _collection_began[0]
    if took_s >= SLOW_COLLECTION_S:
        cpu_s = time.thread_time() - _collection_began[1]
        log.warning(
            "a garbage collection (generation %d) took %.3f s (%.3f s of CPU)",
            info.get("generation", -1),
            took_s,
            cpu_s,
            extra={"monotonic_s": _collection_began[0], "took_s": took_s, "cpu_s": cpu_s},
        )
