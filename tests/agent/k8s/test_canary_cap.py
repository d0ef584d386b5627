"""The namespace-wide cap on concurrent canaries: a Lease of slots across Deployments; a
run that finds them held is skipped, audited, and says why in an Event on its pod and its
Deployment. Against the fake API server (it validates Leases and Events)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvpilot.agent.runtimes.kubernetes.fleet.decision_events import TUNING_SKIPPED
from kvpilot.agent.tuning.pod.canary_cap import (
    CANARY_LEASE,
    CanaryCapFull,
    namespace_canary_cap,
)
from kvpilot.agent.tuning.schedule import ScheduledTuning
from tests.agent.k8s.conftest import NAMESPACE
from tests.fakes.k8s_apiserver import FakeKubernetesApi


def _cap(fake: FakeKubernetesApi, deployment: str, pod: str, at_once: int = 1) -> Any:
    return namespace_canary_cap(
        fake.api_client(), namespace=NAMESPACE, deployment=deployment, pod=pod, at_once=at_once
    )


def _skipped_events(fake: FakeKubernetesApi) -> list[dict[str, Any]]:
    return [e for e in fake.events.values() if e["reason"] == TUNING_SKIPPED]


def test_one_canary_at_a_time_across_the_namespace(fake: FakeKubernetesApi) -> None:
    first = _cap(fake, "llama-deployment-vllm", "llama-deployment-vllm-7d9f-a")
    second = _cap(fake, "qwen-deployment-vllm", "qwen-deployment-vllm-5c4b-b")

    async def scenario() -> str:
        async with first.turn():
            with pytest.raises(CanaryCapFull) as caught:
                async with second.turn():
                    pass
        async with second.turn():  # given back: the next Deployment's turn
            held = fake.leases[(NAMESPACE, CANARY_LEASE)]
            assert "qwen-deployment-vllm-5c4b-b" in held["spec"]["holderIdentity"]
        return str(caught.value)

    why = asyncio.run(scenario())

    assert "1 of 1 canary slots of this namespace are held" in why
    assert "llama-deployment-vllm-7d9f-a" in why
    skipped = _skipped_events(fake)
    assert {(e["involvedObject"]["kind"], e["involvedObject"]["name"]) for e in skipped} == {
        ("Pod", "qwen-deployment-vllm-5c4b-b"),
        ("Deployment", "qwen-deployment-vllm"),
    }
    assert all(e["type"] == "Normal" and "tuning skipped" in e["message"] for e in skipped)
    assert "holderIdentity" not in fake.leases[(NAMESPACE, CANARY_LEASE)]["spec"]  # all free


def test_a_cap_of_two_lets_two_deployments_tune(fake: FakeKubernetesApi) -> None:
    caps = [_cap(fake, f"m{i}-deployment-vllm", f"m{i}-pod", at_once=2) for i in range(3)]

    async def scenario() -> None:
        async with caps[0].turn(), caps[1].turn():
            with pytest.raises(CanaryCapFull):
                async with caps[2].turn():
                    pass

    asyncio.run(scenario())
    assert len(_skipped_events(fake)) == 2  # the third, on its pod and its Deployment


def test_a_scheduled_run_that_finds_the_cap_full_is_skipped_and_audited(
    fake: FakeKubernetesApi,
) -> None:
    holder = _cap(fake, "llama-deployment-vllm", "llama-pod")
    waiting = _cap(fake, "qwen-deployment-vllm", "qwen-pod")
    audits: list[tuple[str, str]] = []
    ran: list[str] = []

    async def run_once() -> str:
        async with waiting.turn():
            ran.append("canary")
        return "ran"

    tuning = ScheduledTuning(
        "0 3 * * *",
        run_once,
        remediation_in_progress=lambda: False,
        audit=lambda decision, reason: audits.append((decision, reason)),
    )

    async def scenario() -> str:
        await tuning.start_up()
        async with holder.turn():
            return await tuning.fire()

    said = asyncio.run(scenario())

    assert ran == []  # no canary asked for GPUs
    assert said.startswith("skipped: tuning skipped: 1 of 1 canary slots")
    assert audits[-1][0] == "skipped" and "llama-pod" in audits[-1][1]
