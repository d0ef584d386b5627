"""The fault run: one kvpilot (the pod runtime, its Lease, its live-traffic split, a tuning
session of two trials) against the fake API server (a fake: no API server runs here), a
stand-in vLLM, and a scripted sequence of the faults a bad day brings: a replica evicted
mid-trial leaving its canary with a share of the traffic, a 403 on the pull-back, an HTML
page with 200, a request never answered, a 500 and a 429 on the Lease's renewal, a 409 on
the promotion, a 500 on the canary's creation, on a route split between two backends. It
must end with no canary, no traffic share on one, the route as found, the Lease released,
and every fault on record."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence

from kvpilot.agent.app.parts import build_pod_runtime
from kvpilot.agent.config import PodRuntimeConfig, validate_config
from kvpilot.agent.runtimes import k8s_api
from kvpilot.agent.runtimes.k8s_api import InfrastructureFailure
from kvpilot.agent.runtimes.k8s_faults import FAULTS
from kvpilot.agent.runtimes.k8s_lease import lease_name
from kvpilot.agent.runtimes.k8s_traffic import GatewayWeights
from kvpilot.agent.tuning import kubernetes as k8s_tuning
from kvpilot.agent.tuning.kubernetes import KubernetesTunerAdapter
from kvpilot.collectors.vllm_argv import flag_value
from kvpilot.tuner.ports import Observation
from kvpilot.tuner.rollout import RolloutSettings, Strategy
from kvpilot.tuner.session import TuningSession
from kvpilot.tuner.space import Knob, KnobKind, SearchSpace
from kvpilot.tuner.suggest import GridSuggester
from kvpilot.tuner.trials import TrialState
from tests.agent.k8s.conftest import NAMESPACE, base_deployment, make_runtime
from tests.agent.k8s.test_k8s_tuning import CANARY, DeploymentObserver, stable_args
from tests.agent.k8s.test_pod_sidecar import wait_for
from tests.fakes.rollout_journal import InMemoryRolloutJournal
from tests.fakes.trial_store import InMemoryTrialStore
from tests.tuner.test_rollout import SLO

SPACE = SearchSpace(knobs=(Knob("max_num_seqs", KnobKind.INTEGER, 8, 64, levels=(8.0, 16.0)),))
LEASE = r"/leases/vllm-kvpilot-tuner$"
# The route as found: split between two backends already (the next model version beside).
FOUND = ({"name": "vllm", "port": 8000, "weight": 50}, {"name": "vllm-next", "port": 8000})
ROUTE = r"/httproutes/vllm$"


class LiveShare(DeploymentObserver):
    """The scripted windows, with the canary's share of live traffic sent first, as the
    live-traffic observer sends it."""

    def __init__(self, fake, traffic: GatewayWeights) -> None:
        super().__init__(fake)
        self.traffic = traffic

    async def observe(self, urls: Sequence[str]) -> tuple[Observation, ...]:
        if len(urls) > 1:
            await self.traffic.send_share(10)
        return await super().observe(urls)


def route_split(fake) -> GatewayWeights:
    stable = fake.deployment(NAMESPACE, "vllm")
    return GatewayWeights(
        fake.api_client(),
        namespace=NAMESPACE,
        route="vllm",
        stable_service="vllm",
        canary_service=CANARY,
        canary_selector={**stable["spec"]["selector"]["matchLabels"], "kvpilot.dev/role": "canary"},
    )


def seed(fake, port: int) -> None:
    fake.add_deployment(base_deployment(port))
    fake.add_service(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "vllm", "namespace": NAMESPACE},
            "spec": {"selector": {"app.kubernetes.io/name": "vllm"}, "ports": [{"port": 8000}]},
        }
    )
    fake.add_httproute(
        {
            "apiVersion": "gateway.networking.k8s.io/v1",
            "kind": "HTTPRoute",
            "metadata": {"name": "vllm", "namespace": NAMESPACE},
            "spec": {
                "parentRefs": [{"name": "gateway"}],
                "rules": [{"backendRefs": [dict(ref) for ref in FOUND]}],
            },
        }
    )


def pod_runtime(fake, port: int, tmp_path):
    config = validate_config(
        {
            "state_dir": str(tmp_path / "state"),
            "runtime": {
                "kind": "pod",
                "port": port,
                "kubernetes": {"namespace": NAMESPACE, "api_url": fake.host, "promote": "apply"},
            },
        },
        warn=False,
    )
    assert isinstance(config.runtime, PodRuntimeConfig)
    runtime = build_pod_runtime(config, config.runtime, {"POD_NAME": "pod-a"})
    runtime._poll_s = 0.01
    return runtime


def test_a_tuning_session_through_a_scripted_run_of_faults(
    fake, standin, tmp_path, monkeypatch
) -> None:
    # Short enough that a hung request fails within the test, long enough that a loaded
    # machine's fake API server answers every other request in time (0.3 s did not, once).
    monkeypatch.setattr(k8s_api, "REQUEST_TIMEOUT_S", (1.0, 1.0))
    monkeypatch.setattr(k8s_tuning, "PULL_BACK_PAUSE_S", 0.01)
    seed(fake, standin.port)
    # Pod B was tuning: its canary took a tenth of the traffic, then B was evicted.
    evicted = make_runtime(fake, standin.port, tmp_path / "b", promote="apply")
    asyncio.run(evicted.start_canary(("--max-num-seqs", "32"), ready_timeout_s=10))
    asyncio.run(route_split(fake).send_share(10))
    recorded_from = FAULTS.total

    runtime = pod_runtime(fake, standin.port, tmp_path / "a")
    traffic = route_split(fake)
    adapter = KubernetesTunerAdapter(runtime, drain_timeout_s=5, traffic=traffic)
    store, ids, clock = (
        InMemoryTrialStore(),
        (f"t{i}" for i in itertools.count(1)),
        itertools.count(100.0),
    )
    session = TuningSession(
        space=SPACE,
        suggester=GridSuggester(SPACE),
        store=store,
        journal=InMemoryRolloutJournal(),
        runtime=adapter,
        observer=LiveShare(fake, traffic),
        fingerprint="k8s",
        settings=RolloutSettings(slo=SLO, ready_timeout_s=10, bake=False),
        strategy=Strategy.PARALLEL,
        wall_clock=lambda: float(next(clock)),
        new_id=lambda: next(ids),
    )

    async def ticks_while(fault) -> tuple:
        """A tick's read while the API server misbehaves: the pod's own view, at once."""
        fault()
        found = await asyncio.wait_for(asyncio.to_thread(runtime.instances), timeout=10)
        fake.heal()
        runtime._view = runtime._failed_at_s = None
        return found

    async def run() -> tuple[str | None, list, BaseException | None]:
        async with runtime.lease.held(renew_every_s=0.05):
            fake.fail("PATCH", ROUTE, 403)  # the orphan's pull-back is refused once
            swept = await adapter.sweep_orphaned_canary()
            tick_views = [
                await ticks_while(lambda: fake.answer_html("GET", r"/deployments/vllm$", 1)),
                await ticks_while(lambda: fake.hang("GET", r"/deployments/vllm$", 2)),
            ]
            fake.fail("PUT", LEASE, 500)
            fake.fail("GET", LEASE, 429)
            await wait_for(
                "two failed renewals", lambda: runtime.lease.renew_failures_total >= 2 or None
            )
            fake.fail("PATCH", r"/deployments/vllm$", 409)  # trial 1's promotion, once
            fake.fail("POST", r"/deployments$", 500, times=2)  # trial 2's canary
            fake.faults[-1].times = 0  # armed below, once trial 1 has promoted
            failed = None
            try:
                await session.run(1)
                fake.faults[-1].times = 1
                await session.run(1)
            except InfrastructureFailure as exc:
                failed = exc
            return swept, tick_views, failed

    swept, tick_views, failed = asyncio.run(run())

    # The end state: no canary, no share on one, the Lease given back.
    assert fake.deployment(NAMESPACE, CANARY) is None
    assert fake.service(NAMESPACE, CANARY) is None
    refs = fake.httproute(NAMESPACE, "vllm")["spec"]["rules"][0]["backendRefs"]
    assert refs == [dict(ref) for ref in FOUND]  # put back as found
    assert fake.leases[(NAMESPACE, lease_name("vllm"))]["spec"].get("holderIdentity") in (None, "")
    # What happened, on record.
    assert swept is not None and f"orphaned canary {NAMESPACE}/{CANARY}" in swept
    assert all([i.role for i in view] == ["stable"] for view in tick_views)
    first, second = store.trials()
    assert first.state is TrialState.COMPLETE
    assert flag_value(tuple(stable_args(fake)), "--max-num-seqs") == "8"  # promoted over a 409
    assert second.state is TrialState.FAILED and "HTTP 500" in (second.reason or "")
    assert failed is not None and "create" in str(failed)
    faults = [f.describe() for f in FAULTS.since(recorded_from)]
    expected = [
        "Forbidden (HTTP 403) on patch HTTPRoute",
        "UnexpectedAnswer (HTTP 200) on get Deployment serving/vllm",
        "KubernetesApiError (no answer) on get Deployment serving/vllm",
        "KubernetesApiError (HTTP 500) on update Lease",
        "KubernetesApiError (HTTP 429) on get Lease",
        "Conflict (HTTP 409) on patch Deployment serving/vllm",
        "KubernetesApiError (HTTP 500) on create Deployment serving/vllm-kvpilot-canary",
    ]
    for fault in expected:
        assert any(f.startswith(fault) for f in faults), (fault, faults)
