"""The one door every restart of a replica goes through: its Deployment's restart budget.

`FleetGate.turn` is the small interface both sides call (remediation's restarts through
`FleetRestarts`, tuning's when it restarts a replica): it checks the PodDisruptionBudget for
a restart by signal, waits for one of the Deployment's restart slots (saying so once, as an
Event and through `on_wait`, which pages), holds it renewed while the restart runs, gives it
back, and writes an Event and the Deployment's kept guards for every decision. Waiting and
renewal run on the injected monotonic clock; refusals are `GateRefused`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvpilot.agent.model import Instance
from kvpilot.agent.runtimes.base import RuntimeFailure
from kvpilot.agent.runtimes.kubernetes.fleet import decision_events as ev
from kvpilot.agent.runtimes.kubernetes.fleet.decision_events import DecisionEvents
from kvpilot.agent.runtimes.kubernetes.fleet.kept_guards import KeptGuards
from kvpilot.agent.runtimes.kubernetes.fleet.pdb import DisruptionVerdict, pod_disruption_verdict
from kvpilot.agent.runtimes.kubernetes.fleet.slots import RestartSlots

log = logging.getLogger(__name__)


class GateRefused(RuntimeFailure):
    """The Deployment's budget or its PodDisruptionBudget did not let this restart go."""


@dataclass(frozen=True, slots=True)
class GateTimings:
    poll_s: float = 2.0  # how often a waiting replica looks again (only while it waits)
    max_wait_s: float = 900.0  # then the restart is refused, and the remediation fails
    renew_every_s: float = 10.0  # a third of the slot's duration, as Leases renew


class FleetGate:
    """A Deployment's restart budget, PDB and decision trail, for one replica."""

    def __init__(
        self,
        *,
        slots: RestartSlots,
        events: DecisionEvents,
        kept: KeptGuards,
        disruption: Callable[[], DisruptionVerdict] | None = None,
        breaker_fact: Callable[[], dict[str, Any]] | None = None,
        on_wait: Callable[[str], None] | None = None,
        timings: GateTimings = GateTimings(),
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.slots = slots
        self.events = events
        self.kept = kept
        self._disruption = disruption
        self._breaker_fact = breaker_fact
        self._on_wait = on_wait
        self._timings = timings
        self._clock = clock
        self._wall_clock = wall_clock

    def watch_breaker(self, fact: Callable[[], dict[str, Any]]) -> None:
        """Keep `fact()` (the breaker's, as the remediator tells it) with every decision; the
        remediator is built after the runtime whose restarts this gate guards."""
        self._breaker_fact = fact

    async def _decide(self, reason: str, message: str) -> None:
        log.info("fleet: %s: %s", reason, message)
        await asyncio.to_thread(self.events.record, reason, message)

    async def _remember(self, reason: str, message: str, *, restarted: bool) -> None:
        breaker = self._breaker_fact() if self._breaker_fact is not None else None
        decision = {"wall_s": self._wall_clock(), "pod": self.slots.identity, "reason": reason}
        try:
            await asyncio.to_thread(
                self.kept.note,
                self.slots.identity,
                restart_wall_s=self._wall_clock() if restarted else None,
                breaker=breaker,
                decision={**decision, "message": message},
            )
        except RuntimeFailure as exc:  # the Events still tell it; the next write catches up
            log.warning("fleet: the Deployment's kept guards are not written: %s", exc)

    async def _wait_for_turn(self, why: str, *, by_signal: bool) -> None:
        started_s, said = self._clock(), False
        while True:
            blocked = await self._try_once(why, by_signal=by_signal)
            if blocked is None:
                return
            waited_s = self._clock() - started_s
            if waited_s >= self._timings.max_wait_s:
                message = f"refused after waiting {waited_s:.0f} s: {blocked}"
                await self._decide(ev.RESTART_REFUSED, message)
                await self._remember(ev.RESTART_REFUSED, message, restarted=False)
                raise GateRefused(message)
            if not said:  # says so once, pages once; then goes quietly when its turn comes
                said = True
                await self._decide(ev.RESTART_WAITING, f"{why} waits: {blocked}")
                if self._on_wait is not None:
                    self._on_wait(f"{why} waits its turn: {blocked}")
            await asyncio.sleep(self._timings.poll_s)

    async def _try_once(self, why: str, *, by_signal: bool) -> str | None:
        """Take a slot if the budget and the PDB allow it now; else why not. While the slots
        are held a poll is one read of the Lease: the PDB is listed only when one is free."""
        looked = await asyncio.to_thread(self.slots.look)
        if not looked.granted:
            return looked.reason
        if by_signal and self._disruption is not None:
            verdict = await asyncio.to_thread(self._disruption)
            if not verdict.allowed:
                return verdict.reason
        taken = await asyncio.to_thread(self.slots.try_take, why)
        return None if taken.granted else taken.reason

    @contextlib.asynccontextmanager
    async def turn(self, why: str, *, by_signal: bool = True) -> AsyncIterator[None]:
        """Hold one of the Deployment's restart slots for the body (the restart itself)."""
        await self._decide(ev.RESTART_PLANNED, why)
        try:
            await self._wait_for_turn(why, by_signal=by_signal)
        except RuntimeFailure as exc:
            if not isinstance(exc, GateRefused):
                message = f"refused: the restart budget cannot be read or taken: {exc}"
                await self._decide(ev.RESTART_REFUSED, message)
                raise GateRefused(message) from exc
            raise
        renewer = asyncio.create_task(self._renew(), name=f"renew {self.slots.name}")
        try:
            yield
        except BaseException as exc:
            await self._decide(ev.RESTART_FAILED, f"{why} failed: {exc}")
            await self._remember(ev.RESTART_FAILED, str(exc), restarted=True)
            raise
        else:
            await self._decide(ev.RESTART_DONE, f"{why}: done")
            await self._remember(ev.RESTART_DONE, why, restarted=True)
        finally:
            renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewer
            await asyncio.to_thread(self._give_back_quietly)

    async def _renew(self) -> None:
        while True:
            await asyncio.sleep(self._timings.renew_every_s)
            try:
                await asyncio.to_thread(self.slots.renew)
            except RuntimeFailure as exc:  # the slot lapses by its duration at worst
                log.warning("fleet: renewing the restart slot failed: %s", exc)

    def _give_back_quietly(self) -> None:
        try:
            self.slots.give_back()
        except RuntimeFailure as exc:
            log.warning("fleet: the restart slot lapses by its duration: %s", exc)


def pod_gate(
    api_client: Any, *, namespace: str, deployment: str, pod: str, slots: int = 1
) -> FleetGate:
    """The gate of `pod`, a replica of `deployment`: its Lease slots, its PDBs, its Events and
    its kept guards, all through one API client."""
    return FleetGate(
        slots=RestartSlots(
            api_client, namespace=namespace, deployment=deployment, identity=pod, slots=slots
        ),
        events=DecisionEvents(api_client, namespace=namespace, deployment=deployment, pod=pod),
        kept=KeptGuards(api_client, namespace=namespace, deployment=deployment),
        disruption=lambda: pod_disruption_verdict(api_client, namespace, pod),
    )


class FleetRestarts:
    """A runtime whose restarts of the stable wait for their Deployment's turn; the rest is
    the inner runtime's (a canary is the tuner's, judged alone)."""

    def __init__(self, inner: Any, gate: FleetGate) -> None:
        self._inner = inner
        self.gate = gate

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    @property
    def can_change_flags(self) -> bool:
        return bool(self._inner.can_change_flags)

    def instances(self) -> tuple[Instance, ...]:
        return tuple(self._inner.instances())

    async def restart(
        self,
        name: str,
        *,
        drain_timeout_s: float,
        ready_timeout_s: float,
        argv: Sequence[str] | None = None,
    ) -> Instance:
        role = next((i.role for i in self.instances() if i.name == name), "stable")
        if role == "canary":
            return await self._inner.restart(  # type: ignore[no-any-return]
                name, drain_timeout_s=drain_timeout_s, ready_timeout_s=ready_timeout_s, argv=argv
            )
        why = f"restart of {name}" if argv is None else f"restart of {name} with new flags"
        async with self.gate.turn(why, by_signal=argv is None):
            return await self._inner.restart(  # type: ignore[no-any-return]
                name, drain_timeout_s=drain_timeout_s, ready_timeout_s=ready_timeout_s, argv=argv
            )
