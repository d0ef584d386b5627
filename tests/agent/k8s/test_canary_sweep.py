"""Canaries nobody attends are looked for on a schedule of their own, not only when a tuning
run begins: the pod's sweep takes the Lease, removes a canary no trial owns and audits it;
it is skipped while another tuner holds the Lease (its canary is attended) and while a run
of this pod is under way. Against the fake API server (a fake: no API server runs here) and
a stand-in vLLM."""

from __future__ import annotations

import asyncio

from apscheduler.schedulers.asyncio import AsyncIOScheduler

from kvpilot.agent.runtimes.kubernetes.lease import DeploymentLease
from kvpilot.agent.runtimes.kubernetes.unattended import UNATTENDED
from kvpilot.agent.state.trials import SqliteRolloutJournal
from kvpilot.agent.tuning.canary_sweep import SWEEP_EVERY_S
from kvpilot.agent.tuning.held import WATCH_EVERY_S
from kvpilot.tuner.rollout.record import Phase, RolloutRecord, Strategy
from tests.agent.k8s.conftest import NAMESPACE, base_deployment
from tests.agent.k8s.test_live_traffic_adapter import CANARY
from tests.agent.k8s.test_orphan_canary import evicted_mid_trial
from tests.agent.k8s.test_pod_schedule import scheduled


def test_a_canary_left_after_start_up_is_removed_by_the_next_sweep(fake, standin, tmp_path) -> None:
    fake.add_deployment(base_deployment(standin.port))
    tuning, store = scheduled(fake, tmp_path / "a", standin.port)
    assert tuning.sweep is not None

    async def main() -> str:
        await tuning.start_up()  # nothing to recover yet
        await asyncio.to_thread(
            evicted_mid_trial, fake, standin, tmp_path / "b"
        )  # later: B evicted mid-trial
        return await tuning.sweep.run()

    outcome = asyncio.run(main())

    assert outcome == "swept"
    assert fake.deployment(NAMESPACE, CANARY) is None
    reasons = [a.reason for a in store.audit_records()]
    assert any(f"removed the orphaned canary {NAMESPACE}/{CANARY}" in r for r in reasons)
    assert (f"{NAMESPACE}/vllm", 0.0) in UNATTENDED.series()  # found, then cleaned up
    lease = fake.leases[(NAMESPACE, "vllm-kvpilot-tuner")]
    assert lease["spec"].get("holderIdentity") in (None, "")  # given back
    store.close()


def test_the_sweep_leaves_the_canary_of_the_tuner_holding_the_lease(
    fake, standin, tmp_path
) -> None:
    fake.add_deployment(base_deployment(standin.port))
    tuning, store = scheduled(fake, tmp_path / "a", standin.port)
    other = DeploymentLease(
        fake.api_client(), namespace=NAMESPACE, deployment="vllm", identity="pod-b"
    )
    assert tuning.sweep is not None

    async def main() -> str:
        await tuning.start_up()
        await asyncio.to_thread(evicted_mid_trial, fake, standin, tmp_path / "b")
        await asyncio.to_thread(other.acquire)  # B is alive and tuning: its canary
        return await tuning.sweep.run()

    outcome = asyncio.run(main())

    assert outcome.startswith("skipped: ") and "held by 'pod-b'" in outcome, outcome
    assert fake.deployment(NAMESPACE, CANARY) is not None
    store.close()


def test_no_sweep_while_a_run_of_this_pod_is_under_way(fake, standin, tmp_path) -> None:
    fake.add_deployment(base_deployment(standin.port))
    tuning, store = scheduled(fake, tmp_path / "a", standin.port)
    sweep = tuning.sweep
    assert sweep is not None

    async def main() -> str:
        await tuning.start_up()
        await asyncio.to_thread(evicted_mid_trial, fake, standin, tmp_path / "b")
        async with sweep._guard:  # as a run holds it
            return await sweep.run()

    outcome = asyncio.run(main())

    assert outcome.startswith("skipped: a tuning run"), outcome
    assert fake.deployment(NAMESPACE, CANARY) is not None
    assert sweep.sweeps_total == 0
    store.close()


def test_the_sweep_is_scheduled_beside_the_tuning_runs(fake, tmp_path) -> None:
    fake.add_deployment(base_deployment(8000))
    tuning, store = scheduled(fake, tmp_path, 8000)

    async def main() -> list[str]:
        scheduler = AsyncIOScheduler()
        tuning.add_to(scheduler)
        job = scheduler.get_job("canary-sweep")
        assert job is not None and job.trigger.interval.total_seconds() == SWEEP_EVERY_S
        return [j.id for j in scheduler.get_jobs()]

    assert asyncio.run(main()) == ["tuning", "canary-sweep"]
    store.close()


def test_a_canary_held_for_review_is_not_swept(fake, standin, tmp_path) -> None:
    fake.add_deployment(base_deployment(standin.port))
    tuning, store = scheduled(fake, tmp_path / "a", standin.port)
    assert tuning.sweep is not None
    held = RolloutRecord("t1", Strategy.PARALLEL, Phase.HELD, (), (), 1.0, reason="held for review")

    async def main() -> str:
        await tuning.start_up()
        await asyncio.to_thread(evicted_mid_trial, fake, standin, tmp_path / "b")
        SqliteRolloutJournal(store.db).save(held)  # its canary waits for a person
        return await tuning.sweep.run()

    assert asyncio.run(main()) == "swept"  # the sweep ran, and left it
    assert fake.deployment(NAMESPACE, CANARY) is not None
    reasons = [a.reason for a in store.audit_records()]
    assert not any("removed the orphaned canary" in r for r in reasons)
    store.close()


def test_held_canaries_are_watched_beside_the_runs_only_where_they_may_be_held(
    fake, tmp_path
) -> None:
    fake.add_deployment(base_deployment(8000))
    plain, plain_store = scheduled(fake, tmp_path / "a", 8000)
    holding, store = scheduled(
        fake, tmp_path / "b", 8000, hold_inconclusive=True, hold_timeout_s=600
    )
    assert plain.held is None and holding.held is not None

    async def main() -> list[str]:
        scheduler = AsyncIOScheduler()
        holding.add_to(scheduler)
        job = scheduler.get_job("tuning-held")
        assert job is not None and job.trigger.interval.total_seconds() == WATCH_EVERY_S
        return [j.id for j in scheduler.get_jobs()]

    assert asyncio.run(main()) == ["tuning", "canary-sweep", "tuning-held"]
    plain_store.close()
    store.close()
