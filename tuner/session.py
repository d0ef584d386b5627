"""A tuning run of N trials: warm start, ask, check constraints, roll out, tell.

The study is the fingerprint's: the suggester first hears every measured trial of it (from
earlier runs too), trial numbers continue, and the best so far covers the whole history.
The suggester is told each trial's goodput relative to its concurrent baseline's
(`told_result`), at warm start and live alike; the stored trials keep what was measured.
A run never starts, and stops between trials, while a remediation is in progress.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvpilot.collectors.vllm_argv import without_flags
from kvpilot.tuner.problem.ascent import highest_started, stepped
from kvpilot.tuner.problem.constraints import Value
from kvpilot.tuner.problem.objective import Slo, TrialResult, best_index, relative_result
from kvpilot.tuner.problem.space import Candidate, KnobKind, SearchSpace
from kvpilot.tuner.rollout.canary import (
    NotHeld,
    Phase,
    Release,
    RolloutOutcome,
    RolloutSettings,
    Strategy,
    TrialRollout,
    held_records,
)
from kvpilot.tuner.rollout.ports import Observer, RolloutJournal, TunerRuntime
from kvpilot.tuner.suggest import Explaining, SearchExhausted, Suggester, warm_start
from kvpilot.tuner.trials import Trial, TrialState, TrialStore, history, new_trial, next_number


class TuningBlocked(RuntimeError):
    """The run may not act now (a remediation is in progress)."""


@dataclass(frozen=True, slots=True)
class Progress:
    """What a progress display shows: the trial, its flags, its phase, the best so far."""

    trial_number: int
    values: tuple[tuple[str, object], ...]
    phase: Phase
    best_goodput_tokens_per_s: float | None


@dataclass(frozen=True, slots=True)
class SessionSummary:
    """How a run went: its rollouts, how many past trials warmed it, why it stopped."""

    outcomes: tuple[RolloutOutcome, ...]
    warm_started_total: int
    stopped_reason: str
    best_goodput_tokens_per_s: float | None

    @property
    def promoted(self) -> tuple[RolloutOutcome, ...]:
        return tuple(o for o in self.outcomes if o.promoted)


def candidate_argv(
    base: Sequence[str], space: SearchSpace, candidate: Candidate
) -> tuple[str, ...]:
    """`base` with each knob's flag (in any spelling) replaced by the candidate's value."""
    valued = [k.flag for k in space.knobs if k.kind is not KnobKind.FLAG]
    bare = [k.flag for k in space.knobs if k.kind is KnobKind.FLAG]
    return (*without_flags(base, valued, bare), *space.argv(candidate))


def best_goodput(store: TrialStore, fingerprint: str, slo: Slo) -> float | None:
    """The best feasible goodput of the study so far, among the trials the judge passed: a
    trial it failed or could not decide is no best, however high its goodput read."""
    results: list[TrialResult] = [
        t.result
        for t in store.trials(fingerprint)
        if t.result is not None and t.judgement is not None and t.judgement.promote
    ]
    index = best_index(results, slo)
    return None if index is None else results[index].goodput_tokens_per_s


def deployed_result(store: TrialStore, fingerprint: str) -> TrialResult | None:
    """The configuration the operator deployed, as the study's first measured trial saw its
    stable side (before any promotion); None before the first trial."""
    return next((t.baseline for t in store.trials(fingerprint) if t.baseline is not None), None)


# The states of a trial whose result the objective gave (`trials.history`'s).
_MEASURED = (TrialState.COMPLETE, TrialState.INFEASIBLE)


def baseline_goodput(trial: Trial, journal: RolloutJournal | None) -> float | None:
    """The stable server's goodput in the trial's own windows: the trial's stored baseline,
    else its rollout record's (a trial stored before the baseline was kept on it)."""
    if trial.baseline is not None:
        return trial.baseline.goodput_tokens_per_s
    record = journal.get(trial.trial_id) if journal is not None else None
    return record.baseline_goodput_tokens_per_s if record is not None else None


def told_result(
    trial: Trial, journal: RolloutJournal | None, *, relative: bool
) -> TrialResult | None:
    """What the suggester is told of a trial, at warm start and live alike: a measured one's
    result relative to its concurrent baseline (`relative_result`), or as measured where the
    study is told absolute goodput (`told_history`); None: not told."""
    if trial.result is None or trial.state not in _MEASURED:
        return None
    if not relative:
        return trial.result
    return relative_result(trial.result, baseline_goodput(trial, journal))


def told_history(
    store: TrialStore, fingerprint: str, journal: RolloutJournal | None = None
) -> tuple[bool, list[tuple[dict[str, Value], TrialResult]]]:
    """Whether the study is told relative goodput, and its measured trials as told. Absolute
    only where it has measured trials and none has a baseline figure: one model fitted to
    two scales is wrong, so such a study keeps its scale until a trial with one is measured,
    and from then on a feasible trial without one is left out."""
    measured = [
        t for t in store.trials(fingerprint) if t.result is not None and t.state in _MEASURED
    ]
    relative = not measured or any(baseline_goodput(t, journal) is not None for t in measured)
    told: list[tuple[dict[str, Value], TrialResult]] = []
    for trial in measured:
        result = told_result(trial, journal, relative=relative)
        if result is not None:
            told.append((dict(trial.values), result))
    return relative, told


class TuningSession:
    """Runs trials of one study against one runtime."""

    def __init__(
        self,
        *,
        space: SearchSpace,
        suggester: Suggester,
        store: TrialStore,
        journal: RolloutJournal,
        runtime: TunerRuntime,
        observer: Observer,
        fingerprint: str,
        settings: RolloutSettings,
        strategy: Strategy,
        wall_clock: Callable[[], float],
        on_progress: Callable[[Progress], None] | None = None,
        new_id: Callable[[], str] = lambda: uuid.uuid4().hex,
    ) -> None:
        self._space = space
        self._suggester = suggester
        self._store = store
        self._journal = journal
        self._runtime = runtime
        self._observer = observer
        self._fingerprint = fingerprint
        self._settings = settings
        self._strategy = strategy
        self._wall = wall_clock
        self._on_progress = on_progress or (lambda _p: None)
        self._new_id = new_id

    async def run(self, trials: int) -> SessionSummary:
        """Up to `trials` trials; raises TuningBlocked if a remediation runs at the start."""
        if self._runtime.remediation_in_progress():
            raise TuningBlocked("a remediation is in progress; tuning waits until it ends")
        held = held_records(self._journal)
        if held:  # one canary slot, and the held canary keeps it until a person decides
            raise TuningBlocked(
                f"trial {held[0].trial_id} is held for review (its canary left running): "
                "promote it or roll it back first (kvpilot tuning release)"
            )
        relative, past_told = told_history(self._store, self._fingerprint, self._journal)
        told = warm_start(self._suggester, self._space, past_told)
        outcomes: list[RolloutOutcome] = []
        stopped = f"ran {trials} trials"
        for _ in range(trials):
            if self._runtime.remediation_in_progress():
                stopped = "stopped: a remediation started"
                break
            try:
                candidate = self._suggester.ask()
            except SearchExhausted as exc:
                stopped = f"stopped: {exc}"
                break
            violation = self._space.violation(candidate)
            if violation is not None:  # suggesters should not propose these; never spend one
                stopped = f"stopped: the suggester proposed a candidate that breaks {violation}"
                break
            past = history(self._store, self._fingerprint)
            highest = highest_started(self._runtime.stable_argv(), past)
            candidate, _ = stepped(self._space, candidate, highest)
            outcome = await self._trial(candidate)
            outcomes.append(outcome)
            result = told_result(outcome.trial, self._journal, relative=relative)
            if result is not None:
                self._suggester.tell(candidate, result)
            if outcome.refused is not None:  # the next trial would meet the same guard
                stopped = f"stopped: the safe-restart path refused a restart: {outcome.refused}"
                break
            if outcome.held:  # its canary waits for a person: no other trial beside it
                stopped = f"stopped: trial {outcome.trial.number} is held for review"
                break
        return SessionSummary(
            tuple(outcomes),
            told,
            stopped,
            best_goodput(self._store, self._fingerprint, self._settings.slo),
        )

    async def release(
        self, trial_id: str, action: Release, *, by: str, reason: str
    ) -> RolloutOutcome:
        """A held trial released by a person (`TrialRollout.release`): promoted the way a pass
        is, or rolled back. Raises NotHeld for a trial that is not held, LookupError for one
        kvpilot does not know (a hold of an earlier study is this runtime's all the same)."""
        record, trial = self._journal.get(trial_id), self._store.get(trial_id)
        if record is None or trial is None:
            raise LookupError(f"no trial {trial_id!r}")
        if record.phase is not Phase.HELD:
            raise NotHeld(record)
        return await self._rollout().release(trial, record, action, by=by, reason=reason)

    def _rollout(self) -> TrialRollout:
        return TrialRollout(
            self._runtime,
            self._observer,
            self._store,
            self._journal,
            self._settings,
            wall_clock=self._wall,
            on_phase=self._report,
            deployed=deployed_result(self._store, self._fingerprint),
        )

    async def _trial(self, candidate: Candidate) -> RolloutOutcome:
        trial = new_trial(
            self._new_id(),
            self._fingerprint,
            next_number(self._store, self._fingerprint),
            candidate.as_dict(),
            at_wall_s=self._wall(),
        )
        self._store.add(trial)
        argv = candidate_argv(self._runtime.stable_argv(), self._space, candidate)
        outcome = await self._rollout().run(trial, argv, self._strategy)
        self._report(outcome.trial, outcome.record.phase)
        return outcome

    def _report(self, trial: Trial, phase: Phase) -> None:
        best = best_goodput(self._store, self._fingerprint, self._settings.slo)
        self._on_progress(Progress(trial.number, trial.values, phase, best))


@dataclass(frozen=True, slots=True)
class PlannedTrial:
    """What a dry run would try, and why."""

    candidate: Candidate
    why: str


def dry_run(
    space: SearchSpace,
    suggester: Suggester,
    store: TrialStore,
    fingerprint: str,
    trials: int,
    *,
    initial_points: int,
    journal: RolloutJournal | None = None,
) -> tuple[int, list[PlannedTrial]]:
    """The candidates a run would try first (no results told between them), with reasons."""
    told = warm_start(suggester, space, told_history(store, fingerprint, journal)[1])
    planned: list[PlannedTrial] = []
    for i in range(trials):
        try:
            candidate = suggester.ask()
        except SearchExhausted:
            break
        if isinstance(suggester, Explaining):
            why = suggester.explain(candidate)
        elif told + i < initial_points:
            why = "initial point: stratified over the planner's safe region"
        else:
            why = (
                "model-guided: expected improvement x feasibility over "
                f"{told} past trials and the {i} before it in this run"
            )
        violation = space.violation(candidate)
        if violation is not None:
            why = f"would be refused: {violation}"
        planned.append(PlannedTrial(candidate, why))
    return told, planned
