"""A trial is a record with a state; failure is a state with its reason.

States: planned -> running -> complete | infeasible | failed | aborted (planned may also go
straight to infeasible, failed or aborted). `infeasible` is the candidate's fault (it did not
start, crashed, broke the SLO, preempted too much); `failed` is the tuner's or the runtime's
(an error unrelated to the candidate); `aborted` means interrupted (kvpilot died mid-trial:
the next start finds it unfinished and aborts it once its canary is stopped). A transition
is saved to the store before anything else happens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

from kvpilot.collectors.secrets import mask
from kvpilot.tuner.judge.judgement import Classification, Judgement, MetricVerdict, Verdict
from kvpilot.tuner.problem.constraints import Value
from kvpilot.tuner.problem.objective import TrialOutcome, TrialResult, WindowMetrics
from kvpilot.tuner.problem.startup_errors import StartupFailure, StartupFailureKind


class TrialState(StrEnum):
    PLANNED = "planned"
    RUNNING = "running"
    COMPLETE = "complete"
    INFEASIBLE = "infeasible"
    FAILED = "failed"
    ABORTED = "aborted"

    @property
    def terminal(self) -> bool:
        return self not in (TrialState.PLANNED, TrialState.RUNNING)


_ENDS = {TrialState.COMPLETE, TrialState.INFEASIBLE, TrialState.FAILED, TrialState.ABORTED}
_ALLOWED: dict[TrialState, set[TrialState]] = {
    TrialState.PLANNED: {TrialState.RUNNING} | (_ENDS - {TrialState.COMPLETE}),
    TrialState.RUNNING: _ENDS,
}


class TrialTransitionError(ValueError):
    """A transition the state machine does not allow."""


@dataclass(frozen=True, slots=True)
class Warmup:
    """What was sent before the window, so that it did not see a cold server."""

    requests: int | None = None  # replay: requests sent to each instance
    seconds: float | None = None  # live traffic: seconds of the canary's share, not judged

    def describe(self) -> str:
        parts = []
        if self.requests is not None:
            parts.append(f"{self.requests} requests each")
        if self.seconds is not None:
            parts.append(f"{self.seconds:.3g} s of live traffic")
        return ", ".join(parts) or "none"


@dataclass(frozen=True, slots=True)
class Trial:
    """One trial of one study (fingerprint); `number` counts trials within the study."""

    trial_id: str
    fingerprint: str
    number: int
    values: tuple[tuple[str, Value], ...]  # the candidate's knob values
    state: TrialState
    created_wall_s: float  # for display and storage only
    updated_wall_s: float
    reason: str | None = None
    result: TrialResult | None = None
    judgement: Judgement | None = None
    baseline: TrialResult | None = None  # the stable side of the same window; None: unknown
    warmup: Warmup | None = None  # None: not recorded (older trials) or no canary ran

    def to(
        self,
        state: TrialState,
        *,
        at_wall_s: float,
        reason: str | None = None,
        result: TrialResult | None = None,
        judgement: Judgement | None = None,
        baseline: TrialResult | None = None,
        warmup: Warmup | None = None,
    ) -> Trial:
        """The trial after a transition; raises TrialTransitionError if it is not allowed."""
        if state not in _ALLOWED.get(self.state, set()):
            raise TrialTransitionError(f"trial {self.trial_id}: {self.state} -> {state}")
        if state in (TrialState.INFEASIBLE, TrialState.FAILED, TrialState.ABORTED) and not reason:
            raise TrialTransitionError(f"trial {self.trial_id}: {state} needs a reason")
        return dataclasses.replace(
            self,
            state=state,
            updated_wall_s=at_wall_s,
            reason=reason,
            result=result if result is not None else self.result,
            judgement=judgement if judgement is not None else self.judgement,
            baseline=baseline if baseline is not None else self.baseline,
            warmup=warmup if warmup is not None else self.warmup,
        )

    def finish(self, result: TrialResult, *, at_wall_s: float) -> Trial:
        """Complete or infeasible, as the objective decided."""
        if result.feasible:
            return self.to(TrialState.COMPLETE, at_wall_s=at_wall_s, result=result)
        return self.to(
            TrialState.INFEASIBLE, at_wall_s=at_wall_s, reason=result.reason, result=result
        )


def new_trial(
    trial_id: str, fingerprint: str, number: int, values: Mapping[str, Value], at_wall_s: float
) -> Trial:
    """A planned trial."""
    return Trial(
        trial_id,
        fingerprint,
        number,
        tuple(values.items()),
        TrialState.PLANNED,
        at_wall_s,
        at_wall_s,
    )


class TrialStore(Protocol):
    """Where trials live; the agent's SQLite store and the in-memory one implement it."""

    def add(self, trial: Trial) -> None:
        """Persist a new trial; raises ValueError if its id exists."""

    def save(self, trial: Trial) -> None:
        """Persist a transition of a known trial; raises KeyError if the id is unknown."""

    def get(self, trial_id: str) -> Trial | None: ...

    def trials(self, fingerprint: str | None = None) -> list[Trial]:
        """Trials oldest first (creation, then number); one study's if fingerprint is given."""

    def unfinished(self) -> list[Trial]:
        """Trials still planned or running: left behind by a process that died."""


def abort_unfinished(store: TrialStore, *, at_wall_s: float, reason: str) -> list[Trial]:
    """Mark every planned or running trial aborted (after the caller stopped its canary)."""
    aborted = []
    for trial in store.unfinished():
        done = trial.to(TrialState.ABORTED, at_wall_s=at_wall_s, reason=reason)
        store.save(done)
        aborted.append(done)
    return aborted


def history(store: TrialStore, fingerprint: str) -> list[tuple[dict[str, Value], TrialResult]]:
    """A study's measured trials as (knob values, result), for a warm start."""
    return [
        (dict(t.values), t.result)
        for t in store.trials(fingerprint)
        if t.result is not None and t.state in (TrialState.COMPLETE, TrialState.INFEASIBLE)
    ]


def next_number(store: TrialStore, fingerprint: str) -> int:
    """The number the study's next trial gets."""
    return max((t.number for t in store.trials(fingerprint)), default=0) + 1


# --- plain-data form, for stores that keep JSON ---------------------------------------


def trial_to_dict(trial: Trial) -> dict[str, Any]:
    """A JSON-ready dict of the trial (enums as their values), its text masked for storage
    (`collectors.secrets.mask`: a reason or a start-up log line may quote a secret)."""
    data = dataclasses.asdict(trial)
    data["values"] = [list(pair) for pair in trial.values]
    for later in ("baseline", "warmup"):  # added later: absent when unknown, as in old rows
        if data[later] is None:
            del data[later]
    masked: dict[str, Any] = mask(data)
    return masked


def trial_from_dict(data: Mapping[str, Any]) -> Trial:
    """The inverse of trial_to_dict."""
    return Trial(
        trial_id=data["trial_id"],
        fingerprint=data["fingerprint"],
        number=int(data["number"]),
        values=tuple((str(k), v) for k, v in data["values"]),
        state=TrialState(data["state"]),
        created_wall_s=float(data["created_wall_s"]),
        updated_wall_s=float(data["updated_wall_s"]),
        reason=data.get("reason"),
        result=_result_from_dict(data["result"]) if data.get("result") else None,
        judgement=_judgement_from_dict(data["judgement"]) if data.get("judgement") else None,
        # Both absent from trials stored before they were recorded: read as unknown.
        baseline=_result_from_dict(data["baseline"]) if data.get("baseline") else None,
        warmup=Warmup(**data["warmup"]) if data.get("warmup") else None,
    )


def _result_from_dict(data: Mapping[str, Any]) -> TrialResult:
    failure = data.get("startup_failure")
    return TrialResult(
        outcome=TrialOutcome(data["outcome"]),
        goodput_tokens_per_s=data.get("goodput_tokens_per_s"),
        memory_bytes=data.get("memory_bytes"),
        reason=data.get("reason"),
        metrics=WindowMetrics(**data["metrics"]) if data.get("metrics") else None,
        startup_failure=(
            StartupFailure(
                StartupFailureKind(failure["kind"]), failure["message"], failure["log_line"]
            )
            if failure
            else None
        ),
    )


def _judgement_from_dict(data: Mapping[str, Any]) -> Judgement:
    metrics = tuple(
        MetricVerdict(**{**m, "verdict": Verdict(m["verdict"])}) for m in data["metrics"]
    )
    return Judgement(
        Classification(data["classification"]), float(data["score_ratio"]), metrics, data["reason"]
    )
