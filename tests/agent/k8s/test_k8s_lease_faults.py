"""The tuning Lease on a bad day, against the fake API server's injected faults (no real API
server runs here): transient errors, a lease taken over, a holder whose clock lags."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvpilot.agent.runtimes.kubernetes.lease import LeaseHeld, LeaseLost
from kvpilot.agent.runtimes.kubernetes.runtime import KubernetesRuntime, KubernetesTarget
from tests.agent.k8s.conftest import NAMESPACE, base_deployment
from tests.agent.k8s.test_k8s_lease import T0, Clock, lease, stored

LEASE_PATH = r"/leases/vllm-kvpilot-tuner$"


def test_expiry_is_measured_on_the_observers_clock_not_the_holders(fake) -> None:
    behind = Clock()
    behind.now_s = T0 - 600  # pod-a's wall clock is ten minutes behind pod-b's
    a = lease(fake, "pod-a", behind)
    a.acquire()
    clock = Clock()
    b = lease(fake, "pod-b", clock)

    for _ in range(4):  # pod-a renews every 20 s: held for 80 s, though renewTime looks old
        with pytest.raises(LeaseHeld, match="held by 'pod-a'"):
            b.acquire()
        clock.now_s += 20
        behind.now_s += 20
        a.renew()
    with pytest.raises(LeaseHeld):
        b.acquire()  # pod-a's last renewal, first seen now
    clock.now_s += 31  # pod-a stopped renewing: 31 s on pod-b's own clock
    assert b.acquire().holder == "pod-b"


def test_renewal_outlives_transient_errors_and_releases_on_leaving(fake) -> None:
    clock = Clock()
    a = lease(fake, "pod-a", clock)

    async def run() -> set[str]:
        async with a.held(renew_every_s=0.02):
            fake.fail("PUT", LEASE_PATH, 500)  # the next renewals fail once each way
            fake.fail("GET", LEASE_PATH, 429)
            versions = {stored(fake)["metadata"]["resourceVersion"]}
            deadline = time.monotonic() + 5
            while (a.renew_failures_total < 2 or len(versions) < 3) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
                versions.add(stored(fake)["metadata"]["resourceVersion"])
            return versions

    versions = asyncio.run(run())

    assert a.renew_failures_total == 2 and len(versions) >= 3  # renewed after both errors
    assert a.lost is None
    assert "holderIdentity" not in stored(fake)["spec"]  # released


def test_a_release_that_meets_its_own_renewal_is_read_again_and_made(fake) -> None:
    """A renewal's thread outlives its cancelled renewer: its write can land between the
    release's read and write, and the release's write then conflicts."""
    clock = Clock()
    a = lease(fake, "pod-a", clock)
    a.acquire()
    fake.fail("PUT", LEASE_PATH, 409)  # the release's first write: the record moved on

    assert a.release() is True
    assert "holderIdentity" not in stored(fake)["spec"]  # given back, not left to lapse


def test_a_renewal_that_meets_a_takeover_names_the_new_holder(fake) -> None:
    """Pod C takes the Lease between this renewal's read and its write: the write conflicts,
    and the Lease read again names who holds it now."""
    clock = Clock()
    a = lease(fake, "pod-a", clock)
    a.acquire()
    write = a._replace

    def taken_first(current: object, *, verb: str) -> object:
        fake.take_lease(NAMESPACE, a.name, "pod-c")
        return write(current, verb=verb)

    a._replace = taken_first  # type: ignore[method-assign]
    with pytest.raises(LeaseLost, match="holder now: 'pod-c'"):
        a.renew()


def test_a_renewal_that_meets_an_annotation_is_made_on_a_second_read(fake) -> None:
    clock = Clock()
    a = lease(fake, "pod-a", clock)
    a.acquire()
    before = stored(fake)["metadata"]["resourceVersion"]
    fake.fail("PUT", LEASE_PATH, 409)  # another write landed between the read and the write
    assert a.renew().holder == "pod-a"
    assert stored(fake)["metadata"]["resourceVersion"] != before
    fake.fail("PUT", LEASE_PATH, 409, times=2)
    with pytest.raises(LeaseLost, match="changed under us while renewing"):
        a.renew()


def test_a_release_that_finds_another_holder_leaves_the_lease_alone(fake) -> None:
    clock = Clock()
    a = lease(fake, "pod-a", clock)
    a.acquire()
    stored(fake)["spec"]["holderIdentity"] = "pod-b"

    assert a.release() is False
    assert stored(fake)["spec"]["holderIdentity"] == "pod-b"


def runtime(fake, tmp_path, port: int) -> KubernetesRuntime:
    target = KubernetesTarget(
        namespace=NAMESPACE,
        deployment="vllm",
        port=port,
        stable_url=f"http://127.0.0.1:{port}",
        state_dir=tmp_path,
    )
    return KubernetesRuntime(
        target, fake.api_client(), identity="pod-a", lease_duration_s=1, poll_s=0.01
    )


def hold_until_lost(rt: KubernetesRuntime, fault) -> LeaseLost:
    async def run() -> None:
        async with rt.lease.held():
            fault()
            await asyncio.sleep(10)

    with pytest.raises(LeaseLost) as caught:
        asyncio.run(asyncio.wait_for(run(), timeout=8))
    return caught.value


def test_a_lease_not_renewed_by_its_deadline_is_given_up_and_writes_are_refused(
    fake, tmp_path
) -> None:
    fake.add_deployment(base_deployment(8000))
    rt = runtime(fake, tmp_path, 8000)

    started = time.monotonic()
    lost = hold_until_lost(rt, lambda: fake.fail("GET", LEASE_PATH, 500, times=1000))

    assert "renew deadline" in str(lost) and time.monotonic() - started < 3
    writes = len(fake.writes())
    with pytest.raises(LeaseLost, match="refused"):
        asyncio.run(rt.start_canary(None, ready_timeout_s=5))
    with pytest.raises(LeaseLost, match="refused"):
        asyncio.run(rt.promote(["--max-num-seqs=8"], ready_timeout_s=5))
    assert len(fake.writes()) == writes  # nothing written after the loss


def test_a_lease_taken_over_stops_the_tuner_and_leaves_the_new_holders_canary(
    fake, standin, tmp_path
) -> None:
    fake.add_deployment(base_deployment(standin.port))
    rt = runtime(fake, tmp_path, standin.port)

    async def run() -> None:
        async with rt.lease.held():
            await rt.start_canary(None, ready_timeout_s=5)
            record = stored(fake)
            record["spec"]["holderIdentity"] = "pod-b"  # another replica takes the Lease
            record["metadata"]["resourceVersion"] += "0"
            await asyncio.sleep(10)

    with pytest.raises(LeaseLost, match="pod-b"):
        asyncio.run(asyncio.wait_for(run(), timeout=8))
    with pytest.raises(LeaseLost, match="refused"):
        asyncio.run(rt.stop(rt.target.canary_name, drain_timeout_s=1))

    assert fake.deployment(NAMESPACE, "vllm-kvpilot-canary") is not None  # pod-b's now
    assert fake.writes("DELETE") == []
    assert stored(fake)["spec"]["holderIdentity"] == "pod-b"  # not released by pod-a
