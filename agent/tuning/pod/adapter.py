"""The tuner over the Kubernetes runtime: the canary is a Deployment beside the stable one,
promotion patches the stable Deployment's args (a rolling update), and a Lease keeps one
tuner per Deployment. In recommend-only mode (GitOps owns the Deployment, or the target
says so) a promotion writes the patch instead; the tuner sees that as a refused restart:
the trial ends rolled back with the patch's path in its reason, the stable untouched.
On live traffic the canary's share goes back to the stable pods before the canary is
removed; where it cannot, the canary keeps serving rather than leave its share to errors."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

from kvpilot.agent.config.tuning import CanaryConfig
from kvpilot.agent.runtimes.base import NotReady, RuntimeFailure
from kvpilot.agent.runtimes.kubernetes import objects
from kvpilot.agent.runtimes.kubernetes.api import (
    InfrastructureFailure,
    KubernetesApiError,
    call,
    client_module,
)
from kvpilot.agent.runtimes.kubernetes.edits import EditedMeanwhile
from kvpilot.agent.runtimes.kubernetes.fleet.decision_events import (
    PROMOTED,
    ROLLED_BACK,
    TRIAL_ENDED,
    TRIAL_STARTED,
)
from kvpilot.agent.runtimes.kubernetes.fleet.gate import GateRefused
from kvpilot.agent.runtimes.kubernetes.lease import LeaseRecord
from kvpilot.agent.runtimes.kubernetes.runtime import KubernetesRuntime
from kvpilot.agent.runtimes.kubernetes.traffic import GatewayWeights, ServiceShare, TrafficSplit
from kvpilot.agent.runtimes.kubernetes.unattended import UNATTENDED, UnattendedCanaries
from kvpilot.agent.runtimes.kubernetes.values import KubernetesTarget, PromotionNotApplied
from kvpilot.agent.tuning.pod.live_observer import describe
from kvpilot.collectors.secrets import SecretLost, has_masked, mask_argv, restore_secrets
from kvpilot.tuner.rollout.ports import CandidateStartFailed, RestartRefused

log = logging.getLogger(__name__)
PULL_BACK_TRIES = 3
PULL_BACK_PAUSE_S = 0.5  # doubled after each failed try


class KubernetesTunerAdapter:
    """The tuner's TunerRuntime over a KubernetesRuntime."""

    def __init__(
        self,
        runtime: KubernetesRuntime,
        *,
        drain_timeout_s: float = 30.0,
        remediation_in_progress: Callable[[], bool] = lambda: False,
        traffic: TrafficSplit | None = None,
        unattended: UnattendedCanaries = UNATTENDED,
    ) -> None:
        self._runtime = runtime
        self._unattended = unattended  # exported: a canary left serving pages a person
        self._drain_s = drain_timeout_s
        self._remediating = remediation_in_progress
        self._traffic = traffic  # live traffic: taken back before the canary goes
        self.pulled_back: list[str] = []  # each pull-back's shares, in words

    @contextlib.asynccontextmanager
    async def lease(self) -> AsyncIterator[LeaseRecord]:
        """Hold the Deployment's tuning Lease for a run (LeaseHeld: another tuner has it)."""
        self._runtime.edits.forget()  # edits before this run are not edits during a trial
        async with self._runtime.lease.held() as record:
            yield record

    @property
    def _deployment(self) -> str:
        return f"{self._runtime.target.namespace}/{self._runtime.target.deployment}"

    def stable_argv(self) -> tuple[str, ...]:
        stable = next(i for i in self._runtime.instances() if i.role == "stable")
        return tuple(stable.argv or ())

    def stable_url(self) -> str:
        return next(i.url for i in self._runtime.instances() if i.role == "stable")

    def _with_secrets(self, argv: Sequence[str]) -> tuple[str, ...]:
        """An argv read back from the journal holds its secrets masked: the stable's own."""
        if not has_masked(argv):
            return tuple(argv)
        try:
            return restore_secrets(argv, self.stable_argv())
        except SecretLost as exc:
            raise RuntimeFailure(str(exc)) from exc

    async def start_canary(self, argv: Sequence[str], *, ready_timeout_s: float) -> str:
        argv = self._with_secrets(argv)
        try:
            instance = await self._runtime.start_canary(argv, ready_timeout_s=ready_timeout_s)
        except (KubernetesApiError, InfrastructureFailure) as exc:
            raise _infrastructure(exc) from exc  # a failed trial, not an infeasible one
        except NotReady as exc:
            # The pod's termination message is vLLM's last words (FallbackToLogsOnError).
            raise CandidateStartFailed(str(exc), exc.log_tail or str(exc)) from exc
        await self._decided(
            TRIAL_STARTED,
            f"trial canary {self._runtime.target.canary_name} serving: {' '.join(mask_argv(argv))}",
        )
        return instance.url

    async def stop_canary(self) -> None:
        """Take the canary's traffic back (live traffic), then delete the canary."""
        self._runtime.lease.ensure_ours()  # after a loss the route is the new holder's
        if self._traffic is not None:
            shares = await self._pull_back(self._traffic)
            self.pulled_back.append(describe(shares))
            if shares.canary_percent > 0:
                self._unattended.mark(self._deployment)
                raise RuntimeFailure(
                    f"the canary keeps running: the split still sends it traffic "
                    f"({describe(shares)})"
                )
        await self._runtime.stop(self._runtime.target.canary_name, drain_timeout_s=self._drain_s)
        self._unattended.clear(self._deployment)
        await self._decided(TRIAL_ENDED, f"trial canary {self._runtime.target.canary_name} removed")

    async def _pull_back(self, traffic: TrafficSplit) -> Any:
        """The canary's share back to the stable pods, tried PULL_BACK_TRIES times (a 403,
        a 500 or a conflict may pass); a share that cannot come back is logged as an error
        that needs a person, and raised: the canary keeps serving rather than fail it."""
        pause_s = PULL_BACK_PAUSE_S
        for attempt in range(1, PULL_BACK_TRIES + 1):
            try:
                return await traffic.pull_back()
            except Exception as exc:
                failure = f"{type(exc).__name__}: {exc}"
                log.warning(
                    "pulling the canary's traffic back failed (try %d): %s", attempt, failure
                )
                if attempt < PULL_BACK_TRIES:
                    await asyncio.sleep(pause_s)
                    pause_s *= 2
                    continue
                log.error(
                    "the canary %s keeps its share of live traffic: pulling it back failed "
                    "%d times (%s); a person must move the traffic back and delete the canary",
                    self._runtime.target.canary_name,
                    PULL_BACK_TRIES,
                    failure,
                )
                self._unattended.mark(self._deployment)
                raise RuntimeFailure(
                    "the canary keeps running: its share of the traffic could not be sent "
                    f"back to the stable pods ({failure})"
                ) from exc
        raise AssertionError("unreachable")

    async def sweep_orphaned_canary(self) -> str | None:
        """A canary that no trial of this pod owns (a pod evicted mid-trial left it, with
        its share of the traffic): its share taken back and the canary deleted. Call it
        holding the Lease, after recovery; returns what was done, or None (no canary)."""
        canary = await asyncio.to_thread(self._runtime.orphan_canary)
        if canary is None:
            return None
        log.warning("a canary no trial owns was found (%s): cleaning it up", canary)
        self._unattended.mark(self._deployment)  # until it is gone
        await self.stop_canary()
        pulled = f"; traffic: {self.pulled_back[-1]}" if self._traffic is not None else ""
        return f"removed the orphaned canary {canary}{pulled}"

    async def set_stable(
        self, argv: Sequence[str], *, reason: str, ready_timeout_s: float, restore: bool = False
    ) -> None:
        """Promote `argv` into the stable Deployment (rolling), or write the patch."""
        argv = self._with_secrets(argv)
        try:
            await self._runtime.restart(
                self._runtime.target.stable_name,
                drain_timeout_s=self._drain_s,
                ready_timeout_s=ready_timeout_s,
                argv=argv,
            )
        except (PromotionNotApplied, GateRefused) as exc:
            # The fleet's restart budget said no (or wait too long): nothing was changed, so
            # the trial is refused, not a candidate that failed to start.
            raise RestartRefused(str(exc)) from exc
        except NotReady as exc:
            raise CandidateStartFailed(str(exc), exc.log_tail or str(exc)) from exc
        except (KubernetesApiError, InfrastructureFailure) as exc:
            raise _infrastructure(exc) from exc  # a failed trial, not an infeasible one
        except EditedMeanwhile:
            raise  # a person's edit wins: the trial fails, saying so, and nothing is written
        except RuntimeFailure as exc:  # a rollout that failed: the new flags' pods did
            raise CandidateStartFailed(str(exc), "") from exc
        flags = " ".join(mask_argv(argv))
        if restore:
            await self._decided(ROLLED_BACK, f"rolled back to {flags} ({reason})")
        else:
            await self._decided(PROMOTED, f"promoted {flags} ({reason})")

    async def _decided(self, reason: str, message: str) -> None:
        """An Event on the pod and its Deployment, where the runtime writes them; a failure
        to write one never fails the trial."""
        try:
            await asyncio.to_thread(self._runtime.record_decision, reason, message)
        except Exception as exc:
            log.warning("the %s Event was not written: %s", reason, exc)

    def remediation_in_progress(self) -> bool:
        return self._remediating()


def _infrastructure(exc: RuntimeFailure) -> InfrastructureFailure:
    """A failure of the cluster as the trial's outcome: the tuner records the trial failed
    (reported, never an observation for the optimiser), unlike CandidateStartFailed."""
    if isinstance(exc, InfrastructureFailure):
        return exc
    return InfrastructureFailure(f"the Kubernetes API failed the trial: {exc}")


def traffic_split(
    canary: CanaryConfig, api_client: Any, target: KubernetesTarget
) -> TrafficSplit | None:
    """The split `tuning.canary.traffic` asks for (None for replay), over the stable
    Deployment's canary; reads the stable Deployment once (blocking: call it in a thread)."""
    if canary.traffic == "replay":
        return None
    stable = call(
        client_module().AppsV1Api(api_client).read_namespaced_deployment,
        target.deployment,
        target.namespace,
        verb="get",
        resource="deployments.apps",
        what=f"Deployment {target.namespace}/{target.deployment}",
    )
    selector = canary_selector(api_client.sanitize_for_serialization(stable), target)
    if canary.traffic == "service":
        service = canary.service or target.deployment
        return ServiceShare(
            api_client, namespace=target.namespace, service=service, canary_selector=selector
        )
    gateway = canary.gateway
    assert gateway is not None  # the configuration requires it for traffic: gateway
    return GatewayWeights(
        api_client,
        namespace=target.namespace,
        route=gateway.httproute,
        stable_service=gateway.stable_service,
        canary_service=gateway.canary_service,
        canary_selector=selector,
    )


def canary_selector(stable: Mapping[str, Any], target: KubernetesTarget) -> dict[str, str]:
    """The canary Deployment's pod selector, exactly as `build_canary` makes it."""
    probe = objects.build_canary(
        stable,
        container=target.container,
        command=objects.ContainerCommand(None, ("--",)),
        sidecar_container=target.sidecar_container,
    )
    return dict(probe["spec"]["selector"]["matchLabels"])
