"""The top of the --gpu-memory-utilization range is approached in steps, not jumped to.

vLLM's start-up fails near 0.98-0.99 on some setups, and every failed start costs a restart.
A candidate may go at most `UTILIZATION_STEP` above the highest utilisation known to start:
the stable server's own (its flag, or vLLM's default) or that of a trial that started. Each
trial that starts higher moves the ceiling up by one step.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from kvpilot.collectors.vllm_argv import flag_value
from kvpilot.tuner.problem.constraints import Value
from kvpilot.tuner.problem.objective import TrialOutcome, TrialResult
from kvpilot.tuner.problem.space import Candidate, SearchSpace

KNOB = "gpu_memory_utilization"
UTILIZATION_STEP = 0.02
VLLM_DEFAULT_UTILIZATION = 0.9


def highest_started(
    stable_argv: Sequence[str], past: Iterable[tuple[Mapping[str, Value], TrialResult]]
) -> float:
    """The highest utilisation known to start: the stable's, or a past trial's that started."""
    flag = flag_value(stable_argv, "--gpu-memory-utilization")
    highest = float(flag) if flag is not None else VLLM_DEFAULT_UTILIZATION
    for values, result in past:
        value = values.get(KNOB)
        if isinstance(value, int | float) and result.outcome is not TrialOutcome.FAILED_TO_START:
            highest = max(highest, float(value))
    return highest


def stepped(
    space: SearchSpace, candidate: Candidate, highest: float, step: float = UTILIZATION_STEP
) -> tuple[Candidate, str | None]:
    """The candidate with its utilisation at most one step above `highest`, and what was
    changed (None: nothing)."""
    values = candidate.as_dict()
    value = values.get(KNOB)
    if KNOB not in space.names or not isinstance(value, int | float):
        return candidate, None
    knob = next(k for k in space.knobs if k.name == KNOB)
    ceiling = max(round(highest + step, 4), float(knob.low or 0.0))
    if value <= ceiling:
        return candidate, None
    moved = space.candidate({**values, KNOB: ceiling})
    if space.violation(moved) is not None:
        return candidate, None  # the step would break a constraint: the planner's region wins
    return moved, (
        f"{KNOB} {value:g} stepped down to {ceiling:g}: one step of {step:g} above "
        f"{highest:g}, the highest known to start"
    )
