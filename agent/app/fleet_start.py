"""At start-up, a replica takes over the guards its Deployment kept: the restarts and the
breaker of a pod that is gone (an eviction, a node drain, a rolling update) count on in the
pod that replaced it, whose own SQLite started empty on its emptyDir."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from kvpilot.agent.remediation import Remediator
from kvpilot.agent.runtimes import RuntimeFailure
from kvpilot.agent.runtimes.kubernetes.fleet.kept_guards import PodRecord
from kvpilot.agent.runtimes.kubernetes.fleet.owner import replica_names
from kvpilot.agent.runtimes.kubernetes.pod import PodRuntime

log = logging.getLogger(__name__)


async def take_over_kept_guards(
    runtime: PodRuntime,
    remediator: Remediator,
    *,
    clock: Callable[[], float] = time.monotonic,
    wall_clock: Callable[[], float] = time.time,
) -> PodRecord | None:
    """Seed the stable's restart budget and breaker from the Deployment's kept guards, and
    keep the breaker with every later decision; None where no gate guards the pod runtime or
    the kept guards cannot be read (then the replica starts afresh, and says so)."""
    if runtime.restart_gate is None:
        return None
    gate, stable = runtime.restart_gate, runtime.target.stable_name
    gate.watch_breaker(lambda: remediator.breaker.to_fact(stable, clock(), wall_clock()))
    target = runtime.target
    try:
        alive = await asyncio.to_thread(
            replica_names, runtime.api_client, target.namespace, target.deployment
        )
        record = await asyncio.to_thread(gate.kept.adopt, gate.slots.identity, alive)
    except RuntimeFailure as exc:
        log.warning("fleet: the Deployment's kept guards are not read, starting afresh: %s", exc)
        return None
    now_s, now_wall_s = clock(), wall_clock()
    remediator.budget.seed(
        stable, [now_s - (now_wall_s - s) for s in record.restarts_wall_s], now_s
    )
    if record.breaker:
        remediator.breaker.restore(stable, record.breaker, now_s, now_wall_s)
    return record
