"""A promotion on the pod runtime outlives the pod that promoted it.

Promotion patches the Deployment the sidecar runs in: the rolling update replaces the
promoting pod. Its sidecar hands the rollout over instead of undoing it: once a rollout is
`promoting` or `baking` and the sidecar stops, the journal keeps that phase (later saves of
the trial are dropped) and nothing restores the old flags. The state directory is on a
PersistentVolumeClaim, so the new pod's sidecar finds the record and resumes:

* `promoting`/`baking` whose candidate flags are now the Deployment's live ones: the bake
  window is watched, then the trial is `promoted`, or reverted when the flags degraded;
* `reverting` whose old flags are live again: the revert finished, `reverted`;
* anything else is left to `recover` (the canary stopped, the old flags restored, aborted).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvpilot.collectors.secrets import mask_argv
from kvpilot.tuner.problem.objective import evaluate
from kvpilot.tuner.rollout.canary import Phase, RolloutRecord, RolloutSettings, bake_degradation
from kvpilot.tuner.rollout.ports import Observer, PassThroughRuntime, RolloutJournal, TunerRuntime
from kvpilot.tuner.trials import TrialStore

log = logging.getLogger(__name__)

HANDED_OVER = frozenset({Phase.PROMOTING, Phase.BAKING})


class HandoverJournal:
    """A rollout journal that, once `hand_over` is called while a rollout is promoting or
    baking, keeps that record as it is: the next pod's sidecar resumes from it."""

    def __init__(self, inner: RolloutJournal) -> None:
        self._inner = inner
        self._last: RolloutRecord | None = None
        self._frozen: str | None = None  # the trial whose record is kept

    def save(self, record: RolloutRecord) -> None:
        if record.trial_id == self._frozen:
            log.info(
                "trial %s handed over in %s: %s not saved",
                record.trial_id,
                self._last.phase.value if self._last else "?",
                record.phase.value,
            )
            return
        self._inner.save(record)
        self._last = record

    def hand_over(self) -> RolloutRecord | None:
        """Keep the rollout in progress as it stands when it is promoting or baking; returns
        the record kept (None: nothing to hand over, a stop cleans up as usual)."""
        last = self._last
        if last is None or last.phase not in HANDED_OVER:
            return None
        self._frozen = last.trial_id
        return last

    @property
    def handed_over(self) -> bool:
        return self._frozen is not None

    def get(self, trial_id: str) -> RolloutRecord | None:
        return self._inner.get(trial_id)

    def open_records(self) -> list[RolloutRecord]:
        return self._inner.open_records()

    def records(self) -> list[RolloutRecord]:
        return self._inner.records()


class HandoverRuntime(PassThroughRuntime):
    """The tuner's runtime that, once its journal has handed a rollout over, restores
    nothing: the stopping pod leaves the promoted flags to the next pod's bake."""

    def __init__(self, inner: TunerRuntime, journal: HandoverJournal) -> None:
        super().__init__(inner)
        self._journal = journal

    async def set_stable(
        self, argv: Sequence[str], *, reason: str, ready_timeout_s: float, restore: bool = False
    ) -> None:
        if self._journal.handed_over:
            log.info("not restoring the stable flags (%s): the rollout was handed over", reason)
            return
        await super().set_stable(
            argv, reason=reason, ready_timeout_s=ready_timeout_s, restore=restore
        )


@dataclass(frozen=True, slots=True)
class Resumed:
    """One rollout a stopped pod handed over, and how it ended here."""

    trial_id: str
    was: Phase
    now: Phase
    reason: str


def _same(a: Sequence[str], b: Sequence[str]) -> bool:
    return mask_argv(a) == mask_argv(b)  # the journal keeps argv masked


async def resume_handed_over(
    journal: RolloutJournal,
    store: TrialStore,
    runtime: TunerRuntime,
    observer: Observer,
    settings: RolloutSettings,
    *,
    wall_clock: Callable[[], float],
) -> list[Resumed]:
    """Finish the rollouts an earlier pod handed over (see the module's docstring); the
    others stay open for `recover`. Hold the Deployment's Lease while calling this."""
    done = []
    for record in journal.open_records():
        live = runtime.stable_argv()
        if record.phase in HANDED_OVER and _same(live, record.candidate_argv):
            done.append(
                await _bake(record, journal, store, runtime, observer, settings, wall_clock)
            )
        elif record.phase is Phase.REVERTING and _same(live, record.stable_argv):
            reason = record.reason or "reverted"
            journal.save(record.at(Phase.REVERTED, at_wall_s=wall_clock(), reason=reason))
            done.append(Resumed(record.trial_id, record.phase, Phase.REVERTED, reason))
    return done


async def _bake(
    record: RolloutRecord,
    journal: RolloutJournal,
    store: TrialStore,
    runtime: TunerRuntime,
    observer: Observer,
    settings: RolloutSettings,
    wall_clock: Callable[[], float],
) -> Resumed:
    was = record.phase
    if not settings.bake:
        reason = "promoted; the rollout finished in a new pod"
        journal.save(record.at(Phase.PROMOTED, at_wall_s=wall_clock(), reason=reason))
        return Resumed(record.trial_id, was, Phase.PROMOTED, reason)
    if record.phase is not Phase.BAKING:
        record = record.at(Phase.BAKING, at_wall_s=wall_clock())
        journal.save(record)
    (window,) = await observer.observe([runtime.stable_url()])
    baked = evaluate(window.measurement, settings.slo)
    record = dataclasses.replace(record, bake_goodput_tokens_per_s=baked.goodput_tokens_per_s)
    trial = store.get(record.trial_id)
    promised = trial.result if trial is not None else None
    degraded = bake_degradation(promised, baked, settings.bake_tolerance_ratio)
    if degraded is None:
        reason = "promoted; the bake window held (resumed in a new pod)"
        journal.save(record.at(Phase.PROMOTED, at_wall_s=wall_clock(), reason=reason))
        return Resumed(record.trial_id, was, Phase.PROMOTED, reason)
    reason = f"bake: {degraded} (resumed in a new pod)"
    record = record.at(Phase.REVERTING, at_wall_s=wall_clock(), reason=reason)
    journal.save(record)  # a revert that replaces this pod in turn is finished by the next
    await runtime.set_stable(
        record.stable_argv, reason=reason, restore=True, ready_timeout_s=settings.ready_timeout_s
    )
    journal.save(record.at(Phase.REVERTED, at_wall_s=wall_clock(), reason=reason))
    return Resumed(record.trial_id, was, Phase.REVERTED, reason)
