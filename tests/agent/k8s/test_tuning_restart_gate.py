"""Tuning's restarts count against the Deployment's restart budget: a promotion the fleet's
gate refuses is a refused restart for the rollout, not a candidate that failed to start."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, cast

import pytest

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
