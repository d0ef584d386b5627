"""A namespace-wide cap on concurrent canaries: each asks for GPUs the namespace may not have.

The slots are the restart budget's machinery (`fleet.slots.RestartSlots`) on one Lease per
namespace, `kvpilot-canaries`, held by pod name (a replica that then loses its Deployment's
tuning Lease gives back its own slot, never the winner's): a tuning run takes a slot before its
first canary, renews it while it runs and gives it back at its end; a dead run's slot lapses
after the Lease's duration. A run that finds every slot held is skipped (`CanaryCapFull`,
which the schedule audits), and says why in an Event on its pod and Deployment.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from kvpilot.agent.runtimes.base import RuntimeFailure
from kvpilot.agent.runtimes.kubernetes.fleet.decision_events import (
    TUNING_SKIPPED,
    DecisionEvents,
)
from kvpilot.agent.runtimes.kubernetes.fleet.slots import RestartSlots
from kvpilot.tuner.session import TuningBlocked

log = logging.getLogger(__name__)

CANARY_LEASE = "kvpilot-canaries"
DURATION_S = 60


class CanaryCapFull(TuningBlocked):
    """Every canary slot of the namespace is held by another Deployment's tuning run."""


class CanaryCap:
    """One Deployment's turn among its namespace's canaries."""

    def __init__(
        self, slots: RestartSlots, events: DecisionEvents, *, renew_every_s: float | None = None
    ) -> None:
        self.slots = slots
        self.events = events
        self._renew_every_s = renew_every_s or slots.duration_s / 3

    @contextlib.asynccontextmanager
    async def turn(self) -> AsyncIterator[None]:
        """Hold a canary slot for the body; CanaryCapFull (an Event written) when none is
        free, TuningBlocked when the Lease cannot be read or written."""
        try:
            answer = await asyncio.to_thread(self.slots.try_take, "tuning run")
        except RuntimeFailure as exc:
            raise TuningBlocked(f"the namespace's canary slots cannot be read: {exc}") from exc
        if not answer.granted:
            why = f"tuning skipped: {answer.reason.replace(': waiting for a turn', '')}"
            await asyncio.to_thread(self.events.record, TUNING_SKIPPED, why)
            raise CanaryCapFull(why)
        renewer = asyncio.create_task(self._renew(), name=f"renew {self.slots.name}")
        try:
            yield
        finally:
            renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewer
            await asyncio.to_thread(self._give_back_quietly)

    async def _renew(self) -> None:
        while True:
            await asyncio.sleep(self._renew_every_s)
            try:
                await asyncio.to_thread(self.slots.renew)
            except RuntimeFailure as exc:  # the slot lapses by its duration at worst
                log.warning("renewing the canary slot failed: %s", exc)

    def _give_back_quietly(self) -> None:
        try:
            self.slots.give_back()
        except RuntimeFailure as exc:
            log.warning("the canary slot lapses by its duration: %s", exc)


def namespace_canary_cap(
    api_client: Any, *, namespace: str, deployment: str, pod: str, at_once: int = 1
) -> CanaryCap:
    """The cap as `pod`, a replica of `deployment`, takes part in it."""
    slots = RestartSlots(
        api_client,
        namespace=namespace,
        deployment=deployment,
        identity=pod,
        slots=at_once,
        duration_s=DURATION_S,
        lease_name=CANARY_LEASE,
        noun="canary slots of this namespace",
    )
    events = DecisionEvents(api_client, namespace=namespace, deployment=deployment, pod=pod)
    return CanaryCap(slots, events)
