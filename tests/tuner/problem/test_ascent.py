"""The top of the utilisation range is approached in steps from what is known to start."""

from __future__ import annotations

import itertools

import pytest

from kvpilot.tuner.problem.ascent import highest_started, stepped
from kvpilot.tuner.problem.objective import TrialOutcome, TrialResult
from kvpilot.tuner.problem.space import Candidate, Knob, KnobKind, SearchSpace
from kvpilot.tuner.rollout.canary import RolloutSettings, Strategy
from kvpilot.tuner.session import TuningSession
from tests.tuner.rollout.test_canary import SLO, STABLE, Rig

pytestmark = pytest.mark.anyio

SPACE = SearchSpace(knobs=(Knob("gpu_memory_utilization", KnobKind.REAL, 0.3, 0.99),))
STARTED = TrialResult(TrialOutcome.FEASIBLE, 100.0, None, None)
NOT_STARTED = TrialResult.failed_to_start("ValueError: Free memory on device ... is less than")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def test_the_highest_known_to_start_is_the_stables_or_a_started_trials() -> None:
    argv = (*STABLE, "--gpu-memory-utilization", "0.85")
    assert highest_started(argv, []) == 0.85
    assert highest_started(STABLE, []) == 0.9  # vLLM's default
    past = [
        ({"gpu_memory_utilization": 0.93}, STARTED),
        ({"gpu_memory_utilization": 0.97}, NOT_STARTED),
    ]
    assert highest_started(argv, past) == 0.93  # a failed start proves nothing


def test_a_jump_to_the_top_is_one_step_above_the_highest_known() -> None:
    top = SPACE.candidate({"gpu_memory_utilization": 0.99})
    moved, why = stepped(SPACE, top, 0.9)
    assert moved.as_dict() == {"gpu_memory_utilization": 0.92}
    assert why == (
        "gpu_memory_utilization 0.99 stepped down to 0.92: one step of 0.02 above 0.9, "
        "the highest known to start"
    )
    low = SPACE.candidate({"gpu_memory_utilization": 0.5})
    assert stepped(SPACE, low, 0.9) == (low, None)


class AlwaysTheTop:
    """A suggester that always asks for the top of the range."""

    def ask(self) -> Candidate:
        return SPACE.candidate({"gpu_memory_utilization": 0.99})

    def tell(self, candidate: Candidate, result: TrialResult) -> None:
        return None


async def test_a_session_climbs_to_the_top_one_started_trial_at_a_time() -> None:
    rig = Rig()
    ids = (f"id{i}" for i in itertools.count(1))
    session = TuningSession(
        space=SPACE,
        suggester=AlwaysTheTop(),
        store=rig.store,
        journal=rig.journal,
        runtime=rig.runtime,
        observer=rig.observer,
        fingerprint="study",
        settings=RolloutSettings(slo=SLO),
        strategy=Strategy.PARALLEL,
        wall_clock=lambda: float(next(rig.clock)),
        new_id=lambda: next(ids),
    )
    summary = await session.run(3)
    ran = [dict(o.trial.values)["gpu_memory_utilization"] for o in summary.outcomes]
    assert ran == [0.92, 0.94, 0.96]
