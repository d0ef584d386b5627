"""The fault run: one kvpilot (the pod runtime, its Lease, its live-traffic split, a tuning
session of two trials) against the fake API server (a fake: no API server runs here), a
stand-in vLLM, and a scripted sequence of the faults a bad day brings: a replica evicted
mid-trial leaving its canary with a share of the traffic, a 403 on the pull-back, an HTML
page with 200, a request never answered, a 500 and a 429 on the Lease's renewal, a 409 on
the promotion, a 500 on the canary's creation, a person's edit of the Deployment during a
trial, and the Lease taken over by another replica mid-trial (which then finds the canary
it left and cleans it up), on a route split between two backends. It must end with no
canary, no traffic share on one, the route as found, the Lease released, and every fault on
record."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable, Sequence

import pytest

from kvpilot.agent.app.parts import build_pod_runtime
from kvpilot.agent.config import PodRuntimeConfig, validate_config
from kvpilot.agent.runtimes.kubernetes import api
from kvpilot.agent.runtimes.kubernetes.api import InfrastructureFailure
from kvpilot.agent.runtimes.kubernetes.edits import EditedMeanwhile
from kvpilot.agent.runtimes.kubernetes.faults import FAULTS
from kvpilot.agent.runtimes.kubernetes.lease import LeaseLost, lease_name
from kvpilot.agent.runtimes.kubernetes.traffic import GatewayWeights
from kvpilot.agent.runtimes.kubernetes.unattended import UnattendedCanaries
from kvpilot.agent.tuning.pod import adapter as kubernetes_adapter
from kvpilot.agent.tuning.pod.adapter import KubernetesTunerAdapter
from kvpilot.collectors.vllm_argv import flag_value
from kvpilot.tuner.problem.space import Knob, KnobKind, SearchSpace
from kvpilot.tuner.rollout.canary import RolloutSettings, Strategy
from kvpilot.tuner.rollout.ports import Observation
from kvpilot.tuner.session import TuningSession
from kvpilot.tuner.suggest import GridSuggester
from kvpilot.tuner.trials import TrialState
from tests.agent.k8s.conftest import NAMESPACE, base_deployment, make_runtime
from tests.agent.k8s.test_k8s_tuning import CANARY, DeploymentObserver, stable_args
from tests.agent.k8s.test_pod_sidecar import wait_for
from tests.fakes.rollout_journal import InMemoryRolloutJournal
from tests.fakes.trial_store import InMemoryTrialStore
from tests.tuner.rollout.test_canary import RIG, SLO, window

SPACE = SearchSpace(
    knobs=(Knob("max_num_seqs", KnobKind.INTEGER, 8, 64, levels=(8.0, 16.0, 32.0, 64.0)),)
)
LEASE = r"/leases/vllm-kvpilot-tuner$"
# The route as found: split between two backends already (the next model version beside).
FOUND = ({"name": "vllm", "port": 8000, "weight": 50}, {"name": "vllm-next", "port": 8000})
ROUTE = r"/httproutes/vllm$"


class LiveShare(DeploymentObserver):
    """The scripted windows, with the canary's share of live traffic sent first, as the
    live-traffic observer sends it; `meanwhile` happens once the canary has its share, and
    `canary_faster` scripts a candidate worth promoting over the promoted stable."""

    def __init__(self, fake, traffic: GatewayWeights) -> None:
        super().__init__(fake)
        self.traffic = traffic
        self.meanwhile: Callable[[], Awaitable[None]] | None = None
        self.canary_faster = False

    async def observe(
        self, urls: Sequence[str], *, prompts: str | None = None
    ) -> tuple[Observation, ...]:
        if len(urls) > 1:
            await self.traffic.send_share(10)
            meanwhile, self.meanwhile = self.meanwhile, None
            if meanwhile is not None:
                await meanwhile()
        found = await super().observe(urls)
        return (window(1.0), window(0.5)) if self.canary_faster and len(found) == 2 else found


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


def pod_runtime(fake, port: int, tmp_path, pod: str = "pod-a"):
    config = validate_config(
        {
            "state_dir": str(tmp_path / "state"),
            "runtime": {
                "kind": "pod",
                "port": port,
                "kubernetes": {
                    "namespace": NAMESPACE,
                    "deployment": "vllm",
                    "api_url": fake.host,
                    "promote": "apply",
                },
            },
        },
        warn=False,
    )
    assert isinstance(config.runtime, PodRuntimeConfig)
    runtime = build_pod_runtime(config, config.runtime, {"POD_NAME": pod})
    runtime._poll_s = 0.01
    return runtime


NEW_IMAGE = "vllm/vllm-openai:v0.99.0"  # a person's edit during trial 3


def edit_image(spec: dict) -> None:
    spec["template"]["spec"]["containers"][0]["image"] = NEW_IMAGE


def stable_image(fake) -> str:
    return fake.deployment(NAMESPACE, "vllm")["spec"]["template"]["spec"]["containers"][0]["image"]


def test_a_tuning_session_through_a_scripted_run_of_faults(
    fake, standin, tmp_path, monkeypatch
) -> None:
    # Short enough that a hung request fails within the test, long enough that a loaded
    # machine's fake API server answers every other request in time (0.3 s did not, once).
    monkeypatch.setattr(api, "REQUEST_TIMEOUT_S", (1.0, 1.0))
    monkeypatch.setattr(kubernetes_adapter, "PULL_BACK_PAUSE_S", 0.01)
    seed(fake, standin.port)
    # Pod B was tuning: its canary took a tenth of the traffic, then B was evicted.
    evicted = make_runtime(fake, standin.port, tmp_path / "b", promote="apply")
    asyncio.run(evicted.start_canary(("--max-num-seqs", "32"), ready_timeout_s=10))
    asyncio.run(route_split(fake).send_share(10))
    recorded_from = FAULTS.total

    unattended = UnattendedCanaries()
    runtime = pod_runtime(fake, standin.port, tmp_path / "a")
    traffic = route_split(fake)
    adapter = KubernetesTunerAdapter(
        runtime, drain_timeout_s=5, traffic=traffic, unattended=unattended
    )
    observer = LiveShare(fake, traffic)
    store, ids, clock = (
        InMemoryTrialStore(),
        (f"t{i}" for i in itertools.count(1)),
        itertools.count(100.0),
    )
    journal = InMemoryRolloutJournal()
    session = TuningSession(
        space=SPACE,
        suggester=GridSuggester(SPACE),
        store=store,
        journal=journal,
        runtime=adapter,
        observer=observer,
        fingerprint="k8s",
        settings=RolloutSettings(slo=SLO, ready_timeout_s=10, bake=False, **RIG),  # type: ignore[arg-type]
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

    async def person_edits() -> None:
        fake.edit_deployment(NAMESPACE, "vllm", edit_image)

    async def taken_over() -> None:
        """Pod C takes the Lease over while this pod's canary has its share."""
        fake.take_lease(NAMESPACE, lease_name("vllm"), "pod-c")
        await wait_for("the takeover seen", lambda: runtime.lease.lost)  # cancelled by it

    async def run() -> tuple[str | None, list, BaseException | None, BaseException | None]:
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
            observer.meanwhile, observer.canary_faster = person_edits, True  # trial 3
            edited = None
            try:
                await session.run(1)
            except EditedMeanwhile as exc:
                edited = exc
        return swept, tick_views, failed, edited

    swept, tick_views, failed, edited = asyncio.run(run())
    assert edited is not None, "a person's edit during trial 3 was written over"
    assert stable_image(fake) == NEW_IMAGE  # as the person left it
    assert fake.deployment(NAMESPACE, CANARY) is None

    async def run_taken_over() -> None:
        observer.meanwhile = taken_over  # trial 4
        async with runtime.lease.held(renew_every_s=0.05):
            await session.run(1)

    with pytest.raises(LeaseLost, match="pod-c") as lost:
        asyncio.run(run_taken_over())
    # This pod wrote nothing more: the canary and its share are left to the new holder.
    assert fake.deployment(NAMESPACE, CANARY) is not None
    deletes = len(fake.writes("DELETE"))
    # Pod C, the new holder, finds the canary no trial of its own owns and cleans it up.
    other = pod_runtime(fake, standin.port, tmp_path / "c", pod="pod-c")
    cleaner = KubernetesTunerAdapter(
        other, drain_timeout_s=5, traffic=route_split(fake), unattended=unattended
    )

    async def new_holder_sweeps() -> str | None:
        async with other.lease.held(renew_every_s=0.05):
            return await cleaner.sweep_orphaned_canary()

    swept_after_takeover = asyncio.run(new_holder_sweeps())

    # The end state: no canary, no share on one, the Lease given back.
    assert fake.deployment(NAMESPACE, CANARY) is None
    assert fake.service(NAMESPACE, CANARY) is None
    assert len(fake.writes("DELETE")) > deletes  # by pod C, after the takeover
    refs = fake.httproute(NAMESPACE, "vllm")["spec"]["rules"][0]["backendRefs"]
    assert refs == [dict(ref) for ref in FOUND]  # put back as found
    assert fake.leases[(NAMESPACE, lease_name("vllm"))]["spec"].get("holderIdentity") in (None, "")
    assert unattended.series() == ((f"{NAMESPACE}/vllm", 0.0),)  # marked, then cleaned up
    # What happened, on record.
    assert swept is not None and f"orphaned canary {NAMESPACE}/{CANARY}" in swept
    assert all([i.role for i in view] == ["stable"] for view in tick_views)
    first, second, third, fourth = store.trials()
    assert first.state is TrialState.COMPLETE
    assert second.state is TrialState.FAILED and "HTTP 500" in (second.reason or "")
    assert failed is not None and "create" in str(failed)
    assert third.state is TrialState.COMPLETE  # measured; the promotion was refused
    assert "changed by someone else during the trial" in str(edited)
    rollouts = {r.trial_id: (r.phase.value, r.reason or "") for r in journal.records()}
    assert rollouts["t3"][0] == "failed" and "changed by someone else" in rollouts["t3"][1]
    assert rollouts["t4"][0] == "aborted" and "holder now: 'pod-c'" in rollouts["t4"][1]
    assert flag_value(tuple(stable_args(fake)), "--max-num-seqs") == "8"  # trial 1's, kept
    # Cut off by the takeover, saying so; its canary was the new holder's to clean up.
    assert fourth.state is TrialState.ABORTED and "'pod-c'" in (fourth.reason or ""), fourth
    assert "'pod-c'" in str(lost.value)
    assert swept_after_takeover is not None and "canary 0 %" in swept_after_takeover
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
