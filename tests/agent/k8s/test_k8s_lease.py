"""The tuning Lease against the fake API server, on an injected clock (wall and monotonic
alike: expiry is measured on the observer's own clock, from when it first saw a record)."""

from __future__ import annotations

import asyncio
import re

import pytest

from kvpilot.agent.runtimes.kubernetes.lease import DeploymentLease, LeaseHeld, LeaseLost
from tests.agent.k8s.conftest import NAMESPACE

T0 = 1_700_000_000.0


class Clock:
    def __init__(self) -> None:
        self.now_s = T0

    def __call__(self) -> float:
        return self.now_s


def lease(fake, identity: str, clock: Clock, duration_s: int = 30) -> DeploymentLease:
    return DeploymentLease(
        fake.api_client(),
        namespace=NAMESPACE,
        deployment="vllm",
        identity=identity,
        duration_s=duration_s,
        wall_clock=clock,
        clock=clock,
    )


def observe(candidate: DeploymentLease) -> None:
    """The candidate reads the lease and finds it held: its expiry clock starts here."""
    with pytest.raises(LeaseHeld):
        candidate.acquire()


def stored(fake) -> dict:
    return fake.leases[(NAMESPACE, "vllm-kvpilot-tuner")]


def test_acquire_renew_release(fake) -> None:
    clock = Clock()
    a = lease(fake, "pod-a", clock)

    record = a.acquire()
    assert (record.holder, record.acquired_at_wall_s, record.duration_s) == ("pod-a", T0, 30)
    assert stored(fake)["spec"]["renewTime"] == "2023-11-14T22:13:20.000000Z"

    clock.now_s += 20
    renewed = a.renew()
    assert renewed.renewed_at_wall_s == T0 + 20
    assert renewed.acquired_at_wall_s == T0

    assert a.release() is True
    assert "holderIdentity" not in stored(fake)["spec"]
    b = lease(fake, "pod-b", clock)
    assert b.acquire().holder == "pod-b"  # free at once after a release


def test_conflict_names_the_holder_then_takeover_after_expiry(fake) -> None:
    clock = Clock()
    lease(fake, "pod-a", clock).acquire()
    b = lease(fake, "pod-b", clock)
    observe(b)

    clock.now_s += 29
    with pytest.raises(LeaseHeld, match="held by 'pod-a'") as caught:
        b.acquire()
    assert caught.value.holder == "pod-a"
    assert caught.value.expires_at_wall_s == T0 + 30

    clock.now_s = T0 + 31
    record = b.acquire()
    assert (record.holder, record.transitions_total, record.acquired_at_wall_s) == (
        "pod-b",
        1,
        T0 + 31,
    )


def test_the_old_holder_learns_it_lost(fake) -> None:
    clock = Clock()
    a = lease(fake, "pod-a", clock)
    a.acquire()
    b = lease(fake, "pod-b", clock)
    observe(b)
    clock.now_s += 31
    b.acquire()
    with pytest.raises(LeaseLost, match="pod-b"):
        a.renew()
    assert a.release() is False
    assert stored(fake)["spec"]["holderIdentity"] == "pod-b"


def test_a_race_lost_on_resource_version_reports_the_winner(fake) -> None:
    clock = Clock()
    lease(fake, "pod-a", clock).acquire()
    b = lease(fake, "pod-b", clock)
    observe(b)
    clock.now_s += 31
    fake.fail("PUT", r"/leases/vllm-kvpilot-tuner$", 409)
    with pytest.raises(LeaseHeld, match="taken by 'pod-a'"):
        b.acquire()


def test_held_renews_in_the_background_and_releases(fake) -> None:
    clock = Clock()
    a = lease(fake, "pod-a", clock)

    async def run() -> int:
        async with a.held(renew_every_s=0.01):
            versions = {stored(fake)["metadata"]["resourceVersion"]}
            deadline = asyncio.get_running_loop().time() + 5
            while len(versions) < 3 and asyncio.get_running_loop().time() < deadline:
                clock.now_s += 1
                await asyncio.sleep(0.01)
                versions.add(stored(fake)["metadata"]["resourceVersion"])
            return len(versions)

    assert asyncio.run(run()) >= 3  # renewed at least twice
    assert "holderIdentity" not in stored(fake)["spec"]


def test_forbidden_update_names_the_verb(fake) -> None:
    clock = Clock()
    lease(fake, "pod-a", clock).acquire()
    fake.forbid("update", "leases")
    with pytest.raises(Exception, match=re.escape("'update' leases.coordination.k8s.io")):
        lease(fake, "pod-a", clock).renew()
