"""One tuner per Deployment: a `coordination.k8s.io/v1` Lease with holder, renewal and expiry.

A lease is free when it has no holder or its holder has not renewed it within its duration,
measured as client-go measures it: on the observer's own monotonic clock, from when it first
saw the lease's current record, never by comparing `renewTime` (another pod's clock) with its
own. Every write carries the resourceVersion that was read, so two tuners racing for a free
lease cannot both win: the loser gets a 409 and sees the winner on the next read.

While held, renewal outlives transient errors (a 500, a 429, a reset): it tries again until
the renew deadline (two thirds of the duration, on its own clock) has passed since the last
renewal that succeeded; then, or when another holder shows, the lease is lost: `lost` is set,
the tuning body is cancelled and every write the runtime would make is refused
(`ensure_ours`). On leaving, the lease is released unless it was lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from kvpilot.agent.runtimes.base import RuntimeFailure
from kvpilot.agent.runtimes.kubernetes.api import Conflict, call, client_module
from kvpilot.agent.runtimes.kubernetes.lease_annotations import AnnotationChange, LeaseAnnotations

log = logging.getLogger(__name__)
RESOURCE = "leases.coordination.k8s.io"  # a literal here: the RBAC test reads it from this module
RELEASE_TRIES = 3
LEASE_SUFFIX = "-kvpilot-tuner"
DEFAULT_DURATION_S = 60


class LeaseHeld(RuntimeFailure):
    """Another tuner holds an unexpired lease on this Deployment."""

    def __init__(self, message: str, holder: str, expires_at_wall_s: float) -> None:
        super().__init__(message)
        self.holder = holder
        self.expires_at_wall_s = expires_at_wall_s


class LeaseLost(RuntimeFailure):
    """The lease this tuner held was taken over or deleted; stop tuning."""


@dataclass(frozen=True, slots=True)
class LeaseRecord:
    """The lease as last written by this tuner."""

    name: str
    holder: str
    acquired_at_wall_s: float
    renewed_at_wall_s: float
    duration_s: int
    transitions_total: int
    resource_version: str


def lease_name(deployment: str) -> str:
    return f"{deployment}{LEASE_SUFFIX}"


def micro_time(wall_s: float) -> str:
    """RFC 3339 with microseconds, as the API's MicroTime fields are written."""
    return datetime.fromtimestamp(wall_s, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _wall_s(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, datetime):
        return value.timestamp()
    return datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()


class DeploymentLease:
    """Acquire, renew and release the tuning lease of one Deployment."""

    def __init__(
        self,
        api_client: Any,
        *,
        namespace: str,
        deployment: str,
        identity: str,
        duration_s: int = DEFAULT_DURATION_S,
        wall_clock: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if duration_s < 1:
            raise ValueError("lease duration must be at least 1 s")
        self._api = client_module().CoordinationV1Api(api_client)
        self.namespace = namespace
        self.name = lease_name(deployment)
        self._lease = LeaseAnnotations(api_client, namespace=namespace, name=self.name)
        self.identity = identity
        self.duration_s = duration_s
        self._wall_clock = wall_clock
        self._clock = clock
        self.record: LeaseRecord | None = None
        self.lost: LeaseLost | None = None  # set when lost while held: writes are refused
        self.renewed_at_s: float | None = None  # own clock, the last renewal that succeeded
        self.renew_failures_total = 0
        # (holder, renewTime, resourceVersion) of another holder's record, and when (own
        # clock) this observer first saw it: expiry is measured from there.
        self._observed: tuple[tuple[str, str, str], float] | None = None

    def _what(self) -> str:
        return f"Lease {self.namespace}/{self.name}"

    def _read(self) -> Any | None:
        return self._lease.read()

    def _spec(self, *, acquired_s: float, now_s: float, transitions: int) -> Any:
        client = client_module()
        # MicroTime strings, not datetimes: the client would write datetimes without the
        # fixed six fraction digits the API's MicroTime format asks for.
        return client.V1LeaseSpec(
            holder_identity=self.identity,
            lease_duration_seconds=self.duration_s,
            acquire_time=micro_time(acquired_s),
            renew_time=micro_time(now_s),
            lease_transitions=transitions,
        )

    def _record(self, lease: Any) -> LeaseRecord:
        spec = lease.spec
        record = LeaseRecord(
            name=self.name,
            holder=spec.holder_identity,
            acquired_at_wall_s=_wall_s(spec.acquire_time) or 0.0,
            renewed_at_wall_s=_wall_s(spec.renew_time) or 0.0,
            duration_s=int(spec.lease_duration_seconds),
            transitions_total=int(spec.lease_transitions or 0),
            resource_version=lease.metadata.resource_version,
        )
        self.record = record
        self.renewed_at_s = self._clock()
        return record

    def ensure_ours(self) -> None:
        """Refuse a write once this tuner has lost the lease (another may tune by now)."""
        if self.lost is not None:
            raise LeaseLost(f"refused: {self.lost}")

    def remaining_s(self, lease: Any) -> float | None:
        """How long the current holder's claim still runs on this observer's clock: its
        duration from when this record (holder, renewTime, resourceVersion) was first seen
        here; None when nobody holds it."""
        spec = lease.spec
        if spec is None or not spec.holder_identity:
            return None
        key = (
            str(spec.holder_identity),
            str(spec.renew_time),
            str(lease.metadata.resource_version),
        )
        now_s = self._clock()
        if self._observed is None or self._observed[0] != key:
            self._observed = (key, now_s)
        seen_s = now_s - self._observed[1]
        return float(spec.lease_duration_seconds or 0) - seen_s

    def expires_at_wall_s(self, lease: Any) -> float | None:
        """When the current holder's claim runs out, as a time on this pod's wall clock."""
        remaining = self.remaining_s(lease)
        return None if remaining is None else self._wall_clock() + remaining

    def acquire(self) -> LeaseRecord:
        """Take the lease (create it, take it over once expired, or re-take our own)."""
        record = self._acquire()
        self.lost = None
        return record

    def _acquire(self) -> LeaseRecord:
        client = client_module()
        now_s = self._wall_clock()
        current = self._read()
        if current is None:
            body = client.V1Lease(
                api_version="coordination.k8s.io/v1",
                kind="Lease",
                metadata=client.V1ObjectMeta(name=self.name, namespace=self.namespace),
                spec=self._spec(acquired_s=now_s, now_s=now_s, transitions=0),
            )
            try:
                created = call(
                    self._api.create_namespaced_lease,
                    self.namespace,
                    body,
                    verb="create",
                    resource=RESOURCE,
                    what=self._what(),
                )
            except Conflict:
                return self._after_race()
            return self._record(created)
        spec = current.spec or client.V1LeaseSpec()
        holder = spec.holder_identity
        remaining = self.remaining_s(current) if holder != self.identity else None
        if holder and remaining is not None and remaining > 0:
            raise LeaseHeld(
                f"{self._what()} is held by {holder!r} for another {remaining:.0f} s at most "
                "(unless it renews): another tuner is running on this Deployment",
                holder,
                now_s + remaining,
            )
        ours = holder == self.identity
        acquired_s = (_wall_s(spec.acquire_time) or now_s) if ours else now_s
        transitions = int(spec.lease_transitions or 0) + (0 if ours or not holder else 1)
        current.spec = self._spec(acquired_s=acquired_s, now_s=now_s, transitions=transitions)
        try:
            return self._replace(current, verb="update")
        except Conflict:
            return self._after_race()

    def _after_race(self) -> LeaseRecord:
        """Another writer changed the lease between our read and write: see who won."""
        current = self._read()
        holder = None if current is None or current.spec is None else current.spec.holder_identity
        if current is not None and holder == self.identity:
            return self._record(current)
        expires = None if current is None else self.expires_at_wall_s(current)
        raise LeaseHeld(
            f"{self._what()} was taken by {holder!r} while kvpilot tried to acquire it",
            str(holder),
            expires or self._wall_clock(),
        )

    def _replace(self, lease: Any, *, verb: str) -> LeaseRecord:
        replaced = call(
            self._api.replace_namespaced_lease,
            self.name,
            self.namespace,
            lease,
            verb=verb,
            resource=RESOURCE,
            what=self._what(),
        )
        return self._record(replaced)

    def renew(self) -> LeaseRecord:
        """Extend our claim; LeaseLost if someone else holds the lease now. A write that meets
        another's change reads the Lease again: a new holder is named, and a Lease still ours
        (an annotation written meanwhile) is renewed on that read, once."""
        conflict: Conflict | None = None
        for _ in range(2):
            current = self._read()
            holder = (
                None if current is None or current.spec is None else current.spec.holder_identity
            )
            if current is None or holder != self.identity:
                self.record = None
                raise LeaseLost(f"{self._what()} is no longer ours (holder now: {holder!r})")
            self._observed = None
            spec = current.spec
            acquired_s = _wall_s(spec.acquire_time) or self._wall_clock()
            current.spec = self._spec(
                acquired_s=acquired_s,
                now_s=self._wall_clock(),
                transitions=int(spec.lease_transitions or 0),
            )
            try:
                return self._replace(current, verb="update")
            except Conflict as exc:
                conflict = exc
        self.record = None
        raise LeaseLost(f"{self._what()} changed under us while renewing: {conflict}")

    def annotations(self) -> dict[str, str]:
        """The Lease's annotations (where kvpilot vouches for a handover); {} when absent."""
        current = self._read()
        if current is None or current.metadata is None:
            return {}
        return dict(current.metadata.annotations or {})

    def annotate(self, changes: dict[str, str | None]) -> bool:
        """Set (None: remove) annotations on the Lease while it is ours or free, creating a
        free Lease when there is none; False when another tuner holds it (or took it while
        writing): only the holder speaks through its Lease."""

        def unless_held(current: Any | None) -> AnnotationChange | None:
            holder = (
                None if current is None or current.spec is None else current.spec.holder_identity
            )
            if holder not in (None, "", self.identity):
                return None
            created = None if current is not None else self._free_spec()
            return AnnotationChange(changes, spec=created)

        return self._lease.edit(unless_held, tries=1)

    def _free_spec(self) -> Any:
        """The spec of a Lease created free, to carry annotations before any tuner holds it."""
        return client_module().V1LeaseSpec(lease_duration_seconds=self.duration_s)

    def release_quietly(self) -> bool:
        """`release`, tried RELEASE_TRIES times over transient errors; a lease that cannot be
        released is logged and lapses by its duration (False)."""
        for attempt in range(1, RELEASE_TRIES + 1):
            try:
                return self.release()
            except RuntimeFailure as exc:
                log.warning("releasing %s failed (try %d): %s", self._what(), attempt, exc)
        self.record = None
        return False

    def release(self) -> bool:
        """Give the lease up so the next tuner need not wait for expiry; False if not ours.
        A conflict is read again: it may be this pod's own renewal, whose thread a cancelled
        renewer could not stop, landing between the read and the write."""
        for _ in range(RELEASE_TRIES):
            current = self._read()
            self.record = None
            if (
                current is None
                or current.spec is None
                or current.spec.holder_identity != self.identity
            ):
                return False
            client = client_module()
            current.spec = client.V1LeaseSpec(
                lease_duration_seconds=current.spec.lease_duration_seconds,
                lease_transitions=current.spec.lease_transitions,
                acquire_time=micro_time(_wall_s(current.spec.acquire_time) or self._wall_clock()),
                renew_time=micro_time(self._wall_clock()),
            )
            try:
                call(
                    self._api.replace_namespaced_lease,
                    self.name,
                    self.namespace,
                    current,
                    verb="update",
                    resource=RESOURCE,
                    what=self._what(),
                )
            except Conflict:
                continue  # read again: still ours, or someone else's now
            return True
        return False

    @contextlib.asynccontextmanager
    async def held(self, *, renew_every_s: float | None = None) -> AsyncIterator[LeaseRecord]:
        """Hold the lease for a tuning run: acquire, renew in the background, release.

        A renewal that fails is tried again (every quarter of the renew period) until the
        renew deadline passes on this pod's clock; a lease lost (taken over, or not renewed
        within the deadline) cancels the body's task, so a tuner that lost its lease stops
        instead of racing the new holder, and the body sees LeaseLost.
        """
        every_s = renew_every_s if renew_every_s is not None else self.duration_s / 3
        record = await asyncio.to_thread(self.acquire)
        body = asyncio.current_task()

        def lose(exc: LeaseLost) -> None:
            self.lost, self.record = exc, None
            log.error("%s", exc)
            if body is not None:
                body.cancel(msg=str(exc))  # what the trial cut off records as its reason

        async def renew_loop() -> None:
            wait_s = every_s
            while True:
                await asyncio.sleep(wait_s)
                try:
                    await asyncio.to_thread(self.renew)
                    wait_s = every_s
                except LeaseLost as exc:
                    lose(exc)
                    return
                except RuntimeFailure as exc:
                    self.renew_failures_total += 1
                    since_s = self._clock() - (self.renewed_at_s or self._clock())
                    if since_s >= self.renew_deadline_s:
                        lose(
                            LeaseLost(
                                f"{self._what()} not renewed for {since_s:.0f} s, past its renew "
                                f"deadline of {self.renew_deadline_s:.0f} s (last: {exc})"
                            )
                        )
                        return
                    log.warning("renewing %s failed, trying again: %s", self._what(), exc)
                    wait_s = every_s / 4

        renewer = asyncio.create_task(renew_loop())
        try:
            yield record
        except asyncio.CancelledError:
            if self.lost is not None:
                raise self.lost from None
            raise
        finally:
            renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewer
            if self.lost is None:
                await asyncio.to_thread(self.release_quietly)

    @property
    def renew_deadline_s(self) -> float:
        """How long renewal may fail before this tuner gives the lease up: two thirds of the
        duration, so it stops before any observer counts the lease expired."""
        return self.duration_s * 2 / 3
