"""Drain then stop: SIGTERM the main process, wait for it, SIGKILL whatever remains."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

from kvpilot.agent.runtimes.base import ProcessesSurvived

POLL_S = 0.1
KILL_TIMEOUT_S = 10.0


async def wait_for(
    predicate: Callable[[], bool],
    timeout_s: float,
    *,
    clock: Callable[[], float] = time.monotonic,
    poll_s: float = POLL_S,
) -> bool:
    """Poll `predicate` until it holds or `timeout_s` passes; returns whether it held."""
    deadline = clock() + timeout_s
    while True:
        if predicate():
            return True
        if clock() >= deadline:
            return False
        await asyncio.sleep(poll_s)


@dataclass(frozen=True, slots=True)
class DrainOutcome:
    was_running: bool  # the main process was alive when the stop began
    drained: bool  # it then exited on SIGTERM within the drain deadline
    killed_pids: tuple[int, ...]
    elapsed_s: float


async def drain_then_kill(
    *,
    terminate: Callable[[], object],
    main_exited: Callable[[], bool],
    survivors: Callable[[], Collection[int]],
    kill: Callable[[], Collection[int]],
    drain_timeout_s: float,
    kill_timeout_s: float = KILL_TIMEOUT_S,
    what: str = "vLLM",
    clock: Callable[[], float] = time.monotonic,
) -> DrainOutcome:
    """Stop one server's processes, gracefully first.

    `terminate` sends SIGTERM to the main process only: vLLM's API server then drains
    in-flight requests for its `--shutdown-timeout` and stops its engine itself. Whatever
    is still alive after the main process exited (or the drain deadline passed) is killed
    with `kill` (SIGKILL, returning the PIDs signalled) until `survivors` is empty.
    """
    started = clock()
    was_running = not main_exited()
    if was_running:
        terminate()
    drained = await wait_for(main_exited, drain_timeout_s, clock=clock)
    # Engine and workers normally exit with the API server; give them a moment first.
    if drained:
        await wait_for(lambda: not survivors(), min(2.0, kill_timeout_s), clock=clock)
    killed: set[int] = set()

    def gone() -> bool:
        if not survivors():
            return True
        killed.update(kill())
        return False

    if not await wait_for(gone, kill_timeout_s, clock=clock):
        left = sorted(survivors())
        raise ProcessesSurvived(
            f"{what}: processes {left} still alive {kill_timeout_s:.0f} s after SIGKILL", left
        )
    return DrainOutcome(
        was_running=was_running,
        drained=was_running and drained,
        killed_pids=tuple(sorted(killed)),
        elapsed_s=clock() - started,
    )
