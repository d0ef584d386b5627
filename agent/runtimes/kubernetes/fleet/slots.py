"""The restart budget of one Deployment across its replicas: at most N restarting at once.

The slots live on one `coordination.k8s.io/v1` Lease, `<deployment>-kvpilot-restarts`, whose
annotation `kvpilot.dev/restart-holders` maps each holder (a pod) to when it took and last
renewed its slot. Expiry is measured as client-go measures a Lease's: on each observer's own
monotonic clock, from when it first saw a holder's current renewal, so a holder that died
frees its slot after the lease duration without anyone comparing another pod's clock. Every
write carries the resourceVersion read: two pods racing for the last slot cannot both win.
Blocking calls: run them in a worker thread.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvpilot.agent.runtimes.kubernetes.api import client_module
from kvpilot.agent.runtimes.kubernetes.lease_annotations import AnnotationChange, LeaseAnnotations

HOLDERS_KEY = "kvpilot.dev/restart-holders"
SUFFIX = "-kvpilot-restarts"
DEFAULT_DURATION_S = 30


@dataclass(frozen=True, slots=True)
class SlotAnswer:
    """Whether this pod may restart now, who holds the slots, and why, in words."""

    granted: bool
    holders: tuple[str, ...]
    reason: str


def slots_name(deployment: str) -> str:
    return f"{deployment}{SUFFIX}"


class RestartSlots:
    """Take, renew and give back one of a Deployment's restart slots."""

    def __init__(
        self,
        api_client: Any,
        *,
        namespace: str,
        deployment: str,
        identity: str,
        slots: int = 1,
        duration_s: int = DEFAULT_DURATION_S,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        lease_name: str | None = None,
        noun: str = "restart slots of this Deployment",
    ) -> None:
        if slots < 1 or duration_s < 1:
            raise ValueError("a restart budget needs at least one slot and a 1 s duration")
        self.namespace = namespace
        # `lease_name`, `noun`: the same slots for another budget (the namespace's canaries).
        self.name = lease_name or slots_name(deployment)
        self._lease = LeaseAnnotations(api_client, namespace=namespace, name=self.name)
        self.noun = noun
        self.identity = identity
        self.slots = slots
        self.duration_s = duration_s
        self._clock = clock
        self._wall_clock = wall_clock
        # holder -> (its renewal as last seen, when this observer first saw that renewal)
        self._seen: dict[str, tuple[float, float]] = {}

    def _live(self, lease: Any | None) -> dict[str, dict[str, Any]]:
        """The holders whose claim has not run out on this observer's clock (ours always)."""
        if lease is None:
            return {}
        raw = (lease.metadata.annotations or {}).get(HOLDERS_KEY) or "{}"
        try:
            holders = json.loads(raw)
        except json.JSONDecodeError:
            holders = {}  # a hand-edited annotation: nobody's claim can be read from it
        now_s, live = self._clock(), {}
        for holder, claim in holders.items() if isinstance(holders, dict) else ():
            renewed = float((claim or {}).get("renewed_wall_s") or 0.0)
            seen = self._seen.get(holder)
            if seen is None or seen[0] != renewed:
                self._seen[holder] = seen = (renewed, now_s)
            if holder == self.identity or now_s - seen[1] < self.duration_s:
                live[holder] = claim
        return live

    def _change(self, holders: dict[str, dict[str, Any]]) -> AnnotationChange:
        """The holders written: the annotation, and the spec that names them for people."""
        spec = client_module().V1LeaseSpec(
            holder_identity=",".join(sorted(holders)) or None,
            lease_duration_seconds=self.duration_s,
        )
        return AnnotationChange({HOLDERS_KEY: json.dumps(holders, sort_keys=True)}, spec)

    def look(self) -> SlotAnswer:
        """Whether a slot is free now (or ours), without taking it: one read, what a waiting
        replica asks at each poll before it asks anything dearer."""
        live = self._live(self._lease.read())
        others = tuple(sorted(h for h in live if h != self.identity))
        if self.identity not in live and len(live) >= self.slots:
            return SlotAnswer(False, others, self._held(live, others))
        return SlotAnswer(
            True, others, f"a restart slot is free ({len(live)} of {self.slots} held)"
        )

    def _held(self, live: dict[str, dict[str, Any]], others: tuple[str, ...]) -> str:
        return (
            f"{len(live)} of {self.slots} {self.noun} are held "
            f"(by {', '.join(others)}): waiting for a turn"
        )

    def try_take(self, why: str) -> SlotAnswer:
        """Take a free slot (or keep ours); when none is free, who holds them."""
        lease = self._lease.read()
        live = self._live(lease)
        others = tuple(sorted(h for h in live if h != self.identity))
        if self.identity not in live and len(live) >= self.slots:
            return SlotAnswer(False, others, self._held(live, others))
        now = self._wall_clock()
        claim = live.get(self.identity) or {"since_wall_s": now, "why": why[:200]}
        live[self.identity] = {**claim, "renewed_wall_s": now}
        if not self._lease.write(lease, self._change(live)):
            return SlotAnswer(False, others, "another replica changed the restart slots: again")
        return SlotAnswer(
            True, others, f"slot taken ({len(live)} of {self.slots} {self.noun} held)"
        )

    def renew(self) -> bool:
        """Renew our slot; False when it is not ours any more."""
        return self.try_take("renewal").granted

    def give_back(self) -> None:
        """Free our slot, so the next replica need not wait for it to expire."""

        def without_us(lease: Any | None) -> AnnotationChange | None:
            live = self._live(lease)
            if self.identity not in live:
                return None
            del live[self.identity]
            return self._change(live)

        self._lease.edit(without_us, tries=3)
