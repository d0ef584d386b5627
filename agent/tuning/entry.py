"""One way into tuning, for `kvpilot tune`, the schedule and the pod alike: a `Tuner` (the
local one, `agent.tuning.local`, or the pod's, `agent.tuning.pod`) gives the study, the lease,
the recovery and the session of its runtime; `run_tuning` runs one session under the lease,
after the recovery. A run whose settings cannot pass even a canary equal to the stable is
refused before anything starts (`TuningRefused`, with the reason)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Protocol

from kvpilot.agent.config.tuning import TuningConfig
from kvpilot.agent.config.tuning_reach import traffic_reachability
from kvpilot.agent.tuning.handover import Resumed
from kvpilot.agent.tuning.study import Study, rollout_settings
from kvpilot.tuner.judge.judgement import DEFAULT_METRICS, LIVE_METRICS, JudgeConfig
from kvpilot.tuner.rollout.canary import Recovered
from kvpilot.tuner.rollout.reachable import Reachability
from kvpilot.tuner.session import Progress, SessionSummary, TuningBlocked, TuningSession

ShowProgress = Callable[[Progress], None]
# A session's runner: given the session built for a progress callback, and the trials to run.
RunSession = Callable[
    [Callable[[ShowProgress | None], TuningSession], int], Awaitable[SessionSummary]
]


@dataclass(frozen=True, slots=True)
class Recovery:
    """What the recovery a run begins with did."""

    resumed: tuple[Resumed, ...] = ()  # promotions another pod handed over, resumed
    recovered: tuple[Recovered, ...] = ()  # trials a dead kvpilot left open, aborted
    swept: str | None = None  # an orphaned canary cleaned up, in words
    kept: tuple[str, ...] = ()  # restores not made: a person had changed the server


class Tuner(Protocol):
    """The tuning of one runtime's stable server."""

    @property
    def name(self) -> str:
        """The stable server's name."""
        ...

    @property
    def start_wait_s(self) -> float:
        """How long the recovery at start-up waits for the lease (another tuner's)."""
        ...

    async def study(self, tuning: TuningConfig | None = None) -> Study:
        """The study of a run now (default: under the tuner's own `tuning`)."""
        ...

    def lease(self, *, wait_s: float = 0.0) -> AbstractAsyncContextManager[None]:
        """The right to tune; TuningBlocked when another tuner holds it beyond `wait_s`."""
        ...

    async def recover(self, study: Study) -> Recovery:
        """Within the lease: what an earlier run left open, resumed or recovered."""
        ...

    def session(self, study: Study, *, on_progress: ShowProgress | None = None) -> TuningSession:
        """A session of `study` over this runtime."""
        ...

    def stable_argv(self) -> tuple[str, ...]:
        """The flags the stable server runs now."""
        ...

    def hand_over(self) -> None:
        """kvpilot is stopping during a run: a promotion under way is left to the next one."""
        ...


class TuningRefused(TuningBlocked):
    """The run's settings cannot pass even a canary equal to the stable: it could only roll
    back or end inconclusive, so it is refused before any server starts."""


def study_reachability(study: Study) -> Reachability:
    """Whether an equal canary can pass the study's rollouts (`tuner.rollout.reachable`),
    judged as its observer's samples are: replayed windows of the workload's requests, or
    live traffic's one analysis of `canary.analysis_s` in intervals."""
    canary = study.tuning.canary
    metrics = DEFAULT_METRICS if canary.traffic == "replay" else LIVE_METRICS
    return traffic_reachability(
        rollout_settings(study, JudgeConfig(metrics=metrics)),
        canary,
        requests_per_window=study.workload.num_requests,
        strategy=study.strategy,
    )


def refuse_unreachable(study: Study) -> None:
    """TuningRefused, with the reason and what would do, when the study cannot pass."""
    found = study_reachability(study)
    if not found.passes:
        raise TuningRefused(f"tuning refused: {found.reason}")


async def _plainly(
    make: Callable[[ShowProgress | None], TuningSession], trials: int
) -> SessionSummary:
    return await make(None).run(trials)


async def run_tuning(
    tuner: Tuner,
    study: Study,
    *,
    on_recovered: Callable[[Recovery], None],
    run: RunSession = _plainly,
) -> SessionSummary:
    """One tuning run: under the tuner's lease, the recovery (told to `on_recovered`), then
    `study.tuning.trials` trials of a session (run by `run`, a progress display say).
    TuningRefused first, before the lease, when the study's settings cannot pass."""
    await asyncio.to_thread(refuse_unreachable, study)  # CPU-bound: the loop keeps ticking
    async with tuner.lease():
        on_recovered(await tuner.recover(study))
        return await run(lambda show: tuner.session(study, on_progress=show), study.tuning.trials)
