"""A tuning session over the Kubernetes runtime, against the fake API server (a fake: no
API server runs here) and a stand-in vLLM. The windows are scripted by the flags each
Deployment runs, as the rollout tests do; what is under test is the Kubernetes side:
the canary Deployment, the promotion patch, recommend-only, the Lease."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Sequence

import pytest

from kvpilot.agent.runtimes.kubernetes.lease import DeploymentLease, LeaseHeld, lease_name
from kvpilot.agent.tuning.pod.adapter import KubernetesTunerAdapter
from kvpilot.collectors.vllm_argv import flag_value
from kvpilot.tuner.problem.space import Knob, KnobKind, SearchSpace
from kvpilot.tuner.rollout.canary import Phase, RolloutSettings, Strategy
from kvpilot.tuner.rollout.ports import Observation
from kvpilot.tuner.session import TuningSession
from kvpilot.tuner.suggest import GridSuggester
from kvpilot.tuner.trials import TrialState
from tests.agent.k8s.conftest import NAMESPACE, base_deployment, make_runtime
from tests.fakes.rollout_journal import InMemoryRolloutJournal
from tests.fakes.trial_store import InMemoryTrialStore
from tests.tuner.rollout.test_canary import SLO, window

CANARY = "vllm-kvpilot-canary"
SPACE = SearchSpace(
    knobs=(Knob("max_num_seqs", KnobKind.INTEGER, 8, 64, levels=(8.0,)),)  # one candidate
)


class DeploymentObserver:
    """Scripted windows by what each Deployment runs: `--max-num-seqs 8` is the faster."""

    def __init__(self, fake) -> None:
        self._fake = fake
        self.seen: list[tuple[str, ...]] = []

    def _args(self, name: str) -> tuple[str, ...]:
        deployment = self._fake.deployment(NAMESPACE, name)
        assert deployment is not None, f"no Deployment {name}"
        return tuple(deployment["spec"]["template"]["spec"]["containers"][0]["args"])

    async def warm(self, urls: Sequence[str]) -> None:
        return None

    async def observe(
        self, urls: Sequence[str], *, prompts: str | None = None
    ) -> tuple[Observation, ...]:
        # Stable and canary share the stand-in's URL: the first is the stable, then the canary.
        names = ["vllm", CANARY][: len(urls)]
        out = []
        for name in names:
            args = self._args(name)
            self.seen.append(args)
            out.append(window(0.5 if flag_value(args, "--max-num-seqs") == "8" else 1.0))
        return tuple(out)


def session(
    adapter: KubernetesTunerAdapter,
    fake,
    *,
    strategy: Strategy = Strategy.PARALLEL,
    ready_timeout_s: float = 10,
) -> tuple[TuningSession, InMemoryTrialStore]:
    store, ids = InMemoryTrialStore(), (f"t{i}" for i in itertools.count(1))
    clock = itertools.count(100.0)
    return TuningSession(
        space=SPACE,
        suggester=GridSuggester(SPACE),
        store=store,
        journal=InMemoryRolloutJournal(),
        runtime=adapter,
        observer=DeploymentObserver(fake),
        fingerprint="k8s",
        settings=RolloutSettings(slo=SLO, ready_timeout_s=ready_timeout_s),
        strategy=strategy,
        wall_clock=lambda: float(next(clock)),
        new_id=lambda: next(ids),
    ), store


def stable_args(fake) -> list[str]:
    return fake.deployment(NAMESPACE, "vllm")["spec"]["template"]["spec"]["containers"][0]["args"]


def test_a_better_canary_deployment_is_promoted_by_patching_the_stable(
    fake, standin, tmp_path
) -> None:
    fake.add_deployment(base_deployment(standin.port))
    runtime = make_runtime(fake, standin.port, tmp_path, promote="apply")
    adapter = KubernetesTunerAdapter(runtime, drain_timeout_s=5)
    before = stable_args(fake)
    run, store = session(adapter, fake)

    async def main():
        async with adapter.lease() as lease:
            # A second tuner of the same Deployment is refused while this one holds it.
            other = DeploymentLease(
                fake.api_client(), namespace=NAMESPACE, deployment="vllm", identity="pod-b"
            )
            with pytest.raises(LeaseHeld, match="pod-a"):
                await asyncio.to_thread(other.acquire)
            return lease, await run.run(1)

    lease, summary = asyncio.run(main())
    (outcome,) = summary.outcomes
    assert outcome.record.phase is Phase.PROMOTED, outcome.record.reason
    (created,) = [w for w in fake.writes("POST") if w.path.endswith("/deployments")]
    assert created.body["metadata"]["name"] == CANARY
    canary_args = created.body["spec"]["template"]["spec"]["containers"][0]["args"]
    assert flag_value(tuple(canary_args), "--max-num-seqs") == "8"
    assert stable_args(fake) == canary_args != before  # the rolling update's patch
    assert fake.deployment(NAMESPACE, CANARY) is None  # the canary went before the patch
    assert lease.holder == "pod-a"
    assert fake.leases[(NAMESPACE, lease_name("vllm"))]["spec"].get("holderIdentity") in (None, "")
    assert store.trials()[0].state is TrialState.COMPLETE


def test_recommend_only_writes_the_patch_and_the_stable_keeps_its_args(
    fake, standin, tmp_path
) -> None:
    fake.add_deployment(base_deployment(standin.port, {"app.kubernetes.io/managed-by": "flux"}))
    runtime = make_runtime(fake, standin.port, tmp_path, promote="auto")
    before = stable_args(fake)
    run, _ = session(KubernetesTunerAdapter(runtime, drain_timeout_s=5), fake)

    summary = asyncio.run(run.run(1))

    (outcome,) = summary.outcomes
    assert outcome.record.phase is Phase.ROLLED_BACK
    assert (outcome.record.reason or "").startswith("not promoted: recommend-only")
    assert "refused a restart" in summary.stopped_reason
    assert stable_args(fake) == before and fake.writes("PATCH") == []
    (patch,) = (tmp_path).rglob("*.json")
    written = json.loads(patch.read_text())["spec"]["template"]["spec"]["containers"][0]["args"]
    assert flag_value(tuple(written), "--max-num-seqs") == "8"
    assert fake.deployment(NAMESPACE, CANARY) is None


def test_a_canary_that_crashes_is_infeasible_with_vllms_reason(fake, standin, tmp_path) -> None:
    fake.add_deployment(base_deployment(standin.port))
    fake.crash["canary"] = (
        "CrashLoopBackOff",
        "ValueError: No available memory for the cache blocks. Try increasing "
        "`gpu_memory_utilization` when initializing the engine.",
    )
    runtime = make_runtime(fake, standin.port, tmp_path, promote="apply")
    before = stable_args(fake)
    run, store = session(KubernetesTunerAdapter(runtime, drain_timeout_s=5), fake)

    (outcome,) = asyncio.run(run.run(1)).outcomes

    assert outcome.record.phase is Phase.INFEASIBLE
    (trial,) = store.trials()
    assert trial.state is TrialState.INFEASIBLE and trial.result is not None
    assert trial.result.startup_failure is not None
    assert "No available memory for the cache blocks" in (
        trial.result.startup_failure.log_line or ""
    )
    assert stable_args(fake) == before and fake.deployment(NAMESPACE, CANARY) is None
