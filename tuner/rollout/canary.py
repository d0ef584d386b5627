"""A canary rollout per trial: a persisted state machine from plan to promote or roll back.

Phases (`Phase`), each saved to the journal before the step it names begins:

    parallel:   planned -> starting -> warming -> observing -> judging
                -> rolling_back -> rolled_back | held (the canary left for review)
                -> promoting -> baking -> promoted | reverting -> reverted
    sequential: planned -> observing_baseline -> starting -> warming -> observing
                -> returning -> observing_baseline_after -> judging -> (as parallel)
                | (clearly worse) judging -> rolling_back -> rolled_back

`parallel` runs the candidate beside the stable instance, both under the same workload.
`sequential` measures the one instance, switches it to the candidate, measures again at the
same load, switches back and measures once more (A-B-A: see `_sequential`). Windows are
observed up to each of the judge's sequential looks (`judge.sequential`) and the rollout
stops at the first that decides. A candidate that does not start is infeasible with vLLM's
reason and the stable instance keeps (or gets back) its flags. Only a judge's pass whose
objective also beats the baseline promotes; a canary still inconclusive at the last look is
rolled back, or held for review (`hold_inconclusive`, parallel). The bake after a promotion
observes `bake_windows` windows and reverts to the old flags when the judge shows them worse
than the old ones' windows, or infeasible (`tuner.rollout.decide`). `recover` cleans up
after a kvpilot that died mid-trial; a hold is final to it (its canary is meant to outlive
the run), and only a person's `release` (promote or roll back) ends it. On live traffic the
observer may abort the analysis (`CanaryAborted`: the canary broke the SLO, its share
already back on the stable instance): the trial is infeasible with the reason and the canary
is removed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvpilot.collectors.secrets import mask_argv
from kvpilot.tuner.judge.judgement import Classification, Judgement
from kvpilot.tuner.judge.sequential import Look, LookDecision, judge_look
from kvpilot.tuner.judge.windows import Window, judge_windows
from kvpilot.tuner.problem.objective import TrialOutcome, TrialResult, evaluate
from kvpilot.tuner.rollout.bracket import bracketing, drift_widened
from kvpilot.tuner.rollout.decide import WindowGoodputs, pooled
from kvpilot.tuner.rollout.decide import bake_degradation as bake_degradation  # re-exported
from kvpilot.tuner.rollout.decide import promotion_decision as promotion_decision
from kvpilot.tuner.rollout.foreign import ForeignTraffic, foreign_reason
from kvpilot.tuner.rollout.intervals import interval_look, judges_intervals
from kvpilot.tuner.rollout.ports import (
    CanaryAborted,
    CandidateStartFailed,
    Observation,
    Observer,
    RestartRefused,
    RolloutJournal,
    TunerRuntime,
)
from kvpilot.tuner.rollout.record import STABLE_TOUCHED
from kvpilot.tuner.rollout.record import NotHeld as NotHeld
from kvpilot.tuner.rollout.record import Phase as Phase
from kvpilot.tuner.rollout.record import Release as Release
from kvpilot.tuner.rollout.record import RolloutRecord as RolloutRecord
from kvpilot.tuner.rollout.record import Strategy as Strategy
from kvpilot.tuner.rollout.settings import RolloutSettings as RolloutSettings
from kvpilot.tuner.trials import Trial, TrialState, TrialStore, Warmup, abort_unfinished


@dataclass(frozen=True, slots=True)
class RolloutOutcome:
    """The trial as stored, the rollout's last record and the baseline's result."""

    trial: Trial
    record: RolloutRecord
    baseline: TrialResult | None = None
    refused: str | None = None  # the safe-restart path's refusal, when it ended the trial

    @property
    def promoted(self) -> bool:
        return self.record.phase is Phase.PROMOTED

    @property
    def held(self) -> bool:
        return self.record.phase is Phase.HELD


PhaseListener = Callable[[Trial, Phase], None]


class TrialRollout:
    """Runs one trial's rollout against a runtime; every transition is persisted first."""

    def __init__(
        self,
        runtime: TunerRuntime,
        observer: Observer,
        store: TrialStore,
        journal: RolloutJournal,
        settings: RolloutSettings,
        *,
        wall_clock: Callable[[], float],
        on_phase: PhaseListener | None = None,
        deployed: TrialResult | None = None,
    ) -> None:
        """`deployed`: the configuration the operator deployed, as measured (the loss cap is
        held against it; None: this trial's baseline is it)."""
        self._deployed = deployed
        self._runtime = runtime
        self._observer = observer
        self._store = store
        self._journal = journal
        self._settings = settings
        self._wall = wall_clock
        self._on_phase = on_phase or (lambda _trial, _phase: None)

    async def run(
        self, trial: Trial, candidate_argv: Sequence[str], strategy: Strategy
    ) -> RolloutOutcome:
        """Plan, start, observe, judge, promote or roll back, bake; returns how it ended."""
        record = RolloutRecord(
            trial.trial_id,
            strategy,
            Phase.PLANNED,
            tuple(self._runtime.stable_argv()),
            tuple(candidate_argv),
            self._wall(),
        )
        self._journal.save(record)
        trial = self._save_trial(trial.to(TrialState.RUNNING, at_wall_s=self._wall()))
        self._on_phase(trial, Phase.PLANNED)
        state = _Run(trial, record)
        try:
            if strategy is Strategy.PARALLEL:
                await self._parallel(state)
            else:
                await self._sequential(state)
        except BaseException as exc:
            await self._fail(state, exc)
            raise
        return RolloutOutcome(state.trial, state.record, state.baseline, state.refused)

    # --- the two strategies -------------------------------------------------------------

    async def _parallel(self, s: _Run) -> None:
        rt, stable_url = self._runtime, self._runtime.stable_url()
        self._move(s, Phase.STARTING)
        try:
            canary_url = await rt.start_canary(
                s.record.candidate_argv, ready_timeout_s=self._settings.ready_timeout_s
            )
        except CandidateStartFailed as exc:
            await rt.stop_canary()
            self._infeasible_start(s, exc)
            return
        self._move(s, Phase.WARMING)
        s.warmup = await self._observer.warm([stable_url, canary_url])
        self._move(s, Phase.OBSERVING)
        baselines: list[Observation] = []
        canaries: list[Observation] = []
        try:
            for at in self._settings.look_plan.looks:
                while len(canaries) < at:
                    baseline, canary = await self._observe(s, [stable_url, canary_url])
                    baselines.append(baseline)
                    canaries.append(canary)
                look = self._look(baselines, canaries, paired=True)
                if look.decision is not LookDecision.CONTINUE:
                    break
        except CanaryAborted as exc:  # live traffic: the observer already took it back
            await self._abort(s, str(exc))
            return
        promote = self._judge(s, baselines, canaries, look.judgement, paired=True)
        if not promote and self._hold(look):
            reason = f"held for review, the canary left running: {s.record.reason}"
            self._move(s, Phase.HELD, reason=reason)
            return
        if not promote:
            self._move(s, Phase.ROLLING_BACK)
            await rt.stop_canary()
            self._move(s, Phase.ROLLED_BACK)
            return
        self._move(s, Phase.PROMOTING)
        await self._promote_canary(s, f"promoted by trial {s.trial.number}")

    async def _promote_canary(self, s: _Run, why: str, *, released: str | None = None) -> None:
        """The canary's flags into the stable instance through the runtime's guards, then the
        bake; `released`: the person's release, kept in every reason that follows."""
        await self._runtime.stop_canary()
        try:
            await self._runtime.set_stable(
                s.record.candidate_argv, reason=why, ready_timeout_s=self._settings.ready_timeout_s
            )
        except CandidateStartFailed as exc:
            await self._revert(s, _joined(released, f"the promoted flags did not start: {exc}"))
            return
        except RestartRefused as exc:  # measured and better, yet not now: the stable stays
            s.refused = str(exc)
            self._move(s, Phase.ROLLED_BACK, reason=_joined(released, f"not promoted: {exc}"))
            return
        await self._bake(s)

    async def release(
        self, trial: Trial, record: RolloutRecord, action: Release, *, by: str, reason: str
    ) -> RolloutOutcome:
        """A held canary released by a person. `promote` goes the way a pass goes (the canary
        stopped, its flags into the stable instance through the runtime's guards, the bake;
        the old stable's windows went with the run, so the bake holds the promoted flags to
        the SLO alone); `rollback` stops the canary. Raises NotHeld unless `record` is held."""
        if record.phase is not Phase.HELD:
            raise NotHeld(record)
        s = _Run(trial, record)
        why = f"{action.words} by {by}: {reason}"
        try:
            if action is Release.PROMOTE:
                self._move(s, Phase.PROMOTING, reason=why)
                await self._promote_canary(s, why, released=why)
            else:
                self._move(s, Phase.ROLLING_BACK, reason=why)
                await self._runtime.stop_canary()
                self._move(s, Phase.ROLLED_BACK, reason=why)
        except BaseException as exc:
            await self._fail(s, exc)
            raise
        return RolloutOutcome(s.trial, s.record, None, s.refused)

    async def _sequential(self, s: _Run) -> None:
        """A-B-A: the one instance observed with the stable flags (A), restarted with the
        candidate's (B), observed, restarted back and observed again (A), window k of each
        phase sending the same prompts. Candidate window k is judged paired against the
        stable's windows k before and after it made one (`bracket.bracketing`): it sits
        midway between them in time, so a drift linear in time (the hour's traffic, the
        device's temperature) cancels, where one side after the other would read it as the
        candidate's effect. B stops at the first look that shows it no worse than the
        windows before it (the pass the windows after it must confirm), or at the last look;
        A after it observes up to the looks B reached and stops at the first that decides.

        The cost: a pass takes three restarts (to B, back to A, and the promotion's to B
        again) where one side after the other took one; the restart back is needed anyway
        when the candidate does not pass, and a clearly bad candidate stops early with it
        alone: shown worse than the windows before it beyond the margins widened by
        `sequential_drift_ratio`, it is judged against those and rolled back, with no
        second A. The promotion's restart goes through the runtime's guards, and a refusal
        leaves the stable flags serving with the candidate measured (`_promote_canary`)."""
        rt, url = self._runtime, self._runtime.stable_url()
        self._move(s, Phase.OBSERVING_BASELINE)
        before = [
            await self._observe_one(s, url, prompts=_prompts(s, k))
            for k in range(self._settings.windows)
        ]
        self._move(s, Phase.STARTING)
        try:
            await rt.set_stable(
                s.record.candidate_argv,
                reason=f"sequential canary of trial {s.trial.number}",
                ready_timeout_s=self._settings.ready_timeout_s,
            )
        except CandidateStartFailed as exc:
            await self._restore_stable(s, "the candidate did not start")
            self._infeasible_start(s, exc)
            return
        except RestartRefused as exc:  # the one instance may not switch now: no trial
            s.refused = str(exc)
            reason = f"not switched to the candidate: {exc}"
            s.trial = self._save_trial(
                s.trial.to(TrialState.ABORTED, at_wall_s=self._wall(), reason=reason)
            )
            self._move(s, Phase.ABORTED, reason=reason)
            return
        self._move(s, Phase.WARMING)
        s.warmup = await self._observer.warm([url])
        self._move(s, Phase.OBSERVING)
        canaries, clearly_worse = await self._observe_candidate(s, url, before)
        if clearly_worse is not None:
            self._judge(s, before, canaries, clearly_worse.judgement, paired=False)
            self._move(s, Phase.ROLLING_BACK)
            await self._restore_stable(s, f"trial {s.trial.number} rolled back")
            self._move(s, Phase.ROLLED_BACK)
            return
        self._move(s, Phase.RETURNING)
        await self._restore_stable(s, f"trial {s.trial.number}: the stable flags observed again")
        self._move(s, Phase.OBSERVING_BASELINE_AFTER)
        await self._observer.warm([url])  # restarted as the candidate was: warmed alike
        look, after = await self._observe_after(s, url, before, canaries)
        bracketing_windows = _bracketing(before, after, self._settings)
        judged = canaries[: len(after)]
        # A hold needs a canary beside the stable: here the candidate is the only instance.
        promote = self._judge(s, bracketing_windows, judged, look.judgement, paired=True)
        s.baselines = tuple(after)  # the bake's reference: the stable's latest windows
        if not promote:
            self._move(s, Phase.ROLLING_BACK)  # the stable flags serve again already
            await self._restore_stable(s, f"trial {s.trial.number} rolled back")
            self._move(s, Phase.ROLLED_BACK)
            return
        self._move(s, Phase.PROMOTING)
        await self._promote_canary(s, f"promoted by trial {s.trial.number}")

    async def _observe_candidate(
        self, s: _Run, url: str, before: Sequence[Observation]
    ) -> tuple[list[Observation], Look | None]:
        """B's windows up to the first look that passes against the windows before it, or
        the last; with the look that shows the candidate clearly worse, if one did."""
        settings = self._settings
        widened = drift_widened(settings.judge, settings.sequential_drift_ratio)
        limits = settings.slo.judge_limits()
        canaries: list[Observation] = []
        for at in settings.look_plan.looks:
            while len(canaries) < at:
                canaries.append(await self._observe_one(s, url, prompts=_prompts(s, len(canaries))))
            windows = [Window(c.samples, b.samples) for c, b in zip(canaries, before, strict=False)]
            shown = judge_look(windows, settings.look_plan, widened, limits, paired=False)
            if shown.decision is LookDecision.FAIL:
                return canaries, self._look(before, canaries, paired=False)
            if self._look(before, canaries, paired=False).decision is LookDecision.PASS:
                break
        return canaries, None

    async def _observe_after(
        self,
        s: _Run,
        url: str,
        before: Sequence[Observation],
        canaries: Sequence[Observation],
    ) -> tuple[Look, list[Observation]]:
        """The stable's windows after the candidate, up to the first of the looks B reached
        that decides; that look and those windows."""
        looks = [at for at in self._settings.look_plan.looks if at <= len(canaries)]
        after: list[Observation] = []
        for at in looks:
            while len(after) < at:
                after.append(await self._observe_one(s, url, prompts=_prompts(s, len(after))))
            look = self._look(
                _bracketing(before, after, self._settings), canaries[:at], paired=True
            )
            if look.decision is not LookDecision.CONTINUE:
                break
        return look, after

    # --- steps shared by both ---------------------------------------------------------

    def _look(
        self, baselines: Sequence[Observation], canaries: Sequence[Observation], *, paired: bool
    ) -> Look:
        """The judge at the look the canary's windows reach (against as many baseline ones);
        a live analysis by its intervals, the two sides' of the same ticks paired."""
        if judges_intervals(canaries):
            return interval_look(baselines, canaries, self._settings)
        windows = [Window(c.samples, b.samples) for c, b in zip(canaries, baselines, strict=False)]
        limits = self._settings.slo.judge_limits()
        return judge_look(
            windows, self._settings.look_plan, self._settings.judge, limits, paired=paired
        )

    def _hold(self, look: Look) -> bool:
        return self._settings.hold_inconclusive and look.decision is LookDecision.INCONCLUSIVE

    async def _observe_one(self, s: _Run, url: str, *, prompts: str | None = None) -> Observation:
        (observed,) = await self._observe(s, [url], prompts=prompts)
        return observed

    async def _observe(
        self, s: _Run, urls: Sequence[str], *, prompts: str | None = None
    ) -> tuple[Observation, ...]:
        """One window of every side, observed again while a side carried more foreign
        requests than `max_foreign_share` (users' traffic on the serving instance: the other
        side does not carry it). Raises ForeignTraffic once more windows were left out than a
        side may observe."""
        while True:
            got = await self._observer.observe(urls, prompts=prompts)
            why = foreign_reason(
                [(o.url, o.foreign) for o in got], self._settings.max_foreign_share
            )
            if why is None:
                return got
            s.left_out.append(why)
            if len(s.left_out) > self._settings.windows:
                raise ForeignTraffic(f"{len(s.left_out)} windows left out, the last as {why}")

    def _judge(
        self,
        s: _Run,
        baselines: Sequence[Observation],
        canaries: Sequence[Observation],
        judgement: Judgement,
        *,
        paired: bool,
    ) -> bool:
        """Objective over the windows and the judge's last look; the trial is finished with
        both. Returns whether to promote."""
        self._move(s, Phase.JUDGING)
        slo, alpha = self._settings.slo, self._settings.judge.alpha
        baselines = baselines[: len(canaries)]
        s.baselines = tuple(baselines)
        base_results = [evaluate(b.measurement, slo) for b in baselines]
        results = [evaluate(c.measurement, slo) for c in canaries]
        base_result, result = pooled(base_results, slo, alpha), pooled(results, slo, alpha)
        canary = canaries[-1]
        s.baseline = base_result
        state = TrialState.COMPLETE if result.feasible else TrialState.INFEASIBLE
        traffic = canary.traffic  # live traffic: the shares, stated with the verdict
        s.trial = self._save_trial(
            s.trial.to(
                state,
                at_wall_s=self._wall(),
                reason="; ".join(r for r in (result.reason, traffic) if r) or None,
                result=result,
                judgement=judgement,
                baseline=base_result,
                warmup=s.warmup,
            )
        )
        s.record = dataclasses.replace(
            s.record, baseline_goodput_tokens_per_s=base_result.goodput_tokens_per_s
        )
        gains = WindowGoodputs(
            tuple(r.goodput_tokens_per_s for r in results),
            tuple(r.goodput_tokens_per_s for r in base_results),
            paired,
        )
        deployed = self._deployed or base_result
        promote, why = promotion_decision(
            result, base_result, judgement, self._settings, gains, deployed
        )
        left_out = (
            f"{len(s.left_out)} windows left out of the judgement, the last as {s.left_out[-1]}"
            if s.left_out
            else None
        )
        s.record = dataclasses.replace(
            s.record, reason="; ".join(r for r in (why, traffic, left_out) if r)
        )
        return promote

    async def _bake(self, s: _Run) -> None:
        if not self._settings.bake:
            self._move(s, Phase.PROMOTED)
            return
        self._move(s, Phase.BAKING)
        url = self._runtime.stable_url()
        bakes = [await self._observe_one(s, url) for _ in range(self._settings.bake_windows)]
        slo = self._settings.slo
        baked = pooled(
            [evaluate(w.measurement, slo) for w in bakes], slo, self._settings.judge.alpha
        )
        s.record = dataclasses.replace(
            s.record, bake_goodput_tokens_per_s=baked.goodput_tokens_per_s
        )
        degraded = self._bake_degradation(s, bakes, baked)
        if degraded is not None:
            await self._revert(s, f"bake: {degraded}")
            return
        # The promotion's why stays with the record: the report shows what won and how.
        why = f" ({s.record.reason})" if s.record.reason else ""
        self._move(s, Phase.PROMOTED, reason=f"promoted{why}; the bake window held")

    def _bake_degradation(
        self, s: _Run, bakes: Sequence[Observation], baked: TrialResult
    ) -> str | None:
        """Why the bake's windows show the promoted flags worse than the old stable's windows
        (the same tests as the canary's, one side after the other), or None."""
        if not baked.feasible:
            return f"the promoted flags are infeasible under load: {baked.reason}"
        old = s.baselines[-len(bakes) :]
        if not old:
            return None
        windows = [Window(b.samples, o.samples) for b, o in zip(bakes, old, strict=False)]
        settings = self._settings
        judgement = judge_windows(
            windows, settings.judge, settings.slo.judge_limits(), paired=False
        )
        if judgement.classification in (Classification.FAIL, Classification.MARGINAL):
            return f"the promoted flags are worse than the old ones: {judgement.reason}"
        return None

    async def _abort(self, s: _Run, why: str) -> None:
        """The canary broke the SLO mid-analysis: infeasible (the candidate's fault), removed."""
        reason = f"aborted during the analysis: {why}"
        result = TrialResult(TrialOutcome.SLO_BROKEN, None, None, reason)
        s.trial = self._save_trial(
            s.trial.to(TrialState.INFEASIBLE, at_wall_s=self._wall(), reason=reason, result=result)
        )
        self._move(s, Phase.ROLLING_BACK, reason=reason)
        await self._runtime.stop_canary()
        self._move(s, Phase.ROLLED_BACK, reason=reason)

    async def _revert(self, s: _Run, reason: str) -> None:
        self._move(s, Phase.REVERTING, reason=reason)
        await self._restore_stable(s, reason)
        self._move(s, Phase.REVERTED, reason=reason)

    async def _restore_stable(self, s: _Run, reason: str) -> None:
        if tuple(self._runtime.stable_argv()) != s.record.stable_argv:
            await self._runtime.set_stable(
                s.record.stable_argv,
                reason=reason,
                restore=True,
                ready_timeout_s=self._settings.ready_timeout_s,
            )

    def _infeasible_start(self, s: _Run, exc: CandidateStartFailed) -> None:
        result = TrialResult.failed_to_start(exc.log_text)
        s.trial = self._save_trial(
            s.trial.to(
                TrialState.INFEASIBLE, at_wall_s=self._wall(), reason=result.reason, result=result
            )
        )
        self._move(s, Phase.INFEASIBLE, reason=result.reason)

    async def _fail(self, s: _Run, exc: BaseException) -> None:
        """An error that is not the candidate's: clean up, then record it."""
        final = Phase.FAILED if isinstance(exc, Exception) else Phase.ABORTED
        reason = f"{final.value} in phase {s.record.phase.value}: {type(exc).__name__}: {exc}"
        if s.record.phase.final:
            return
        try:
            await self._runtime.stop_canary()
            if s.record.phase in STABLE_TOUCHED[s.record.strategy]:
                await self._restore_stable(s, reason)
        finally:
            if not s.trial.state.terminal:
                state = TrialState.FAILED if final is Phase.FAILED else TrialState.ABORTED
                s.trial = self._save_trial(s.trial.to(state, at_wall_s=self._wall(), reason=reason))
            self._move(s, final, reason=reason)

    def _move(self, s: _Run, phase: Phase, *, reason: str | None = None) -> None:
        s.record = s.record.at(phase, at_wall_s=self._wall(), reason=reason)
        self._journal.save(s.record)
        self._on_phase(s.trial, phase)

    def _save_trial(self, trial: Trial) -> Trial:
        self._store.save(trial)
        return trial


def _bracketing(
    before: Sequence[Observation], after: Sequence[Observation], settings: RolloutSettings
) -> list[Observation]:
    """The stable's windows k before and after the candidate's, made one, for each k after
    it so far."""
    pairs = zip(before, after, strict=False)
    return [bracketing(b, a, settings.judge.metrics) for b, a in pairs]


def _prompts(s: _Run, window: int) -> str:
    """Window k's prompts: the same in each phase of a sequential canary."""
    return f"{s.trial.trial_id} {window}"


def _joined(*parts: str | None) -> str:
    return "; ".join(p for p in parts if p)


def held_records(journal: RolloutJournal) -> list[RolloutRecord]:
    """The rollouts held for a person's review, oldest first (their canaries left running)."""
    return [r for r in journal.records() if r.phase is Phase.HELD]


@dataclass(slots=True)
class _Run:
    """The mutable progress of one rollout (the persisted copies are immutable)."""

    trial: Trial
    record: RolloutRecord
    baseline: TrialResult | None = None
    refused: str | None = None
    warmup: Warmup | None = None
    baselines: tuple[Observation, ...] = ()  # the old stable's windows, for the bake
    left_out: list[str] = dataclasses.field(default_factory=list)  # why, per window left out


@dataclass(frozen=True, slots=True)
class Recovered:
    """One rollout a dead kvpilot left open, and what recovery did about it."""

    trial_id: str
    phase: Phase
    stable_restored: bool


async def recover(
    journal: RolloutJournal,
    store: TrialStore,
    runtime: TunerRuntime,
    *,
    at_wall_s: float,
    ready_timeout_s: float = 240.0,
) -> list[Recovered]:
    """At start-up: stop any canary, restore the stable flags if a rollout touched them,
    and abort the unfinished trials. Idempotent."""
    recovered = []
    open_records = journal.open_records()
    if open_records:
        await runtime.stop_canary()
    for record in open_records:
        # The journal keeps argv masked: the flags are compared as stored.
        touched = record.phase in STABLE_TOUCHED[record.strategy]
        restore = touched and mask_argv(runtime.stable_argv()) != mask_argv(record.stable_argv)
        if restore:
            await runtime.set_stable(
                record.stable_argv,
                reason=f"recovery: trial {record.trial_id} was interrupted in {record.phase}",
                ready_timeout_s=ready_timeout_s,
                restore=True,
            )
        reason = f"kvpilot stopped mid-trial (phase {record.phase.value}); canary stopped, " + (
            "stable flags restored" if restore else "stable flags kept"
        )
        journal.save(record.at(Phase.ABORTED, at_wall_s=at_wall_s, reason=reason))
        recovered.append(Recovered(record.trial_id, record.phase, restore))
    abort_unfinished(store, at_wall_s=at_wall_s, reason="kvpilot stopped mid-trial")
    return recovered
