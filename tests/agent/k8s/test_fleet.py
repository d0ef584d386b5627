"""A fleet on Kubernetes: 5 Deployments of 10 replicas, one sidecar loop per pod, in-process.

Each loop is the real AlertTracker feeding the real Remediator, as the sidecar's tick does,
with its runtime behind the Deployment's `FleetGate` (the real Lease slots, PDB check, Events
and kept-guards ConfigMap against the one fake API server, tests/fakes/k8s_fleet.py). Each pod's
vLLM is a stand-in (tests/fakes/standin_vllm.py) scraped over HTTP each tick; a restart there
is a stand-in's restart: a short drain, after which its surge is gone.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from typing import Any

import httpx
import pytest
from kubernetes import client

from kvpilot.agent.alerts import AlertTracker
from kvpilot.agent.mode import MODE_ANNOTATION, LiveMode, Mode, ModeSetting
from kvpilot.agent.model import Instance
from kvpilot.agent.remediation import Remediator, WatchWindows
from kvpilot.agent.runtimes.kubernetes.fleet import decision_events as ev
from kvpilot.agent.runtimes.kubernetes.fleet.decision_events import DecisionEvents
from kvpilot.agent.runtimes.kubernetes.fleet.gate import FleetGate, FleetRestarts, GateTimings
from kvpilot.agent.runtimes.kubernetes.fleet.kept_guards import KeptGuards
from kvpilot.agent.runtimes.kubernetes.fleet.owner import owning_deployment
from kvpilot.agent.runtimes.kubernetes.fleet.pdb import disruption_verdict
from kvpilot.agent.runtimes.kubernetes.fleet.slots import RestartSlots
from kvpilot.agent.runtimes.kubernetes.switch import (
    SWITCH_INTERVAL_S,
    Layer,
    SwitchWatch,
    read_layers,
)
from tests.agent.k8s.conftest import NAMESPACE, base_deployment
from tests.agent.remediation.remediation_helpers import condition, remediation_config
from tests.fakes.k8s_fleet import FakeFleetApi
from tests.fakes.remediation_journal import MemoryJournal
from tests.fakes.standin_vllm import StandInVllm

MODELS, REPLICAS = 5, 10
TICK_S = 0.5
SURGE = "kvpilot_test_surge 1\n"
TIMINGS = GateTimings(poll_s=1.0, max_wait_s=120, renew_every_s=1.0)


def deployment(name: str, port: int) -> dict[str, Any]:
    body = base_deployment(port)
    body["metadata"]["name"] = name
    body["spec"]["replicas"] = REPLICAS
    body["spec"]["selector"]["matchLabels"]["kvpilot.dev/model"] = name
    body["spec"]["template"]["metadata"]["labels"]["kvpilot.dev/model"] = name
    return body


class Restarting:
    """Who restarts now, per Deployment, and the most seen at once."""

    def __init__(self) -> None:
        self.now: dict[str, int] = defaultdict(int)
        self.most: dict[str, int] = defaultdict(int)
        self.done: list[str] = []


class StandInRestarts:
    """The pod's own vLLM restarted by signal: a drain, then a server without the surge."""

    can_change_flags = False

    def __init__(self, pod: str, model: str, server: StandInVllm, seen: Restarting) -> None:
        self.pod, self.model, self.server, self.seen = pod, model, server, seen
        self.instance = Instance(
            name="vllm",
            role="stable",
            url=f"http://127.0.0.1:{server.port}",
            kvpool_url=None,
            pids=frozenset({100}),
            main_pid=100,
            argv=("python", "-m", "vllm.entrypoints.openai.api_server"),
            started_at_wall_s=time.time(),
        )

    def instances(self) -> tuple[Instance, ...]:
        return (self.instance,)

    async def restart(
        self,
        name: str,
        *,
        drain_timeout_s: float,
        ready_timeout_s: float,
        argv: Sequence[str] | None = None,
    ) -> Instance:
        self.seen.now[self.model] += 1
        self.seen.most[self.model] = max(self.seen.most[self.model], self.seen.now[self.model])
        try:
            await asyncio.sleep(0.3)  # the drain
            self.server.metrics = lambda: ""
            self.instance = dataclasses.replace(self.instance, main_pid=self.instance.main_pid + 1)
            self.seen.done.append(self.pod)
            return self.instance
        finally:
            self.seen.now[self.model] -= 1


class Sidecar:
    """One pod's sidecar loop: scrape, rules, alerts, remediation, on the monotonic clock."""

    def __init__(
        self, api: client.ApiClient, pod: dict[str, Any], server: StandInVllm, seen: Restarting
    ) -> None:
        self.pod = pod["metadata"]["name"]
        self.deployment = owning_deployment(api, NAMESPACE, self.pod)  # from ownerReferences
        labels = pod["metadata"]["labels"]
        self.server = server
        self.config = remediation_config(cooldown_s=0, preflight={"enabled": False})
        self.paged: list[str] = []  # what `on_wait` paged
        self.gate = FleetGate(
            slots=RestartSlots(
                api,
                namespace=NAMESPACE,
                deployment=self.deployment,
                identity=self.pod,
                duration_s=5,
            ),
            events=DecisionEvents(
                api, namespace=NAMESPACE, deployment=self.deployment, pod=self.pod
            ),
            kept=KeptGuards(api, namespace=NAMESPACE, deployment=self.deployment),
            disruption=lambda: disruption_verdict(api, NAMESPACE, labels),
            breaker_fact=self.breaker_fact,
            on_wait=self.paged.append,
            timings=TIMINGS,
        )
        inner = StandInRestarts(self.pod, self.deployment, server, seen)
        self.tracker = AlertTracker()
        self.remediator = Remediator(
            FleetRestarts(inner, self.gate),
            MemoryJournal(),
            self.config,
            windows=WatchWindows(after_restart_s=3.0),
        )

    def breaker_fact(self) -> dict[str, Any]:
        return self.remediator.breaker.to_fact("vllm", time.monotonic(), time.time())

    async def tick(self, http: httpx.AsyncClient) -> None:
        text = (await http.get(f"http://127.0.0.1:{self.server.port}/metrics")).text
        now = time.monotonic()
        cond = condition(instance="vllm", active=SURGE in text)
        transitions = self.tracker.update([cond], now, time.time())
        self.remediator.observe(transitions, [cond], now_s=now)


async def run_loops(sidecars: list[Sidecar], until: Any, timeout_s: float) -> None:
    """Tick every sidecar each TICK_S until `until()` holds; fail at the deadline."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=5) as http:
        while not until():
            assert time.monotonic() < deadline, "the fleet did not get there in time"
            await asyncio.gather(*(s.tick(http) for s in sidecars))
            await asyncio.sleep(TICK_S)


@pytest.mark.slow
def test_a_surge_on_every_replica_restarts_one_per_deployment_at_a_time() -> None:
    seen = Restarting()
    with ExitStack() as stack:
        fake = stack.enter_context(FakeFleetApi())
        servers: list[StandInVllm] = []
        for i in range(MODELS):
            name = f"model-{i}"
            fake.add_deployment(deployment(name, 8000))
            fake.add_pdb(
                NAMESPACE,
                f"{name}-pdb",
                {"matchLabels": {"kvpilot.dev/model": name}},
                maxUnavailable=1,
            )
        pods = [p for (ns, _), e in fake.deployments.items() for p in e.pods]
        assert len(pods) == MODELS * REPLICAS
        # One API client for the 50 in-process sidecars (each pod has its own in a cluster):
        # fifty clients would keep fifty connection pools and their threads in one process.
        api = fake.api_client()
        sidecars = []
        for pod in pods:
            server = stack.enter_context(StandInVllm())
            server.metrics = lambda: SURGE  # the surge trips the rule on every replica
            servers.append(server)
            sidecar = Sidecar(api, pod, server, seen)
            sidecars.append(sidecar)

        def idle() -> bool:
            return not any(s.remediator.in_progress() for s in sidecars)

        async def scenario() -> tuple[int, float]:
            # The fifty sidecars' blocking API calls share one process here: a pool sized for
            # them, so a holder's give-back does not queue behind forty waiters' polls.
            workers = stack.enter_context(ThreadPoolExecutor(max_workers=16))
            asyncio.get_running_loop().set_default_executor(workers)
            # Ticks go on until every remediation has ended: its verification is a tick's.
            await run_loops(sidecars, lambda: len(seen.done) == len(sidecars) and idle(), 90)
            for s in sidecars:
                await s.remediator.wait_idle()
            # Steady state: every loop ticking, nothing to do; count the API requests.
            before, started = len(fake.requests), time.monotonic()
            end = started + 4
            await run_loops(sidecars, lambda: time.monotonic() >= end, 30)
            return len(fake.requests) - before, time.monotonic() - started

        steady_requests, steady_s = asyncio.run(scenario())

    # At most one restart per Deployment at a time; every replica restarted and recovered.
    assert dict(seen.most) == {f"model-{i}": 1 for i in range(MODELS)}
    assert sorted(seen.done) == sorted(s.pod for s in sidecars)
    assert all(SURGE not in s.server.metrics() for s in sidecars)
    # The rest waited their turn, said so once and paged once each.
    waited = [s for s in sidecars if s.paged]
    assert len(waited) >= MODELS * (REPLICAS - 2)
    assert all(len(s.paged) == 1 for s in waited)
    # An Event for each decision, on the pod and on its Deployment.
    events = list(fake.events.values())
    for s in sidecars:
        on_pod = {e["reason"] for e in events if e["involvedObject"]["name"] == s.pod}
        assert {ev.RESTART_PLANNED, ev.RESTART_DONE} <= on_pod
        assert (ev.RESTART_WAITING in on_pod) == bool(s.paged)
    for i in range(MODELS):
        done = [
            e
            for e in events
            if e["involvedObject"]
            == {**e["involvedObject"], "kind": "Deployment", "name": f"model-{i}"}
            and e["reason"] == ev.RESTART_DONE
        ]
        assert len(done) == REPLICAS
    # Steady state: at most 0.2 API requests a second per sidecar.
    assert steady_requests / steady_s / len(sidecars) <= 0.2


def test_a_replaced_pod_keeps_its_deployments_budget_and_breaker() -> None:
    with FakeFleetApi() as fake:
        fake.add_deployment(deployment("model-0", 8000))
        api = fake.api_client()
        kept = KeptGuards(api, namespace=NAMESPACE, deployment="model-0")
        first, *others = [p["metadata"]["name"] for p in fake.pods_of(NAMESPACE, "model-0")]
        opened = {"failures": 3, "opened_at_wall_s": time.time() - 10, "trial_in_flight": False}
        kept.note(first, restart_wall_s=time.time() - 20, breaker=opened, decision=None)
        # A node drain evicts the pod through the Eviction API; its ReplicaSet replaces it.
        client.CoreV1Api(api).create_namespaced_pod_eviction(
            first, NAMESPACE, client.V1Eviction(metadata=client.V1ObjectMeta(name=first))
        )
        successor = fake.replaced[first]
        alive = [p["metadata"]["name"] for p in fake.pods_of(NAMESPACE, "model-0")]
        assert first not in alive and successor in alive
        assert owning_deployment(api, NAMESPACE, successor) == "model-0"
        record = kept.adopt(successor, alive)
        # Read back into a new replica's guards: its budget counts the restart, its breaker
        # is still open.
        remediator = Remediator(
            StandInRestarts(successor, "model-0", StandInVllm(), Restarting()),
            MemoryJournal(),
            remediation_config(),
        )
        now, wall = time.monotonic(), time.time()
        remediator.budget.seed("vllm", [now - (wall - s) for s in record.restarts_wall_s], now)
        remediator.breaker.restore("vllm", record.breaker, now, wall)
        assert remediator.budget.used("vllm", now) == 1
        assert remediator.breaker.state("vllm", now) == "open"
        # One successor per departed pod: another new pod finds nothing left to adopt.
        assert kept.adopt("model-0-other", alive).restarts_wall_s == ()
        assert kept.record(successor).breaker == opened
        del others


def test_an_eviction_the_pdb_forbids_is_refused_with_429() -> None:
    with FakeFleetApi() as fake:
        fake.add_deployment(deployment("model-0", 8000))
        fake.add_pdb(
            NAMESPACE,
            "all",
            {"matchLabels": {"kvpilot.dev/model": "model-0"}},
            minAvailable=REPLICAS,
        )
        api = fake.api_client()
        pod = fake.pods_of(NAMESPACE, "model-0")[0]
        verdict = disruption_verdict(api, NAMESPACE, pod["metadata"]["labels"])
        assert not verdict.allowed and "allows no disruption" in verdict.reason
        with pytest.raises(client.ApiException) as refused:
            client.CoreV1Api(api).create_namespaced_pod_eviction(
                pod["metadata"]["name"],
                NAMESPACE,
                client.V1Eviction(metadata=client.V1ObjectMeta(name=pod["metadata"]["name"])),
            )
        assert refused.value.status == 429 and not fake.evictions


def test_a_holder_that_died_frees_its_slot_after_the_duration_on_the_observers_clock() -> None:
    now = [100.0]
    with FakeFleetApi() as fake:
        api = fake.api_client()
        dead = RestartSlots(api, namespace=NAMESPACE, deployment="d", identity="a", duration_s=5)
        other = RestartSlots(
            api,
            namespace=NAMESPACE,
            deployment="d",
            identity="b",
            duration_s=5,
            clock=lambda: now[0],
        )
        assert dead.try_take("restart").granted
        waiting = other.try_take("restart")
        assert not waiting.granted and waiting.holders == ("a",)
        now[0] += 4.9
        assert not other.try_take("restart").granted
        now[0] += 0.2  # five seconds since it first saw a's claim, unrenewed: a is gone
        assert other.try_take("restart").granted
        assert not dead.try_take("restart").granted or False  # b holds the one slot now
        other.give_back()
        assert dead.try_take("restart").granted


def test_the_switch_pauses_a_deployment_in_one_read_within_the_fleets_request_budget() -> None:
    """50 sidecars' switches, one read per `interval` (0.5 s here standing for the shipped
    10 s): `kubectl annotate deployment model-3 kvpilot.dev/mode=paused` pauses its ten
    replicas by the next read (within 10 s shipped) and no other; the switch's reads per
    sidecar at the shipped interval stay under 0.2 a second with room for the fleet's own."""
    interval = 0.5
    with FakeFleetApi() as fake:
        for i in range(MODELS):
            fake.add_deployment(deployment(f"model-{i}", 8000))
        api = fake.api_client()
        pods = [
            (name, p["metadata"]["name"])
            for (_, name), e in fake.deployments.items()
            for p in e.pods
        ]
        reads_by: dict[str, int] = defaultdict(int)  # each switch's reads begun
        reads_when_paused: dict[str, int] = {}

        def live(pod: str) -> LiveMode:
            def changed(_: ModeSetting, after: ModeSetting) -> None:
                reads_when_paused[pod] = reads_by[pod]

            return LiveMode(Mode.ARMED, on_change=changed)

        lives = {pod: live(pod) for _, pod in pods}

        def reader(name: str, pod: str) -> Callable[[bool], tuple[Layer, Layer]]:
            def read(both: bool) -> tuple[Layer, Layer]:
                reads_by[pod] += 1
                return read_layers(api, NAMESPACE, name, namespace_too=both)

            return read

        watches = [
            SwitchWatch(lives[pod], reader(name, pod), interval_s=interval) for name, pod in pods
        ]

        async def scenario() -> int:
            tasks = [asyncio.create_task(w.run()) for w in watches]
            try:
                await asyncio.sleep(interval / 2)  # every switch has made its first read
                await asyncio.sleep(6 * interval)
                meta = fake.deployments[(NAMESPACE, "model-3")].obj["metadata"]
                meta.setdefault("annotations", {})[MODE_ANNOTATION] = "paused"
                at_change = dict(reads_by)
                deadline = time.monotonic() + 30
                paused = [pod for name, pod in pods if name == "model-3"]
                while not all(lives[p].current().mode is Mode.PAUSED for p in paused):
                    assert time.monotonic() < deadline, "the switch did not apply"
                    await asyncio.sleep(0.05)
                # Reads begun since the change: the one in flight then (it may have read the
                # old annotation) and the next one at most.
                return max(reads_when_paused[p] - at_change[p] for p in paused)
            finally:
                for t in tasks:
                    t.cancel()

        reads_to_apply = asyncio.run(scenario())
        # Every read GETs the Deployment; the switch's requests per read, from the fake's log.
        read = [r.path.rsplit("/", 2)[-2] for r in fake.requests if r.method == "GET"]
        reads = read.count("deployments")
        requests = reads + read.count("configmaps")

    assert reads_to_apply <= 2  # the next read applies it: within 10 s at the shipped pace
    for name, pod in pods:
        expected = Mode.PAUSED if name == "model-3" else Mode.ARMED
        assert lives[pod].current().mode is expected
    # A read every SWITCH_INTERVAL_S as shipped: its requests over that interval.
    assert reads >= len(pods) * 3 and requests / reads / SWITCH_INTERVAL_S <= 0.15
