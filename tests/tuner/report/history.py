"""A small, realistic tuning history for the report's tests: a KV budget and max-num-seqs
study on the CPU build, the planner's bounds, baselines, canary verdicts and warm-ups."""

from __future__ import annotations

import dataclasses

from kvpilot.collectors.histogram import Histogram
from kvpilot.tuner.judge.judgement import judge
from kvpilot.tuner.load.learned import WorkloadShape
from kvpilot.tuner.planner import FeasibleBounds
from kvpilot.tuner.problem.constraints import batched_tokens_constraint, planner_constraint
from kvpilot.tuner.problem.objective import TrialOutcome, TrialResult, WindowMetrics
from kvpilot.tuner.problem.space import Knob, KnobKind, SearchSpace
from kvpilot.tuner.trials import Trial, TrialState, Warmup, new_trial

MIB = 1 << 20
# The planner: one request of max_model_len needs 4 MiB; no more than 96 MiB is free.
BOUNDS = FeasibleBounds(None, None, 4 * MIB, 96 * MIB, 32 * 1024, ())
SPACE = SearchSpace(
    knobs=(
        Knob("kv_cache_memory_bytes", KnobKind.INTEGER, MIB, 128 * MIB, log_scale=True),
        Knob("max_num_seqs", KnobKind.INTEGER, 1, 256, log_scale=True),
    ),
    fixed=(("max_num_batched_tokens", 128),),
    constraints=(planner_constraint(BOUNDS), batched_tokens_constraint()),
)
STABLE = {"kv_cache_memory_bytes": 64 * MIB, "max_num_seqs": 32}
_LE = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, float("inf"))


def _cumulative(counts: tuple[int, ...]) -> Histogram:
    running, out = 0, []
    for le, n in zip(_LE, counts, strict=True):
        running += n
        out.append((le, float(running)))
    return Histogram(tuple(out), sum=0.0, count=float(running))


# A learned workload: prompts mostly 100-500 tokens, outputs mostly 20-100 (vLLM's buckets).
SHAPE = WorkloadShape(
    prompt_tokens=_cumulative((0, 0, 0, 0, 3, 20, 60, 140, 60, 17, 0, 0)),
    generation_tokens=_cumulative((0, 0, 2, 10, 60, 150, 70, 8, 0, 0, 0, 0)),
    rate_rps=1.7,
    prefix_hit_ratio=0.35,
    requests=300,
    window_s=176.0,
    block_size=16,
)


def _window(ttft: float, itl: float, goodput: float) -> WindowMetrics:
    return WindowMetrics("client", 30.0, 120, 0, 118, 118 / 120, ttft, itl, goodput, 0.0, 0.0)


def _result(goodput: float | None, memory: int, ttft: float, itl: float) -> TrialResult:
    metrics = _window(ttft, itl, goodput or 0.0)
    return TrialResult(TrialOutcome.FEASIBLE, goodput, memory, None, metrics)


def _spread(centre: float, n: int = 16) -> list[float]:
    return [centre * (0.9 + 0.2 * i / (n - 1)) for i in range(n)]


def history() -> list[Trial]:
    """Five trials: three judged canaries, one the planner refused, one that preempted."""
    baseline = _result(1030.0, 64 * MIB, 0.42, 0.031)
    cases = [
        (8 * MIB, 28, _result(1034.0, 8 * MIB, 0.44, 0.032), 0.43, 0.031),
        (24 * MIB, 64, _result(1290.0, 24 * MIB, 0.40, 0.030), 0.39, 0.030),
        (2 * MIB, 48, None, None, None),
        (
            6 * MIB,
            96,
            TrialResult(TrialOutcome.PREEMPTED, 610.0, 6 * MIB, "0.4 preemptions per request"),
            None,
            None,
        ),
        (48 * MIB, 16, _result(980.0, 48 * MIB, 0.61, 0.035), 0.60, 0.036),
    ]
    trials = []
    for i, (kv, seqs, result, ttft, itl) in enumerate(cases, 1):
        trial = new_trial(
            f"t{i}",
            "study",
            i,
            {"kv_cache_memory_bytes": kv, "max_num_seqs": seqs},
            1_700_000_000.0 + i,
        )
        if result is None:
            reason = f"planner: kv_cache_memory_bytes {kv} < {4 * MIB} (one request)"
            trials.append(
                trial.to(TrialState.INFEASIBLE, at_wall_s=trial.created_wall_s + 1, reason=reason)
            )
            continue
        trial = trial.to(TrialState.RUNNING, at_wall_s=trial.created_wall_s + 1)
        trial = trial.finish(result, at_wall_s=trial.created_wall_s + 60)
        if ttft is not None and itl is not None:
            goodput = result.goodput_tokens_per_s or 0.0
            canary = {
                "ttft_s": _spread(ttft),
                "inter_token_s": _spread(itl),
                "goodput_tokens_per_s": _spread(goodput),
            }
            stable = {
                "ttft_s": _spread(0.42),
                "inter_token_s": _spread(0.031),
                "goodput_tokens_per_s": _spread(1030.0),
            }
            trial = dataclasses.replace(
                trial, judgement=judge(canary, stable), baseline=baseline, warmup=Warmup(requests=8)
            )
        trials.append(trial)
    return trials
