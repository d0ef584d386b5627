"""What the tuner needs from the agent, as Protocols: a runtime, an observer, two stores.

The tuner never imports the agent; the agent hands it objects that satisfy these.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvpilot.tuner.judge.evidence import Samples
from kvpilot.tuner.problem.objective import Measurement
from kvpilot.tuner.rollout.foreign import ForeignRequests
from kvpilot.tuner.rollout.record import RolloutRecord
from kvpilot.tuner.trials import TrialStore, Warmup

__all__ = [
    "CanaryAborted",
    "CandidateStartFailed",
    "IntervalSamples",
    "Observation",
    "Observer",
    "RolloutJournal",
    "TrialStore",
    "TunerRuntime",
]


class CandidateStartFailed(RuntimeError):
    """A server with the candidate's flags did not become ready; carries vLLM's log text."""

    def __init__(self, message: str, log_text: str) -> None:
        super().__init__(message)
        self.log_text = log_text


class CanaryAborted(RuntimeError):
    """The observer stopped a live-traffic analysis because the canary broke the SLO; it has
    already sent the canary's traffic back to the stable instance. The message says why."""


class RestartRefused(RuntimeError):
    """The safe-restart path would not restart the stable instance now (a cooldown, the
    restart budget, an open circuit, dry-run); nothing was changed."""


class TunerRuntime(Protocol):
    """Start and stop a canary, switch the stable instance's flags, and tell where they are."""

    def stable_argv(self) -> tuple[str, ...]:
        """The stable instance's live argv."""
        ...

    def stable_url(self) -> str: ...

    async def start_canary(self, argv: Sequence[str], *, ready_timeout_s: float) -> str:
        """Start the canary with `argv` (its port is the runtime's); returns its URL.

        Raises CandidateStartFailed with the server's log when it does not become ready.
        """
        ...

    async def stop_canary(self) -> None:
        """Stop the canary if one runs (also one an earlier, dead kvpilot left)."""
        ...

    async def set_stable(
        self, argv: Sequence[str], *, reason: str, ready_timeout_s: float, restore: bool = False
    ) -> None:
        """Restart the stable instance with `argv` through the safe-restart path.

        `restore` says the flags are the ones that served before this trial (a rollback or
        a recovery): a path with guards lets those through, since they end the risk.
        Raises CandidateStartFailed when the restarted server does not become ready, and
        RestartRefused when the path's guards refuse a new configuration.
        """
        ...

    def remediation_in_progress(self) -> bool:
        """Whether a remediation is planned or running (the tuner must not act then)."""
        ...


class PassThroughRuntime:
    """A `TunerRuntime` that passes every call to `inner`: the base of runtimes that guard
    one call (`set_stable`) and leave the rest as they are."""

    def __init__(self, inner: TunerRuntime) -> None:
        self._inner = inner

    def stable_argv(self) -> tuple[str, ...]:
        return self._inner.stable_argv()

    def stable_url(self) -> str:
        return self._inner.stable_url()

    async def start_canary(self, argv: Sequence[str], *, ready_timeout_s: float) -> str:
        return await self._inner.start_canary(argv, ready_timeout_s=ready_timeout_s)

    async def stop_canary(self) -> None:
        await self._inner.stop_canary()

    async def set_stable(
        self, argv: Sequence[str], *, reason: str, ready_timeout_s: float, restore: bool = False
    ) -> None:
        await self._inner.set_stable(
            argv, reason=reason, ready_timeout_s=ready_timeout_s, restore=restore
        )

    def remediation_in_progress(self) -> bool:
        return self._inner.remediation_in_progress()


@dataclass(frozen=True, slots=True)
class IntervalSamples:
    """One interval of a live analysis on one side: the judge's samples between the scrape
    ticks `start_tick` and `end_tick`. Both pods are scraped on the same ticks, so the two
    sides' intervals of the same ticks ran under the same conditions (the arrivals, the
    load) and are judged as a pair; a failed scrape makes one interval span two ticks, and it
    has no pair."""

    start_tick: int
    end_tick: int
    samples: Mapping[str, Samples]


@dataclass(frozen=True, slots=True)
class Observation:
    """One instance's window: the objective's measurement and the judge's samples per metric."""

    url: str
    measurement: Measurement
    samples: Mapping[str, Samples] = field(default_factory=dict)
    traffic: str | None = None  # live traffic: the share each side received, in words
    foreign: ForeignRequests | None = None  # None: not counted (live traffic, no counter)
    # Live traffic: the window's samples interval by interval, judged paired with the other
    # side's intervals of the same ticks; None: not an analysis of intervals (replay).
    intervals: tuple[IntervalSamples, ...] | None = None


class Observer(Protocol):
    """Drives the same workload at several instances at once and measures each."""

    async def warm(self, urls: Sequence[str]) -> Warmup | None:
        """A few requests each, so that the window does not see a cold server; returns what
        was done, for the trial's record (None: not said)."""
        ...

    async def observe(
        self, urls: Sequence[str], *, prompts: str | None = None
    ) -> tuple[Observation, ...]:
        """One window per URL, in the order given, all under the same workload.

        `prompts` names the window's prompts: two calls with the same name send the same
        ones (a sequential canary's window and its baseline's); None draws prompts of its
        own.

        May raise CanaryAborted (live traffic) when the canary broke the SLO mid-window.
        """
        ...


class RolloutJournal(Protocol):
    """Where each trial's rollout phase is persisted (see `kvpilot.tuner.rollout.canary`)."""

    def save(self, record: RolloutRecord) -> None:
        """Insert or replace the record of its trial."""
        ...

    def get(self, trial_id: str) -> RolloutRecord | None: ...

    def open_records(self) -> list[RolloutRecord]:
        """Records whose rollout has not reached a final phase, oldest first."""
        ...

    def records(self) -> list[RolloutRecord]:
        """Every record, oldest first."""
        ...
