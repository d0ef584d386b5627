"""What a replica keeps with its Deployment while it runs, and reads back: the operators'
vetoes and the learned workload, in the Deployment's kept guards (the ConfigMap
`<deployment>-kvpilot-guards`).

A veto is the Deployment's: the stable instance is named after the Deployment on every
replica, so a veto set through any replica's API holds on all of them, and on the pods that
replace them. Each operator's veto and lift is written to the ConfigMap with an Event on the
pod and the Deployment; every `every_s` (and at once after a veto) the replica reads the kept
vetoes back, so one lifted on another replica ends here too. A write that fails is tried
again at the next round; the veto holds here meanwhile.

The learned workload: a new replica whose window is empty (no state of its own) starts from
the Deployment's kept summary, so a rolling update does not forget what the last pods
learned. A replica writes its window's summary at most every `workload_every_s`, only once
its window holds `min_requests` and only when the summary changed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from kvpilot.agent.remediation.vetoes import Key, VetoChange, Vetoes, veto_row
from kvpilot.agent.runtimes import RuntimeFailure
from kvpilot.agent.runtimes.kubernetes.fleet import decision_events as ev
from kvpilot.agent.runtimes.kubernetes.fleet.decision_events import DecisionEvents
from kvpilot.agent.runtimes.kubernetes.fleet.kept_guards import KeptGuards
from kvpilot.agent.tuning.workload.keep import restore_window, window_summary
from kvpilot.agent.tuning.workload.window import WorkloadWindow

log = logging.getLogger(__name__)

VETOES_EVERY_S = 60.0  # one read of the ConfigMap per round: 0.017 requests a second
WORKLOAD_EVERY_S = 600.0


class DeploymentKeeping:
    """Keeps this replica's vetoes and learned workload with its Deployment."""

    def __init__(
        self,
        kept: KeptGuards,
        events: DecisionEvents,
        vetoes: Vetoes,
        window: WorkloadWindow | None,
        *,
        min_requests: int = 0,
        every_s: float = VETOES_EVERY_S,
        workload_every_s: float = WORKLOAD_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._kept = kept
        self._events = events
        self._vetoes = vetoes
        self._window = window
        self._min_requests = min_requests
        self._every_s = every_s
        self._workload_every_s = workload_every_s
        self._clock = clock
        self._wall_clock = wall_clock
        self._pending: deque[VetoChange] = deque()  # operators' changes not yet kept
        self._wake = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._workload_at_s: float | None = None
        self._workload_kept: str | None = None  # what the last summary written held
        vetoes.watch(self._heard)

    def _heard(self, change: VetoChange) -> None:
        self._pending.append(change)
        if self._loop is not None:  # the API may call from its own thread
            self._loop.call_soon_threadsafe(self._wake.set)

    async def start(self) -> str:
        """At start-up: the Deployment's vetoes, and its learned workload into an empty
        window; returns what happened to the workload, for the log."""
        self._loop = asyncio.get_running_loop()
        await self.sync_vetoes()
        return await self.take_workload()

    async def run(self) -> None:
        """Round after round, until cancelled: vetoes both ways, then the workload when due."""
        while True:
            with contextlib.suppress(TimeoutError):  # a round is due, or a veto came
                await asyncio.wait_for(self._wake.wait(), self._every_s)
            self._wake.clear()
            await self.sync_vetoes()
            await self.keep_workload()

    # -- vetoes ----------------------------------------------------------------------------

    async def sync_vetoes(self) -> None:
        """Write the operators' changes made here, then hold what the Deployment keeps."""
        try:
            while self._pending:
                await asyncio.to_thread(self._write, self._pending[0])
                self._pending.popleft()
            rows = await asyncio.to_thread(self._kept.vetoes)
        except RuntimeFailure as exc:
            log.warning("fleet: the Deployment's kept vetoes are not synced (next round): %s", exc)
            return
        pending: set[Key] = {(c.veto.kind, c.veto.target) for c in self._pending}
        if changed := self._vetoes.merge_kept(rows, pending=pending):
            log.info("fleet: %d veto(es) changed by the Deployment's kept vetoes", changed)

    def _write(self, change: VetoChange) -> None:
        veto = change.veto
        what = f"{veto.kind} {veto.target}"
        if change.lifted:
            self._kept.lift_veto(veto.kind, veto.target)
            message = f"the veto of {what} lifted by {veto.requested_by}: {veto.reason}"
            self._events.record(ev.VETO_LIFTED, message)
            return
        self._kept.put_veto(veto_row(veto))
        lasting = (
            "until lifted"
            if veto.until_wall_s is None
            else f"for {veto.until_wall_s - veto.since_wall_s:g} s"
        )
        message = f"{what} vetoed by {veto.requested_by} ({lasting}): {veto.reason}"
        self._events.record(ev.VETOED, message)

    # -- the learned workload ----------------------------------------------------------------

    async def take_workload(self) -> str:
        """The Deployment's kept workload into this replica's window, where it is empty."""
        window = self._window
        if window is None:
            return "learning is off"
        if window.first_s is not None:
            return "the window has its own traffic (kept in the pod's state)"
        try:
            summary = await asyncio.to_thread(self._kept.workload)
        except RuntimeFailure as exc:
            return f"the Deployment's kept workload is not read ({exc}); it starts empty"
        if summary is None:
            return "the Deployment keeps no workload yet"
        try:
            said = restore_window(window, summary, clock=self._clock, wall=self._wall_clock)
        except RuntimeError:  # a scrape came first: the window has its own traffic now
            return "the window has its own traffic"
        self._workload_kept = _content(summary)
        self._workload_at_s = self._clock()
        return f"from the Deployment: {said}"

    async def keep_workload(self) -> None:
        """Write the window's summary when due, full enough and changed."""
        window = self._window
        if window is None or window.requests() < max(1, self._min_requests):
            return
        now_s = self._clock()
        if self._workload_at_s is not None and now_s - self._workload_at_s < self._workload_every_s:
            return
        summary = window_summary(window, clock=self._clock, wall=self._wall_clock)
        if summary is None or _content(summary) == self._workload_kept:
            return
        self._workload_at_s = now_s
        try:
            await asyncio.to_thread(self._kept.keep_workload, summary)
        except (RuntimeFailure, ValueError) as exc:  # the next round after the interval
            log.warning("fleet: the learned workload is not kept with the Deployment: %s", exc)
            return
        self._workload_kept = _content(summary)


def _content(summary: dict[str, Any]) -> str:
    """What a summary holds, apart from when it was taken (for "only when it changed")."""
    minutes = [{k: v for k, v in m.items() if k != "wall_s"} for m in summary.get("minutes", [])]
    return repr((summary.get("block_size"), minutes))
