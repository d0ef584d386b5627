"""The Kubernetes runtime: a canary Deployment beside the stable one, promotion by patching.

The stable instance is a Deployment whose pod also runs this sidecar; the canary is
`<name>-kvpilot-canary`, built from the stable pod template with the candidate's args.
Promotion patches the stable container's args (a rolling update), unless the Deployment
belongs to GitOps or the target says so: then the patch is written to the state directory
for a person or a pull request to apply (recommend-only), its secrets masked, and announced
as an Event on the Deployment (`recommend`). A plain
restart of the stable instance signals vLLM through the shared PID namespace (the `process`
runtime) or, where configured, patches `restartedAt` as `kubectl rollout restart` does.
The client is synchronous; every call runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime
from typing import Any, TypeVar

from kvpilot.agent.model import Instance
from kvpilot.agent.runtimes.base import (
    InstanceStatus,
    NotReady,
    Runtime,
    RuntimeFailure,
    RuntimeUnsupported,
    StopResult,
    UnknownInstance,
)
from kvpilot.agent.runtimes.kubernetes import api, objects, recommend
from kvpilot.agent.runtimes.kubernetes.api import Conflict, NotFound, call, client_module
from kvpilot.agent.runtimes.kubernetes.edits import EditWatch
from kvpilot.agent.runtimes.kubernetes.lease import DeploymentLease
from kvpilot.agent.runtimes.kubernetes.objects import ContainerCommand
from kvpilot.agent.runtimes.kubernetes.promotion_strategy import (
    promotion_strategy,
    strategy_restore,
)
from kvpilot.agent.runtimes.kubernetes.values import (
    KubernetesTarget,
    Promotion,
    PromotionNotApplied,
    Recommendation,
)
from kvpilot.agent.runtimes.offloop import in_daemon_thread
from kvpilot.agent.runtimes.probe import wait_ready
from kvpilot.collectors.secrets import mask_argv

DEPLOYMENTS = "deployments.apps"
PODS = "pods"
POLL_S = 1.0
CONFLICT_RETRIES = 3
RECOMMENDATIONS_KEPT = 5
RECOMMENDATION_ANNOTATION = "kvpilot.dev/recommendation"
POD_GONE_MARGIN_S = 30.0  # beyond the drain deadline: the kubelet's SIGKILL and clean-up
Probe = Callable[..., Awaitable[Any]]
T = TypeVar("T")
log = logging.getLogger(__name__)


class KubernetesRuntime:
    """The stable Deployment and its canary, through the official client."""

    kind = "kubernetes"
    # Through the Deployment; recommend-only writes the patch and says so (PromotionNotApplied).
    can_change_flags = True

    def record_decision(self, reason: str, message: str) -> None:
        """An Event for a tuning decision, where this runtime writes them (the pod runtime,
        through its Deployment's restart gate); none here. Blocking: call in a thread."""

    # Its reads wait on the API server: the tick runs them in a thread (runtimes.offloop).
    blocking_reads = True

    def __init__(
        self,
        target: KubernetesTarget,
        api_client: Any,
        *,
        process_runtime: Runtime | None = None,
        identity: str | None = None,
        lease_duration_s: int = 60,
        probe: Probe = wait_ready,
        wall_clock: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.monotonic,
        poll_s: float = POLL_S,
    ) -> None:
        client = client_module()
        self.target = target
        self.api_client = api_client
        self._apps = client.AppsV1Api(api_client)
        self._core = client.CoreV1Api(api_client)
        self._process = process_runtime  # the stable vLLM's processes, in the shared PID ns
        self.pod_name = identity  # this pod's name (downward API), when kvpilot runs in one
        self.edits = EditWatch()  # a person's edit of the stable during a trial wins
        self._probe = probe
        self._wall_clock = wall_clock
        self._clock = clock
        self._poll_s = poll_s
        self._canary_argv: tuple[str, ...] | None = None
        self._recommendations: deque[Recommendation] = deque(maxlen=RECOMMENDATIONS_KEPT)
        self.lease = DeploymentLease(
            api_client,
            namespace=target.namespace,
            deployment=target.deployment,
            identity=identity or f"kvpilot-{target.deployment}",
            duration_s=lease_duration_s,
            wall_clock=wall_clock,
            clock=clock,
        )

    # -- API calls -----------------------------------------------------------------------

    def _json(self, model: Any) -> dict[str, Any]:
        found: dict[str, Any] = self.api_client.sanitize_for_serialization(model)
        return found

    def _get(self, name: str) -> dict[str, Any] | None:
        what = f"Deployment {self.target.namespace}/{name}"
        try:
            found = call(
                self._apps.read_namespaced_deployment,
                name,
                self.target.namespace,
                verb="get",
                resource=DEPLOYMENTS,
                what=what,
            )
        except NotFound:
            return None
        return self._json(found)

    def _stable(self) -> dict[str, Any]:
        found = self._get(self.target.deployment)
        if found is None:
            raise UnknownInstance(
                f"Deployment {self.target.namespace}/{self.target.deployment} not found"
            )
        return found

    def _pods(self, deployment: dict[str, Any], only: str | None = None) -> list[dict[str, Any]]:
        """The Deployment's pods (`only`: the one of that name, if it is one of them)."""
        selector = objects.selector_string(deployment)
        found = call(
            self._core.list_namespaced_pod,
            self.target.namespace,
            label_selector=selector,
            field_selector=None if only is None else f"metadata.name={only}",
            verb="list",
            resource=PODS,
            what=f"pods {selector!r} in {self.target.namespace}",
        )
        return [self._json(pod) for pod in found.items]

    def _patch(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        self.lease.ensure_ours()
        patched = call(
            self._apps.patch_namespaced_deployment,
            name,
            self.target.namespace,
            body,
            _content_type="application/strategic-merge-patch+json",
            verb="patch",
            resource=DEPLOYMENTS,
            what=f"Deployment {self.target.namespace}/{name}",
        )
        if name == self.target.deployment:
            self.edits.note(self._json(patched))
        return self._json(patched)

    async def _io(self, fn: Callable[..., T], *args: Any) -> T:
        return await in_daemon_thread(fn, *args)  # not joined at exit: no wait on a hang

    # -- reading -------------------------------------------------------------------------

    def _role_of(self, name: str) -> str:
        if name == self.target.stable_name:
            return "stable"
        if name == self.target.canary_name:
            return "canary"
        raise UnknownInstance(f"no Kubernetes instance named {name!r}")

    def _ready_pod(self, pods: list[dict[str, Any]]) -> dict[str, Any] | None:
        ready = [p for p in pods if objects.pod_ready(p) and (p.get("status") or {}).get("podIP")]
        return ready[0] if ready else None

    def _started_wall_s(self, pod: dict[str, Any] | None) -> float | None:
        for status in ((pod or {}).get("status") or {}).get("containerStatuses") or ():
            started = ((status.get("state") or {}).get("running") or {}).get("startedAt")
            if status.get("name") == self.target.container and started:
                return datetime.fromisoformat(str(started).replace("Z", "+00:00")).timestamp()
        return None

    def _instance(self, role: str, deployment: dict[str, Any]) -> Instance:
        pod = self._ready_pod(self._pods(deployment))
        pod_ip = None if pod is None else pod["status"]["podIP"]
        kvpool = self.target.kvpool_port
        if role == "stable" and self.target.stable_url is not None:
            url = self.target.stable_url
            kvpool_url = None if kvpool is None else f"http://127.0.0.1:{kvpool}"
        else:
            host = pod_ip or ""
            url = f"http://{host}:{self.target.port}" if host else ""
            kvpool_url = None if kvpool is None or not host else f"http://{host}:{kvpool}"
        pids: frozenset[int] = frozenset()
        main_pid = None
        if role == "stable" and self._process is not None:
            # Only the sidecar's own pod is visible (shareProcessNamespace); canaries never.
            local = next(iter(self._process.instances()), None)
            if local is not None:
                pids, main_pid = local.pids, local.main_pid
        return Instance(
            name=self.target.stable_name if role == "stable" else self.target.canary_name,
            role="stable" if role == "stable" else "canary",
            url=url,
            kvpool_url=kvpool_url,
            pids=pids,
            main_pid=main_pid,
            argv=objects.container_argv(deployment, self.target.container),
            started_at_wall_s=self._started_wall_s(pod),
        )

    def instances(self) -> tuple[Instance, ...]:
        """The stable instance, and the canary while its Deployment exists."""
        out = [self._instance("stable", self._stable())]
        canary = self._get(self.target.canary_name)
        if canary is not None:
            out.append(self._instance("canary", canary))
        return tuple(out)

    def orphan_canary(self) -> str | None:
        """The canary Deployment, when one kvpilot made for this Deployment exists. Blocking."""
        found = self._get(self.target.canary_name)
        if found is None or not objects.is_canary_of(found, self.target.deployment):
            return None
        return f"{self.target.namespace}/{self.target.canary_name}"

    def status(self, name: str) -> InstanceStatus:
        role = self._role_of(name)
        if role == "stable" and self._process is not None:
            local = self._process.status(next(iter(self._process.instances())).name)
            return InstanceStatus(
                name, local.state, local.main_pid, local.since_wall_s, local.exit_code, local.reason
            )
        deployment = self._get(self.target.deployment if role == "stable" else name)
        if deployment is None:
            return InstanceStatus(name, "missing", None, None, reason="no Deployment")
        pods = self._pods(deployment)
        pod = self._ready_pod(pods)
        if pod is not None:
            return InstanceStatus(name, "running", None, self._started_wall_s(pod))
        for candidate in pods:
            failure = objects.container_failure(candidate, self.target.container)
            if failure is not None:
                return InstanceStatus(name, "exited", None, None, reason=failure[0])
        return InstanceStatus(name, "unknown", None, None, reason=f"{len(pods)} pods, none ready")

    # -- the canary ----------------------------------------------------------------------

    def _command(self, deployment: dict[str, Any], argv: Sequence[str]) -> ContainerCommand:
        spec = deployment["spec"]["template"]["spec"]
        container = objects.find_container(spec, self.target.container)
        if container is None:
            raise RuntimeFailure(
                f"Deployment {deployment['metadata']['name']!r} has no container "
                f"{self.target.container!r}"
            )
        try:
            return objects.split_argv(argv, container.get("command"))
        except ValueError as exc:
            raise RuntimeFailure(f"cannot run {mask_argv(argv)[:4]} in the pod: {exc}") from exc

    async def start_canary(self, argv: Sequence[str] | None, *, ready_timeout_s: float) -> Instance:
        """Create the canary Deployment with `argv` (the stable's when None), wait until ready."""
        stable = await self._io(self._stable)
        self.edits.note(stable)  # the Deployment as this trial found it
        if argv is None:
            argv = objects.container_argv(stable, self.target.container) or ()
        body = objects.build_canary(
            stable,
            container=self.target.container,
            command=self._command(stable, argv),
            sidecar_container=self.target.sidecar_container,
        )
        what = f"Deployment {self.target.namespace}/{self.target.canary_name}"
        self.lease.ensure_ours()
        try:
            await asyncio.to_thread(
                call,
                self._apps.create_namespaced_deployment,
                self.target.namespace,
                body,
                verb="create",
                resource=DEPLOYMENTS,
                what=what,
            )
        except Conflict as exc:
            raise RuntimeFailure(f"the canary already exists; stop it first ({exc})") from exc
        self._canary_argv = tuple(argv)
        return await self._wait_pod_ready(self.target.canary_name, "canary", ready_timeout_s)

    async def _wait_pod_ready(self, name: str, role: str, timeout_s: float) -> Instance:
        started = self._clock()
        deadline = started + timeout_s
        last = "no pod yet"
        while True:
            deployment = await self._io(self._get, name)
            if deployment is None:
                raise NotReady(f"Deployment {self.target.namespace}/{name} disappeared")
            pods = await self._io(self._pods, deployment)
            failed = objects.failed_start(pods, self.target.container)
            if failed is not None:
                why, tail, cluster = failed
                if cluster:
                    raise api.InfrastructureFailure(f"{role} {why}")
                raise NotReady(f"{role} {why}", tail)
            if self._ready_pod(pods) is not None:
                break
            last = f"{len(pods)} pods, none ready"
            placed = [m for m in map(objects.unschedulable, pods) if m is not None]
            if self._clock() >= deadline and placed:
                raise api.InfrastructureFailure(f"{role} {name!r} unschedulable: {placed[0]}")
            if self._clock() >= deadline:
                raise NotReady(
                    f"{role} Deployment {name!r} not ready within {timeout_s:.0f} s ({last})"
                )
            await asyncio.sleep(self._poll_s)
        instance = await self._io(self._instance, role, deployment)
        await self._probe(
            instance.url,
            api_key=self.target.api_key,
            timeout_s=max(0.0, deadline - self._clock()),
            clock=self._clock,
        )
        return instance

    async def _stop_canary(self, drain_timeout_s: float) -> StopResult:
        client = client_module()
        name = self.target.canary_name
        started = self._clock()
        what = f"Deployment {self.target.namespace}/{name}"
        existing = await self._io(self._get, name)
        if existing is None:
            return StopResult(name, False, False, None, (), 0.0)
        options = client.V1DeleteOptions(propagation_policy="Foreground")
        self.lease.ensure_ours()  # the canary's name is shared: it may be the new holder's
        try:
            await asyncio.to_thread(
                call,
                self._apps.delete_namespaced_deployment,
                name,
                self.target.namespace,
                body=options,
                verb="delete",
                resource=DEPLOYMENTS,
                what=what,
            )
        except NotFound:
            return StopResult(name, False, False, None, (), self._clock() - started)
        deadline = started + drain_timeout_s + POD_GONE_MARGIN_S
        while True:
            gone = await self._io(self._get, name) is None
            pods = await self._io(self._pods, existing)
            if gone and not pods:
                elapsed = self._clock() - started
                # The kubelet drains (SIGTERM, grace period); only the time tells whether it
                # finished within the drain deadline rather than by SIGKILL.
                return StopResult(name, True, elapsed <= drain_timeout_s, None, (), elapsed)
            if self._clock() >= deadline:
                raise RuntimeFailure(
                    f"the canary {name!r} still has {len(pods)} pods "
                    f"{deadline - started:.0f} s after its deletion"
                )
            await asyncio.sleep(self._poll_s)

    # -- promotion -----------------------------------------------------------------------

    def _recommend(self, stable: dict[str, Any], patch: dict[str, Any], why: str) -> Recommendation:
        done = recommend.recommend(
            self._core,
            self.target,
            stable,
            patch,
            why,
            wall_s=self._wall_clock(),
            identity=self.lease.identity,
        )
        self._recommendations.append(done)
        if objects.helm_owner(stable) is not None and objects.gitops_owner(stable) is None:
            self._annotate(done)  # Helm keeps annotations its chart does not set
        return done

    def _annotate(self, done: Recommendation) -> None:
        """The recommendation on the Deployment itself, where `kubectl get -o yaml` and a
        chart's maintainer see it; a refusal is logged (the Event and the file remain)."""
        where = str(done.path) if done.path is not None else done.kubectl
        note = {RECOMMENDATION_ANNOTATION: f"{done.reason}; patch: {where}"[:1024]}
        try:
            self._patch(self.target.deployment, {"metadata": {"annotations": note}})
        except RuntimeFailure as exc:
            log.warning("the recommendation is not annotated on the Deployment: %s", exc)

    def recommendations(self) -> tuple[Recommendation, ...]:
        """The latest recommend-only promotions, oldest first (the status API shows them)."""
        return tuple(self._recommendations)

    async def promote(self, argv: Sequence[str], *, ready_timeout_s: float) -> Promotion:
        """Set the stable container's args and wait for the rollout, or only write the patch."""
        started = self._clock()
        strategy: dict[str, Any] | None = None
        for attempt in range(CONFLICT_RETRIES):
            stable = await self._io(self._stable)
            command = self._command(stable, argv)
            self.edits.check(stable, "promoting")
            apply, why = recommend.promote_mode(self.target, stable)
            if not apply:
                patch = objects.args_patch(self.target.container, command, None)
                return Promotion(False, None, await self._io(self._recommend, stable, patch, why))
            version = stable["metadata"].get("resourceVersion")
            patch = objects.args_patch(self.target.container, command, version)
            # One replica at a time (or the stated surge): not twice the GPUs at once.
            strategy = promotion_strategy(stable, self.target.promotion_surge)
            if strategy is not None:
                patch["spec"]["strategy"] = strategy
            try:
                await self._io(self._patch, self.target.deployment, patch)
            except Conflict:
                if attempt == CONFLICT_RETRIES - 1:
                    raise
                continue  # changed since read: read it again and patch the new version
            break
        remaining = max(0.0, ready_timeout_s - (self._clock() - started))
        try:
            instance = await self._wait_rollout(remaining)
        finally:
            if strategy is not None:
                await self._restore_strategy(stable)
        return Promotion(True, instance, None)

    async def _restore_strategy(self, read: dict[str, Any]) -> None:
        """The Deployment's own rollout strategy back, as `read` before the promotion; a
        failure is logged, never the promotion's (its pods are already rolled out)."""
        try:
            await self._io(self._patch, self.target.deployment, strategy_restore(read))
        except RuntimeFailure as exc:
            log.warning(
                "Deployment %s/%s keeps the one-at-a-time rollout strategy of the promotion: "
                "restoring its own failed (%s)",
                self.target.namespace,
                self.target.deployment,
                exc,
            )

    async def _wait_rollout(self, timeout_s: float) -> Instance:
        started = self._clock()
        while True:
            stable = await self._io(self._stable)
            state = objects.rollout_state(stable)
            if state.failed:
                raise RuntimeFailure(
                    f"rollout of {self.target.deployment!r} failed: {state.reason}"
                )
            if state.complete:
                break
            if self._clock() - started >= timeout_s:
                raise NotReady(
                    f"rollout of {self.target.deployment!r} not complete within "
                    f"{timeout_s:.0f} s ({state.reason})"
                )
            await asyncio.sleep(self._poll_s)
        instance = await self._io(self._instance, "stable", stable)
        await self._probe(
            instance.url,
            api_key=self.target.api_key,
            timeout_s=max(0.0, timeout_s - (self._clock() - started)),
            clock=self._clock,
        )
        return instance

    # -- the Runtime protocol ------------------------------------------------------------

    async def start(self, name: str, *, ready_timeout_s: float = 600.0) -> Instance:
        """Start the canary with the last candidate argv (else the stable's)."""
        if self._role_of(name) == "stable":
            raise RuntimeUnsupported(
                "the stable Deployment is Kubernetes' to run; use restart (or promote)"
            )
        return await self.start_canary(self._canary_argv, ready_timeout_s=ready_timeout_s)

    async def stop(self, name: str, *, drain_timeout_s: float) -> StopResult:
        """Delete the canary Deployment and wait until its pods are gone."""
        if self._role_of(name) == "canary":
            return await self._stop_canary(drain_timeout_s)
        if self._process is None:
            raise RuntimeUnsupported("stopping the stable Deployment is not kvpilot's to do")
        local = next(iter(self._process.instances())).name
        return await self._process.stop(local, drain_timeout_s=drain_timeout_s)

    async def _refuse_fleet_rollout(self) -> None:
        """A rollout restarts every replica at once, around the Deployment's restart budget
        and its PodDisruptionBudget: with several replicas it is refused, saying why."""
        current = await self._io(self._get, self.target.deployment)
        replicas = int(((current or {}).get("spec") or {}).get("replicas") or 1)
        if replicas > 1:
            raise RuntimeUnsupported(
                f"restart: rollout would restart all {replicas} replicas of Deployment "
                f"{self.target.namespace}/{self.target.deployment} at once; configure "
                "restart: signal, which restarts this pod's vLLM under the Deployment's "
                "restart budget"
            )

    async def restart(
        self,
        name: str,
        *,
        drain_timeout_s: float,
        ready_timeout_s: float,
        argv: Sequence[str] | None = None,
    ) -> Instance:
        """Canary: recreate it (with `argv`). Stable: promote `argv`, or restart vLLM."""
        if self._role_of(name) == "canary":
            keep = self._canary_argv
            if argv is None:
                current = await self._io(self._get, name)
                if current is not None:
                    keep = objects.container_argv(current, self.target.container)
            await self._stop_canary(drain_timeout_s)
            chosen = tuple(argv) if argv is not None else keep
            return await self.start_canary(chosen, ready_timeout_s=ready_timeout_s)
        if argv is not None:
            promotion = await self.promote(argv, ready_timeout_s=ready_timeout_s)
            if promotion.recommendation is not None:
                raise PromotionNotApplied(promotion.recommendation)
            assert promotion.instance is not None
            return promotion.instance
        if self.target.restart == "rollout":
            await self._refuse_fleet_rollout()
            patch = objects.restart_patch(self._wall_clock())
            started = self._clock()
            await self._io(self._patch, self.target.deployment, patch)
            return await self._wait_rollout(ready_timeout_s - (self._clock() - started))
        if self._process is None:
            raise RuntimeUnsupported(
                "restarting vLLM in place needs the process runtime (shareProcessNamespace); "
                "or configure restart: rollout"
            )
        local = next(iter(self._process.instances())).name
        await self._process.restart(
            local, drain_timeout_s=drain_timeout_s, ready_timeout_s=ready_timeout_s
        )
        return await self._io(self._instance, "stable", await self._io(self._stable))

    async def aclose(self, *, drain_timeout_s: float = 30.0) -> None:
        """Leave the Deployments be: a canary left behind is the tuner's to clean up."""
        self.lease.record = None
