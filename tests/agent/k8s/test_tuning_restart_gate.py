"""Tuning on the pod runtime through the fleet's objects: a promotion the restart budget
refuses is a refused restart, not a candidate that failed to start; and each trial's start
and end, a promotion and a rollback are told to the runtime, which writes them as Events."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, cast

import pytest

from kvpilot.agent.runtimes.kubernetes.fleet.decision_events import (
    PROMOTED,
    ROLLED_BACK,
    TRIAL_ENDED,
    TRIAL_STARTED,
)
from kvpilot.agent.runtimes.kubernetes.fleet.gate import GateRefused
from kvpilot.agent.runtimes.kubernetes.runtime import KubernetesRuntime
from kvpilot.agent.tuning.pod.adapter import KubernetesTunerAdapter
from kvpilot.tuner.rollout.ports import CandidateStartFailed, RestartRefused


class GateSaysNo:
    """A stand-in for the runtime's restart behind `FleetGate.turn`, refused by the gate."""

    target = type("Target", (), {"stable_name": "vllm", "namespace": "serving"})()

    async def restart(self, name: str, **_: Any) -> None:
        raise GateRefused("the Deployment's restart budget is in use (1 of 1): waited 900 s")


def _promote(argv: Sequence[str]) -> None:
    adapter = KubernetesTunerAdapter(cast(KubernetesRuntime, GateSaysNo()))
    asyncio.run(adapter.set_stable(argv, reason="promotion", ready_timeout_s=5))


def test_a_promotion_the_gate_refuses_is_a_refused_restart() -> None:
    with pytest.raises(RestartRefused, match="restart budget") as refused:
        _promote(["vllm", "serve", "m", "--max-num-seqs", "64"])
    assert not isinstance(refused.value, CandidateStartFailed)
    assert isinstance(refused.value.__cause__, GateRefused)


class Recording:
    """A stand-in runtime that serves every call and keeps the decisions it is told."""

    target = type(
        "Target",
        (),
        {
            "stable_name": "vllm",
            "canary_name": "vllm-canary",
            "namespace": "s",
            "deployment": "vllm",
        },
    )()
    lease = type("Lease", (), {"ensure_ours": staticmethod(lambda: None)})()

    def __init__(self) -> None:
        self.decisions: list[tuple[str, str]] = []

    async def start_canary(self, argv: Sequence[str], **_: Any) -> Any:
        return type("Instance", (), {"url": "http://canary:8000"})()

    async def stop(self, name: str, **_: Any) -> None:
        return None

    async def restart(self, name: str, **_: Any) -> None:
        return None

    def record_decision(self, reason: str, message: str) -> None:
        self.decisions.append((reason, message))


def test_each_tuning_decision_is_told_to_the_runtime_as_an_event() -> None:
    runtime = Recording()
    adapter = KubernetesTunerAdapter(cast(KubernetesRuntime, runtime))
    argv = ["vllm", "serve", "m", "--max-num-seqs", "64", "--api-key", "sk-secret"]

    async def trial() -> None:
        await adapter.start_canary(argv, ready_timeout_s=5)
        await adapter.stop_canary()
        await adapter.set_stable(argv, reason="judged better", ready_timeout_s=5)
        await adapter.set_stable(argv, reason="the bake", ready_timeout_s=5, restore=True)

    asyncio.run(trial())
    reasons = [reason for reason, _ in runtime.decisions]
    assert reasons == [TRIAL_STARTED, TRIAL_ENDED, PROMOTED, ROLLED_BACK]
    assert "--max-num-seqs 64" in runtime.decisions[2][1]
    assert "judged better" in runtime.decisions[2][1]
    assert all("sk-secret" not in message for _, message in runtime.decisions)


def test_a_decision_the_runtime_cannot_write_fails_nothing() -> None:
    class Refusing(Recording):
        def record_decision(self, reason: str, message: str) -> None:
            raise RuntimeError("events: forbidden")

    adapter = KubernetesTunerAdapter(cast(KubernetesRuntime, Refusing()))
    url = asyncio.run(adapter.start_canary(["vllm", "serve", "m"], ready_timeout_s=5))
    assert url == "http://canary:8000"
