"""Tuning on the pod runtime, one way for `kvpilot tune` and the scheduled runs: the study of
the Deployment's live flags, the Kubernetes adapter under the Deployment's Lease, and the
recovery at start-up that first resumes a promotion an earlier pod handed over."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from kvpilot.agent.config.tuning import CanaryConfig, TuningConfig
from kvpilot.agent.runtimes.base import RuntimeFailure
from kvpilot.agent.runtimes.device_memory import server_device_memory_bytes
from kvpilot.agent.runtimes.kubernetes.handover_configmap import HandedOver, HandoverConfigMap
from kvpilot.agent.runtimes.kubernetes.lease import LeaseHeld
from kvpilot.agent.runtimes.kubernetes.pod import strict_reads
from kvpilot.agent.runtimes.kubernetes.restarts import CanaryRestarts
from kvpilot.agent.runtimes.kubernetes.runtime import KubernetesRuntime
from kvpilot.agent.runtimes.kubernetes.traffic import TrafficSplit
from kvpilot.agent.state.db import Database
from kvpilot.agent.state.trials import (
    SqliteRolloutJournal,
    SqliteTrialStore,
    record_from_dict,
    record_to_dict,
)
from kvpilot.agent.tuning.entry import Recovery, ShowProgress
from kvpilot.agent.tuning.handover import (
    HandoverJournal,
    HandoverRuntime,
    resume_handed_over,
)
from kvpilot.agent.tuning.pod.adapter import KubernetesTunerAdapter, traffic_split
from kvpilot.agent.tuning.pod.handover_trust import KeepEdits, consume_vouch, refusal, vouch
from kvpilot.agent.tuning.pod.live_observer import LiveTrafficObserver
from kvpilot.agent.tuning.server import TunedServer
from kvpilot.agent.tuning.study import (
    Study,
    build_study,
    make_observer,
    make_session,
    read_gpu,
)
from kvpilot.agent.tuning.workload.choice import WorkloadChoice
from kvpilot.tuner.problem.objective import Slo
from kvpilot.tuner.rollout.canary import RolloutSettings, held_records, recover
from kvpilot.tuner.rollout.ports import Observer
from kvpilot.tuner.session import TuningBlocked, TuningSession
from kvpilot.tuner.trials import trial_from_dict, trial_to_dict

log = logging.getLogger(__name__)

LEASE_WAIT_MARGIN_S = 2.0  # past the holder's expiry, for the clocks of two pods


def _never() -> bool:
    return False


def pod_adapter(
    runtime: KubernetesRuntime,
    *,
    drain_timeout_s: float,
    remediation_in_progress: Callable[[], bool] = _never,
    traffic: TrafficSplit | None = None,
) -> KubernetesTunerAdapter:
    return KubernetesTunerAdapter(
        runtime,
        drain_timeout_s=drain_timeout_s,
        remediation_in_progress=remediation_in_progress,
        traffic=traffic,
    )


def settings_of(study: Study) -> RolloutSettings:
    """The rollout settings a session of `study` runs under (its bake included)."""
    t = study.tuning
    live = t.canary.traffic != "replay"  # live: one analysis of many intervals, one bake
    return RolloutSettings(
        slo=study.slo,
        bake=t.bake,
        ready_timeout_s=study.ready_timeout_s,
        windows=1 if live else t.windows,
        bake_windows=1 if live else RolloutSettings().bake_windows,
    )


class PodTuner:
    """The pod runtime's tuning runs: each under the Deployment's Lease, each beginning with
    the recovery, each handing a promotion over to the next pod when kvpilot stops.

    `stable` reads the stable server from the Deployment (its live flags); `vllm_version`
    is its vLLM version (part of the fingerprint), `workload` what a replay sends (the
    learned workload once its window is full); `handover_map`: the ConfigMap a promotion
    under way is handed over in (None: the state directory alone)."""

    def __init__(
        self,
        runtime: KubernetesRuntime,
        db: Database,
        *,
        stable: Callable[[], TunedServer],
        tuning: TuningConfig,
        drain_timeout_s: float,
        remediation_in_progress: Callable[[], bool] = _never,
        api_key: str | None = None,
        vllm_version: Callable[[], str | None] = lambda: None,
        workload: Callable[[], WorkloadChoice | None] = lambda: None,
        handover_map: HandoverConfigMap | None = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.runtime = runtime
        self.tuning = tuning
        self._stable = stable
        self._drain_timeout_s = drain_timeout_s
        self._remediating = remediation_in_progress
        self.adapter = pod_adapter(
            runtime,
            drain_timeout_s=drain_timeout_s,
            remediation_in_progress=remediation_in_progress,
        )
        self.traffic: TrafficSplit | None = None  # live traffic's split, read in `study`
        self.restarts = CanaryRestarts(runtime.api_client, runtime.target)  # on live traffic
        self._db = db
        self._api_key = api_key
        self._wall = wall_clock
        self.journal: HandoverJournal | None = None  # the current session's
        self.refused_handovers: list[str] = []  # why, each handover not resumed
        self._map = handover_map
        self._vllm_version = vllm_version
        self._workload = workload

    @property
    def name(self) -> str:
        return self.runtime.target.stable_name

    @property
    def start_wait_s(self) -> float:
        """A pod that starts while the one it replaces still holds the Lease waits it out."""
        return 2.0 * self.runtime.lease.duration_s

    def stable_argv(self) -> tuple[str, ...]:
        return self.adapter.stable_argv()

    def _study_now(self, tuning: TuningConfig) -> Study:
        """The study of the Deployment's live flags (blocking: reads the API server)."""
        chosen = self._workload() if tuning.canary.traffic == "replay" else None
        return build_study(
            self._stable(), tuning, read_gpu(), vllm_version=self._vllm_version(), chosen=chosen
        )

    async def study(self, tuning: TuningConfig | None = None) -> Study:
        """The study of a run under `tuning` (default: the tuner's)."""
        tuning = tuning or self.tuning
        with strict_reads():  # the Deployment's flags, never the process's view of them
            study = await asyncio.to_thread(self._study_now, tuning)
            if tuning.canary.traffic != "replay" and self.traffic is None:
                # The split of live traffic reads the stable Deployment's canary selector.
                self.traffic = await asyncio.to_thread(
                    traffic_split, tuning.canary, self.runtime.api_client, self.runtime.target
                )
                self.adapter = pod_adapter(
                    self.runtime,
                    drain_timeout_s=self._drain_timeout_s,
                    traffic=self.traffic,
                    remediation_in_progress=self._remediating,
                )
        return study

    def live_observer(self) -> Callable[[CanaryConfig, Slo], Observer] | None:
        """The observer of live traffic through the split `study` read (None: a replay)."""
        traffic = self.traffic
        if traffic is None:
            return None

        def live(canary: CanaryConfig, slo: Slo) -> Observer:
            return LiveTrafficObserver(
                canary, traffic, slo, api_key=self._api_key, restarts=self.restarts
            )

        return live

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

    async def recover(self, study: Study) -> Recovery:
        """Within the Lease: resume what an earlier pod handed over, recover the rest."""
        journal, store = SqliteRolloutJournal(self._db), SqliteTrialStore(self._db)
        found = None if self._map is None else await asyncio.to_thread(self._map.read)
        imported = None
        if found is not None and await asyncio.to_thread(self._trusted, found, study):
            imported = self._import_handover((found.rollout, found.trial), journal, store)
        observer, _ = make_observer(
            study,
            device_memory=server_device_memory_bytes,
            api_key=self._api_key,
            live=self.live_observer(),
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
        # What is left is nobody's: another pod's, evicted mid-trial, with its emptyDir; a
        # canary held for a person's review is not (it waits for `kvpilot tuning release`).
        held = held_records(journal)
        swept = None if held else await self.adapter.sweep_orphaned_canary()
        return Recovery(tuple(resumed), tuple(recovered), swept, tuple(respectful.kept))

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

    def session(self, study: Study, *, on_progress: ShowProgress | None = None) -> TuningSession:
        """A session whose promotion, when kvpilot stops during it, is handed over."""
        journal = HandoverJournal(SqliteRolloutJournal(self._db))
        self.journal = journal
        runtime = HandoverRuntime(self.adapter, journal)
        return make_session(
            study,
            runtime,
            self._db,
            device_memory=server_device_memory_bytes,
            api_key=self._api_key,
            journal=journal,
            live=self.live_observer(),
            on_progress=on_progress,
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
