"""A canary nobody attends (its pod evicted mid-trial, its journal gone with an emptyDir) is
found and removed by the next tuning run, its share taken back first; a pull-back refused
once (a 403, a 500) is tried again. Against the fake API server (a fake: no API server runs
here) and a stand-in vLLM."""

from __future__ import annotations

import asyncio

from kvpilot.agent.tuning.pod import adapter as kubernetes_adapter
from kvpilot.agent.tuning.pod.adapter import KubernetesTunerAdapter
from tests.agent.k8s.conftest import NAMESPACE, base_deployment, make_runtime
from tests.agent.k8s.test_live_traffic_adapter import CANARY, Split, SplitDouble
from tests.agent.k8s.test_pod_schedule import scheduled


class RefusedOnce(SplitDouble):
    """A split whose first pull-back the API server refuses."""

    async def pull_back(self) -> Split:
        self.pulls.append(len(self.fake.writes("DELETE")))
        if len(self.pulls) == 1:
            raise PermissionError("HTTP 403: may not patch httproutes")
        return Split(100.0, 0.0)


def evicted_mid_trial(fake, standin, tmp_path) -> None:
    """Pod B started a canary and was evicted: its state went with it."""
    other = make_runtime(fake, standin.port, tmp_path / "b", promote="apply")
    asyncio.run(other.start_canary(("--max-num-seqs", "8"), ready_timeout_s=10))
    assert fake.deployment(NAMESPACE, CANARY) is not None


def test_the_next_run_removes_a_canary_no_trial_owns_and_audits_it(fake, standin, tmp_path) -> None:
    fake.add_deployment(base_deployment(standin.port))
    evicted_mid_trial(fake, standin, tmp_path)
    tuning, store = scheduled(fake, tmp_path / "a", standin.port)

    async def main() -> str:
        await tuning.start_up()
        return await tuning.fire()

    outcome = asyncio.run(main())

    assert outcome.startswith("finished: "), outcome
    assert fake.deployment(NAMESPACE, CANARY) is None
    reasons = [a.reason for a in store.audit_records()]
    assert any(f"removed the orphaned canary {NAMESPACE}/{CANARY}" in r for r in reasons)
    store.close()


def test_a_canary_of_someone_else_is_left_alone(fake, standin, tmp_path) -> None:
    fake.add_deployment(base_deployment(standin.port))
    evicted_mid_trial(fake, standin, tmp_path)
    fake.deployments[(NAMESPACE, CANARY)].obj["metadata"]["annotations"].clear()
    adapter = KubernetesTunerAdapter(make_runtime(fake, standin.port, tmp_path / "a"))

    assert asyncio.run(adapter.sweep_orphaned_canary()) is None
    assert fake.writes("DELETE") == []


def test_a_pull_back_refused_once_is_tried_again(fake, standin, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(kubernetes_adapter, "PULL_BACK_PAUSE_S", 0.01)
    fake.add_deployment(base_deployment(standin.port))
    evicted_mid_trial(fake, standin, tmp_path)
    split = RefusedOnce(fake)
    runtime = make_runtime(fake, standin.port, tmp_path / "a")
    adapter = KubernetesTunerAdapter(runtime, drain_timeout_s=5, traffic=split)

    swept = asyncio.run(adapter.sweep_orphaned_canary())

    assert split.pulls == [0, 0]  # refused, then taken back, both before the DELETE
    assert swept is not None and "stable 100 %, canary 0 %" in swept
    assert fake.deployment(NAMESPACE, CANARY) is None
