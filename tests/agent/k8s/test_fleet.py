"""A fleet on Kubernetes: 5 Deployments of 10 replicas, one sidecar loop per pod, in-process.

Each loop is the real AlertTracker feeding the real Remediator, as the sidecar's tick does,
with its runtime behind the Deployment's `FleetGate` (the real Lease slots, PDB check, Events
and kept-guards ConfigMap against the one fake API server, tests/fakes/k8s_fleet.py). Each pod's
vLLM is a stand-in (tests/fakes/standin_vllm.py) scraped over HTTP each tick; a restart there
is a stand-in's restart: a short drain, after which its surge is gone. Beside the loop, each
sidecar makes the API reads the shipped one makes at steady state: its pod runtime's view of
the Deployment (on the tick) and its live switch (its own task).
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from typing import Any

import httpx
import pytest
from kubernetes import client

from kvpilot.agent.alerts import AlertTracker
from kvpilot.agent.app.fleet_keep import VETOES_EVERY_S, DeploymentKeeping
from kvpilot.agent.mode import MODE_ANNOTATION, Mode
from kvpilot.agent.model import Instance
from kvpilot.agent.remediation import Remediator, WatchWindows
from kvpilot.agent.runtimes.kubernetes.fleet import decision_events as ev
from kvpilot.agent.runtimes.kubernetes.fleet.decision_events import DecisionEvents
from kvpilot.agent.runtimes.kubernetes.fleet.gate import FleetGate, FleetRestarts, GateTimings
from kvpilot.agent.runtimes.kubernetes.fleet.kept_guards import KeptGuards
from kvpilot.agent.runtimes.kubernetes.fleet.owner import owning_deployment
from kvpilot.agent.runtimes.kubernetes.fleet.pdb import disruption_verdict
from kvpilot.agent.runtimes.kubernetes.fleet.slots import RestartSlots
from kvpilot.agent.runtimes.kubernetes.pod import API_READ_INTERVAL_S, PodRuntime
from kvpilot.agent.runtimes.kubernetes.switch import (
    NAMESPACE_EVERY,
    SWITCH_INTERVAL_S,
    Layer,
    SwitchWatch,
    read_layers,
)
from kvpilot.agent.runtimes.kubernetes.values import KubernetesTarget
from kvpilot.agent.runtimes.offloop import runtime_read
from tests.agent.k8s.conftest import NAMESPACE, base_deployment
from tests.agent.remediation.remediation_helpers import condition, remediation_config
from tests.fakes.k8s_fleet import FakeFleetApi
from tests.fakes.remediation_journal import MemoryJournal
from tests.fakes.standin_vllm import StandInVllm

MODELS, REPLICAS = 5, 10
TICK_S = 0.5
SURGE = "kvpilot_test_surge 1\n"
TIMINGS = GateTimings(poll_s=1.0, max_wait_s=120, renew_every_s=1.0)
# The steady state runs the switches PACE times faster than shipped and reads each runtime's
# view every STEADY_VIEW_S (at least once in the window); each source's requests per read,
# counted, are scaled back to its shipped interval. Fifty readers in one process against the
# fake's threads on two cores: a faster pace made a read wait out its deadline.
PACE = 5.0
STEADY_VIEW_S = 4.0
# One cycle of the switch's: the namespace's ConfigMap on the first of these reads.
SWITCH_READS = NAMESPACE_EVERY


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


class CountedApi:
    """An API client that counts the requests it sends: the fake's log cannot tell whose a
    GET of a Deployment is (the runtime's view or the switch's)."""

    def __init__(self, fake: FakeFleetApi) -> None:
        configuration = client.Configuration(host=fake.host)
        # A connection kept for each of the fifty readers: a full pool would open and drop one
        # per request, past the fake's small accept backlog.
        configuration.connection_pool_maxsize = MODELS * REPLICAS
        self.client = client.ApiClient(configuration)
        self.sent = 0
        lock = threading.Lock()
        send = self.client.rest_client.request

        def counted(*args: Any, **kwargs: Any) -> Any:
            with lock:
                self.sent += 1
            return send(*args, **kwargs)

        self.client.rest_client.request = counted


@dataclasses.dataclass(frozen=True)
class Apis:
    """One client per source of requests, shared by the 50 in-process sidecars (each pod has
    its own in a cluster: fifty would keep fifty connection pools and threads in one process)."""

    gate: CountedApi  # the restart budget, PDB, Events, kept guards, ownerReferences
    views: CountedApi  # the pod runtime's view of the Deployment
    switch: CountedApi  # the live switch
    keeping: CountedApi  # the Deployment's kept vetoes, read every round

    def sent(self) -> int:
        return self.gate.sent + self.views.sent + self.switch.sent + self.keeping.sent


class Sidecar:
    """One pod's sidecar loop: scrape, rules, alerts, remediation, on the monotonic clock."""

    def __init__(
        self, apis: Apis, pod: dict[str, Any], server: StandInVllm, seen: Restarting
    ) -> None:
        api = apis.gate.client
        self.pod = pod["metadata"]["name"]
        self.deployment = owning_deployment(api, NAMESPACE, self.pod)  # from ownerReferences
        # The pod runtime's view of its Deployment, read on the tick as the sidecar's is, at
        # the shipped interval (its restarts here are the stand-in's, below).
        self.runtime = PodRuntime(
            KubernetesTarget(namespace=NAMESPACE, deployment=self.deployment, port=server.port),
            apis.views.client,
            identity=self.pod,
        )
        self.runtime.api_read_interval_s = API_READ_INTERVAL_S
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
        # The Deployment's kept vetoes, synced each round as the sidecar's keeping task does.
        self.keeping = DeploymentKeeping(
            KeptGuards(apis.keeping.client, namespace=NAMESPACE, deployment=self.deployment),
            DecisionEvents(
                apis.keeping.client, namespace=NAMESPACE, deployment=self.deployment, pod=self.pod
            ),
            self.remediator.vetoes,
            None,
        )
        self.keeping_rounds = 0
        self._switch_api = apis.switch.client
        self.switch_reads = self.switch_reads_ended = 0  # one at a time, in a daemon thread
        self.switch_reads_at_pause = 0
        self.read_paused: int | None = None  # the first read that found it paused

    def read_switch(self, namespace_too: bool) -> tuple[Layer, Layer]:
        self.switch_reads += 1
        try:
            read = read_layers(
                self._switch_api, NAMESPACE, self.deployment, namespace_too=namespace_too
            )
        finally:
            self.switch_reads_ended += 1
        if read[0].mode is Mode.PAUSED and self.read_paused is None:
            self.read_paused = self.switch_reads
        return read

    def switch(self, interval_s: float = SWITCH_INTERVAL_S) -> SwitchWatch:
        """The live switch as the sidecar runs it: its remediator's mode, read on a task."""
        return SwitchWatch(self.remediator.mode, self.read_switch, interval_s=interval_s)

    def breaker_fact(self) -> dict[str, Any]:
        return self.remediator.breaker.to_fact("vllm", time.monotonic(), time.time())

    async def tick(self, http: httpx.AsyncClient) -> None:
        await runtime_read(self.runtime, self.runtime.instances)
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
        # socketserver listens with a backlog of 5: fifty sidecars in one process connect at
        # once, and the connections past it would wait out a connect timeout (an API server's
        # backlog is in the thousands).
        fake._server.socket.listen(4096)
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
        apis = Apis(CountedApi(fake), CountedApi(fake), CountedApi(fake), CountedApi(fake))
        sidecars = []
        for pod in pods:
            server = stack.enter_context(StandInVllm())
            server.metrics = lambda: SURGE  # the surge trips the rule on every replica
            servers.append(server)
            sidecar = Sidecar(apis, pod, server, seen)
            sidecars.append(sidecar)

        def idle() -> bool:
            return not any(s.remediator.in_progress() for s in sidecars)

        async def switch_reads_ended() -> None:
            deadline = time.monotonic() + 10
            while any(s.switch_reads_ended < s.switch_reads for s in sidecars):
                assert time.monotonic() < deadline, "a switch's read did not end"
                await asyncio.sleep(0.05)

        async def steady_state() -> None:
            """Every loop ticking and every switch reading, the runtimes' views and the
            switches PACE times faster than shipped; a person pauses one Deployment once every
            switch has read once: `kubectl annotate deployment model-3 kvpilot.dev/mode=paused`."""
            for s in sidecars:
                s.runtime.api_read_interval_s = STEADY_VIEW_S

            async def switch(s: Sidecar, phase: float) -> None:  # run(), SWITCH_READS times
                watch = s.switch(SWITCH_INTERVAL_S / PACE)
                await asyncio.sleep(phase * watch.interval_s)  # pods started at their own time
                for _ in range(SWITCH_READS):
                    await watch.once()
                    await asyncio.sleep(watch.interval_s)
                await s.keeping.sync_vetoes()  # one round of the kept vetoes
                s.keeping_rounds += 1

            reads = [
                asyncio.create_task(switch(s, i / len(sidecars))) for i, s in enumerate(sidecars)
            ]
            at_steady = {s.pod: s.switch_reads for s in sidecars}

            def pause_then_done() -> bool:
                if all(s.switch_reads > at_steady[s.pod] for s in sidecars) and not paused:
                    for s in sidecars:
                        s.switch_reads_at_pause = s.switch_reads
                    meta = fake.deployments[(NAMESPACE, "model-3")].obj["metadata"]
                    meta.setdefault("annotations", {})[MODE_ANNOTATION] = "paused"
                    paused.append(True)
                return all(r.done() for r in reads)

            paused: list[bool] = []
            await run_loops(sidecars, pause_then_done, 60)
            await asyncio.gather(*reads)

        async def scenario() -> Window:
            # The fifty sidecars' blocking API calls share one process here: a pool sized for
            # them, so a holder's give-back does not queue behind forty waiters' polls.
            workers = stack.enter_context(ThreadPoolExecutor(max_workers=16))
            asyncio.get_running_loop().set_default_executor(workers)
            # The switches at the shipped pace through the surge, as the sidecar runs them.
            shipped = [asyncio.create_task(s.switch().run()) for s in sidecars]
            # Ticks go on until every remediation has ended: its verification is a tick's.
            await run_loops(sidecars, lambda: len(seen.done) == len(sidecars) and idle(), 90)
            for s in sidecars:
                await s.remediator.wait_idle()
            for task in shipped:
                task.cancel()
            await asyncio.gather(*shipped, return_exceptions=True)
            # Nothing in flight at either edge: every request of a read counted is in it.
            await switch_reads_ended()
            before = Window.now(fake, apis, sidecars)
            await steady_state()
            await switch_reads_ended()
            return Window.now(fake, apis, sidecars) - before

        steady = asyncio.run(scenario())

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
    # The switch applied by the next read (within 10 s at the shipped pace): a read under
    # way at the change may have read the old annotation. Only model-3 is paused.
    for s in sidecars:
        paused = s.deployment == "model-3"
        assert s.remediator.mode.current().mode is (Mode.PAUSED if paused else Mode.ARMED)
        if paused:
            assert s.read_paused is not None and s.read_paused - s.switch_reads_at_pause <= 2
    # Steady state as shipped: at most 0.2 API requests a second per sidecar. Every request in
    # the fake's log over the window is one a source counted; each source's requests per read
    # over its shipped interval (the view every API_READ_INTERVAL_S, the switch every
    # SWITCH_INTERVAL_S, its namespace's ConfigMap on one read of NAMESPACE_EVERY, the kept
    # vetoes every VETOES_EVERY_S); the restart budget asks nothing while nobody waits.
    assert steady.logged == steady.gate + steady.views + steady.switch + steady.keeping
    assert steady.switch_reads == len(sidecars) * SWITCH_READS
    assert steady.keeping_rounds == len(sidecars)
    assert steady.views_read >= len(sidecars) and steady.gate == 0
    view_s = steady.views / steady.views_read / API_READ_INTERVAL_S
    switch_s = steady.switch / steady.switch_reads / SWITCH_INTERVAL_S
    keeping_s = steady.keeping / steady.keeping_rounds / VETOES_EVERY_S
    total_s = view_s + switch_s + keeping_s
    print(
        f"steady state, per sidecar at the shipped pace: {total_s:.3f} API requests/s "
        f"(the runtime's view {view_s:.3f}: {steady.views / steady.views_read:.2f} requests "
        f"every {API_READ_INTERVAL_S:g} s; the switch {switch_s:.3f}: "
        f"{steady.switch / steady.switch_reads:.2f} every {SWITCH_INTERVAL_S:g} s; the kept "
        f"vetoes {keeping_s:.3f}: {steady.keeping / steady.keeping_rounds:.2f} every "
        f"{VETOES_EVERY_S:g} s)"
    )
    assert total_s <= 0.2


@dataclasses.dataclass(frozen=True)
class Window:
    """The API requests logged and sent by each source, and the reads each made."""

    logged: int
    gate: int
    views: int
    switch: int
    keeping: int
    views_read: int
    switch_reads: int
    keeping_rounds: int

    @classmethod
    def now(cls, fake: FakeFleetApi, apis: Apis, sidecars: list[Sidecar]) -> Window:
        return cls(
            len(fake.requests),
            apis.gate.sent,
            apis.views.sent,
            apis.switch.sent,
            apis.keeping.sent,
            sum(s.runtime.api_reads_total for s in sidecars),
            sum(s.switch_reads for s in sidecars),
            sum(s.keeping_rounds for s in sidecars),
        )

    def __sub__(self, before: Window) -> Window:
        return Window(
            *(
                a - b
                for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(before), strict=True)
            )
        )


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
