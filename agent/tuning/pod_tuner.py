"""Tuning on the pod runtime, one way for `kvpilot tune` and the scheduled runs: the study of
the Deployment's live flags, the Kubernetes adapter under the Deployment's Lease, and the
recovery at start-up that first resumes a promotion an earlier pod handed over."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from kvpilot.agent.config import AgentConfig, PodRuntimeConfig
from kvpilot.agent.config.tuning import TuningConfig
from kvpilot.agent.runtimes.base import RuntimeFailure
from kvpilot.agent.runtimes.kubernetes.handover_configmap import HandedOver
from kvpilot.agent.runtimes.kubernetes.lease import LeaseHeld
from kvpilot.agent.runtimes.kubernetes.pod import PodRuntime, strict_reads
from kvpilot.agent.runtimes.kubernetes.restarts import CanaryRestarts
from kvpilot.agent.runtimes.kubernetes.runtime import KubernetesRuntime
from kvpilot.agent.runtimes.kubernetes.traffic import TrafficSplit
from kvpilot.agent.runtimes.local import LocalInstanceSpec
from kvpilot.agent.state.db import Database
from kvpilot.agent.state.trials import (
    SqliteRolloutJournal,
    SqliteTrialStore,
    record_from_dict,
    record_to_dict,
)
from kvpilot.agent.tuning.handover import (
    HandoverJournal,
    HandoverRuntime,
    Resumed,
    resume_handed_over,
)
from kvpilot.agent.tuning.handover_trust import KeepEdits, consume_vouch, refusal, vouch
from kvpilot.agent.tuning.kubernetes_adapter import KubernetesTunerAdapter, traffic_split
from kvpilot.agent.tuning.study import (
    Study,
    StudyError,
    build_study,
    make_observer,
    make_session,
    read_gpu,
)
from kvpilot.agent.tuning.workload.choice import WorkloadChoice
from kvpilot.tuner.rollout import Recovered, RolloutSettings, recover
from kvpilot.tuner.session import TuningBlocked, TuningSession
from kvpilot.tuner.trials import trial_from_dict, trial_to_dict

log = logging.getLogger(__name__)

LEASE_WAIT_MARGIN_S = 2.0  # past the holder's expiry, for the clocks of two pods


def _never() -> bool:
    return False


def pod_stable_spec(config: AgentConfig, runtime: KubernetesRuntime) -> LocalInstanceSpec:
    """The stable instance as the study sees it: the Deployment's live vLLM argv (command
    and args). Reads the API server; StudyError when the container has no vLLM argv."""
    assert isinstance(config.runtime, PodRuntimeConfig)
    stable = next(i for i in runtime.instances() if i.role == "stable")
    if not stable.argv:
        raise StudyError(
            f"container {runtime.target.container!r} of Deployment "
            f"{runtime.target.namespace}/{runtime.target.deployment} has no vLLM command line"
        )
    return LocalInstanceSpec(
        stable.name, tuple(stable.argv), "stable", (), config.runtime.kvpool_port, ()
    )


def pod_study(
    config: AgentConfig,
    runtime: KubernetesRuntime,
    tuning: TuningConfig,
    vllm_version: str | None = None,
    chosen: WorkloadChoice | None = None,
) -> Study:
    stable = pod_stable_spec(config, runtime)
    return build_study(
        config, tuning, read_gpu(), stable=stable, vllm_version=vllm_version, chosen=chosen
    )


def pod_adapter(
    config: AgentConfig,
    runtime: KubernetesRuntime,
    *,
    remediation_in_progress: Callable[[], bool] = _never,
    traffic: TrafficSplit | None = None,
) -> KubernetesTunerAdapter:
    return KubernetesTunerAdapter(
        runtime,
        drain_timeout_s=config.runtime.drain_timeout_s,
        remediation_in_progress=remediation_in_progress,
        traffic=traffic,
    )


def settings_of(study: Study) -> RolloutSettings:
    """The rollout settings a session of `study` runs under (its bake included)."""
    t = study.tuning
    return RolloutSettings(slo=study.slo, bake=t.bake, ready_timeout_s=study.ready_timeout_s)


@dataclass(frozen=True, slots=True)
class PodRecovery:
    resumed: list[Resumed]
    recovered: list[Recovered]
    swept: str | None = None  # an orphaned canary cleaned up, in words
    kept: tuple[str, ...] = ()  # restores not made: a person had changed the Deployment


class PodTuner:
    """The pod runtime's tuning runs: each under the Deployment's Lease, each beginning with
    the recovery, each handing a promotion over to the next pod when kvpilot stops."""

    def __init__(
        self,
        config: AgentConfig,
        runtime: KubernetesRuntime,
        db: Database,
        *,
        remediation_in_progress: Callable[[], bool] = _never,
        api_key: str | None = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.runtime = runtime
        self._remediating = remediation_in_progress
        self.adapter = pod_adapter(config, runtime, remediation_in_progress=remediation_in_progress)
        self.traffic: TrafficSplit | None = None  # live traffic's split, read in `study`
        self.restarts = CanaryRestarts(runtime.api_client, runtime.target)  # on live traffic
        self._db = db
        self._api_key = api_key
        self._wall = wall_clock
        self.journal: HandoverJournal | None = None  # the current session's
        self.refused_handovers: list[str] = []  # why, each handover not resumed
        self._map = runtime.handover_map if isinstance(runtime, PodRuntime) else None
        self.vllm_version: Callable[[], str | None] = lambda: None  # the stable server's
        # What a replay would send (the learned workload once its window is full).
        self.workload: Callable[[], WorkloadChoice | None] = lambda: None

    async def study(self, tuning: TuningConfig | None = None) -> Study:
        tuning = tuning or self.config.tuning
        with strict_reads():  # the Deployment's flags, never the process's view of them
            study = await asyncio.to_thread(
                pod_study,
                self.config,
                self.runtime,
                tuning,
                self.vllm_version(),
                self.workload() if tuning.canary.traffic == "replay" else None,
            )
            if tuning.canary.traffic != "replay" and self.traffic is None:
                # The split of live traffic reads the stable Deployment's canary selector.
                self.traffic = await asyncio.to_thread(
                    traffic_split, tuning.canary, self.runtime.api_client, self.runtime.target
                )
                self.adapter = pod_adapter(
                    self.config,
                    self.runtime,
                    traffic=self.traffic,
                    remediation_in_progress=self._remediating,
                )
        return study

    @contextlib.asynccontextmanager
    async def lease(self, *, wait_s: float = 0.0) -> AsyncIterator[None]:
        """The Deployment's tuning Lease; TuningBlocked when another tuner holds it beyond
        `wait_s` (a pod starting while the one it replaces still holds it waits)."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                await asyncio.to_thread(self.runtime.lease.acquire)  # ours from here on
                break
            except LeaseHeld as exc:
                left = exc.expires_at_wall_s - self._wall() + LEASE_WAIT_MARGIN_S
                if time.monotonic() + left > deadline:
                    raise TuningBlocked(str(exc)) from exc
                await asyncio.sleep(max(0.1, left))
        try:
            async with self.adapter.lease():  # re-takes our own Lease, renews, releases
                with strict_reads():
                    yield
        except LeaseHeld as exc:  # taken between the two reads
            raise TuningBlocked(str(exc)) from exc

    async def recover(self, study: Study) -> PodRecovery:
        """Within the Lease: resume what an earlier pod handed over, recover the rest."""
        journal, store = SqliteRolloutJournal(self._db), SqliteTrialStore(self._db)
        found = None if self._map is None else await asyncio.to_thread(self._map.read)
        imported = None
        if found is not None and await asyncio.to_thread(self._trusted, found, study):
            imported = self._import_handover((found.rollout, found.trial), journal, store)
        observer, _ = make_observer(
            study, api_key=self._api_key, traffic=self.traffic, restarts=self.restarts
        )
        resumed = await resume_handed_over(
            journal, store, self.adapter, observer, settings_of(study), wall_clock=self._wall
        )
        respectful = KeepEdits(self.adapter, study.space)
        recovered = await recover(
            journal,
            store,
            respectful,
            at_wall_s=self._wall(),
            ready_timeout_s=study.ready_timeout_s,
        )
        if imported is not None and self._map is not None:
            record = journal.get(imported)
            if record is None or record.phase.final:
                await asyncio.to_thread(self._map.delete)  # done with: nobody resumes it again
        # What is left is nobody's: another pod's, evicted mid-trial, with its emptyDir.
        swept = await self.adapter.sweep_orphaned_canary()
        return PodRecovery(resumed, recovered, swept, tuple(respectful.kept))

    def _trusted(self, found: HandedOver, study: Study) -> bool:
        """Whether the handover may be resumed (handover_trust); the vouch is consumed
        either way, so the same record is never resumed twice (blocking: in a thread)."""
        try:
            record = record_from_dict(found.rollout)
        except (KeyError, TypeError, ValueError) as exc:
            log.error("the handover ConfigMap is not a rollout: %s", exc)
            return False
        argvs = {"candidate": record.candidate_argv, "stable": record.stable_argv}
        live = self.adapter.stable_argv()
        why = refusal(self.runtime.lease, found.digest, argvs, live, study.space)
        consume_vouch(self.runtime.lease)
        if why is not None:
            log.error("the handover of trial %s is not resumed: %s", record.trial_id, why)
            self.refused_handovers.append(why)
            return False
        return True

    def _import_handover(
        self,
        found: tuple[dict[str, Any], dict[str, Any] | None],
        journal: SqliteRolloutJournal,
        store: SqliteTrialStore,
    ) -> str | None:
        """The handover ConfigMap's rollout and trial, into this pod's state when it does not
        hold them yet; returns the trial's id (None: not a rollout)."""
        try:
            record = record_from_dict(found[0])
            trial = None if found[1] is None else trial_from_dict(found[1])
        except (KeyError, TypeError, ValueError) as exc:
            log.error("the handover ConfigMap is not a rollout: %s", exc)
            return None
        if trial is not None and store.get(trial.trial_id) is None:
            store.add(trial)
        if journal.get(record.trial_id) is None:
            journal.save(record)
            log.info(
                "trial %s handed over in %s by another pod: resuming it here",
                record.trial_id,
                record.phase.value,
            )
        return record.trial_id

    def session(self, study: Study, **kw: object) -> TuningSession:
        """A session whose promotion, when kvpilot stops during it, is handed over."""
        journal = HandoverJournal(SqliteRolloutJournal(self._db))
        self.journal = journal
        runtime = HandoverRuntime(self.adapter, journal)
        return make_session(
            study,
            runtime,
            self._db,
            api_key=self._api_key,
            journal=journal,
            traffic=self.traffic,
            restarts=self.restarts,
            **kw,  # type: ignore[arg-type]
        )

    def hand_over(self) -> None:
        """kvpilot is stopping: a promotion under way is left for the next pod to bake, in
        the state directory (which must persist) or, configured so, in a ConfigMap."""
        kept = None if self.journal is None else self.journal.hand_over()
        if kept is None:
            return
        log.warning("trial %s is %s: handed over to the next pod", kept.trial_id, kept.phase.value)
        if self._map is None:
            return
        trial = SqliteTrialStore(self._db).get(kept.trial_id)
        try:  # kvpilot is stopping: a synchronous call is all there is time for
            digest = self._map.put(
                record_to_dict(kept), None if trial is None else trial_to_dict(trial)
            )
            if not vouch(self.runtime.lease, digest):
                log.error("trial %s: another tuner holds the Lease; not vouched for", kept.trial_id)
        except RuntimeFailure as exc:
            log.error("the promotion of trial %s could not be handed over: %s", kept.trial_id, exc)
