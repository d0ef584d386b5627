"""Trials on a simulated landscape as the product runs them: seconds, a judge, promotions.

Costs, from the CPU rig's measurements: a server start 26 s (the median `server_start_s` of
the committed capacity tables, 24.7-30.4 s); a failed start the same (vLLM fails on KV memory
after its profiling run, most of a start); a window 3 s (the judge's A/A windows,
`data/judge_aa.jsonl`, take 2.2-2.3 s for 48 requests; a default window is 64); a restart of
the stable side on promotion, one start. The budget is what today's default tuner spends on
8 trials judged to 32 windows (the earliest an equal canary passes) and one promotion:
8 * (26 + 32 * 3) + 26 = 1002 s.

The judge is simplified to its decision rule on simulated windows: each window observes the
configuration's log capacity margin over the target plus fresh log-normal noise (sd 0.08:
the median spread of the windows within a cell of the three burst tables, pass 3); at looks
of 8, 16, 32 and 64 windows it passes when the mean's lower bound (z = 2.24, 0.05 spent
over four looks) is above 0, fails when its upper bound is below 0, else looks again;
undecided at 64 is a rollback. A canary that passes and uses less KV memory than the stable
side is promoted (the stable side restarts); the recommendation is the stable side at the
end of the budget.
"""

from __future__ import annotations

import dataclasses
import math
import random
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

from tuner_sim import BATCHED_RANGE, SEQS_RANGE, Config, Landscape

from kvpilot.agent.tuning.study import MEASURED_KV_ERROR_RATIO
from kvpilot.tuner.problem.constraints import batched_tokens_constraint
from kvpilot.tuner.problem.objective import TrialOutcome, TrialResult
from kvpilot.tuner.problem.space import Candidate, Knob, KnobKind, SearchSpace
from kvpilot.tuner.suggest import (
    SUGGESTERS,
    Knowledge,
    KvPrior,
    LoadShape,
    MemoryAxis,
    SearchExhausted,
    make_suggester,
)

START_S = 26.0
FAILED_START_S = 26.0
WINDOW_S = 3.0
RESTART_S = 26.0
LOOKS = (8, 16, 32, 64)
Z = 2.24
WINDOW_SD = 0.08
BUDGET_S = 8 * (START_S + 32 * WINDOW_S) + RESTART_S


@dataclass(frozen=True, slots=True)
class Verdict:
    """What a trial showed: started, the judge's decision, windows spent, the mean margin."""

    started: bool
    passed: bool
    windows: int
    margin: float


def judge(ls: Landscape, c: Config, rng: random.Random) -> Verdict:
    """The sequential decision rule on fresh windows (see the module docstring)."""
    if not ls.starts(c):
        return Verdict(False, False, 0, -math.inf)
    return decide(math.log(max(ls.capacity(c), 1e-9) / ls.target_rps), rng)


def decide(truth: float, rng: random.Random) -> Verdict:
    """The judge on windows whose true log margin over the target is `truth`."""
    total, seen = 0.0, 0
    for look in LOOKS:
        while seen < look:
            total += truth + rng.gauss(0.0, WINDOW_SD)
            seen += 1
        mean, half = total / seen, Z * WINDOW_SD / math.sqrt(seen)
        if mean - half > 0:
            return Verdict(True, True, seen, mean)
        if mean + half < 0:
            return Verdict(True, False, seen, mean)
    return Verdict(True, False, seen, total / seen)


def pass_share(margin: float, trials: int = 4000) -> float:
    """How often the judge passes a configuration whose true log margin is `margin` (the
    same windows for every margin, so the share never falls as the margin grows)."""
    return sum(decide(margin, random.Random(trial)).passed for trial in range(trials)) / trials


def margin_passed(share: float) -> float:
    """The least log margin the judge passes in `share` of trials (to 0.0005)."""
    low, high = 0.0, 0.2
    while high - low > 0.0005:
        middle = (low + high) / 2
        low, high = (low, middle) if pass_share(middle) >= share else (middle, high)
    return high


def space_of(ls: Landscape) -> SearchSpace:
    """The product's space on this landscape: KV bytes (log), seqs 1-512, batched tokens."""
    return SearchSpace(
        knobs=(
            Knob("kv_cache_memory_bytes", KnobKind.INTEGER, ls.kv_low, ls.kv_high, log_scale=True),
            Knob("max_num_seqs", KnobKind.INTEGER, *SEQS_RANGE, log_scale=True),
            Knob("max_num_batched_tokens", KnobKind.INTEGER, *BATCHED_RANGE, log_scale=True),
        ),
        constraints=(batched_tokens_constraint(),),
    )


def config_of(candidate: Candidate) -> Config:
    return Config(
        int(candidate["kv_cache_memory_bytes"]),
        int(candidate["max_num_seqs"]),
        int(candidate["max_num_batched_tokens"]),
    )


def result_of(ls: Landscape, c: Config, v: Verdict, rng: random.Random) -> TrialResult:
    """What the product's observer would report: goodput at the replayed load (a plateau:
    every configuration that holds serves the same load), the KV budget, or a failed start
    whose log names the free memory (where the cliff is)."""
    if not v.started:
        free_gib = ls.free_bytes / (1 << 30)
        log = (
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate "
            f"{c.kv_bytes / (1 << 30):.2f} GiB of KV cache; {free_gib:.2f} GiB free"
        )
        return TrialResult.failed_to_start(log, c.kv_bytes)
    served = ls.target_rps * min(1.0, math.exp(v.margin)) * ls.output_tokens
    goodput = served * math.exp(rng.gauss(0.0, WINDOW_SD / 4))
    if v.passed:
        return TrialResult(TrialOutcome.FEASIBLE, goodput, c.kv_bytes, None)
    return TrialResult(TrialOutcome.SLO_BROKEN, goodput, c.kv_bytes, "SLO not held")


@dataclass(slots=True)
class RunRecord:
    """One strategy's run on one landscape."""

    stable: Config
    elapsed_s: float = 0.0
    trials: int = 0
    failed_starts: int = 0
    promotions: int = 0
    worse_promotions: int = 0
    first_promotion_s: float | None = None
    history: list[tuple[Config, Verdict]] = field(default_factory=list)


Ask = Callable[[], Config | None]
Tell = Callable[[Config, Verdict, TrialResult], None]


def run_trials(
    ls: Landscape, ask: Ask, tell: Tell, seed: int, regret: Callable[[Config], float]
) -> RunRecord:
    """Trials until the budget is spent: start, judge, promote when it holds with less KV."""
    rng = random.Random(seed * 104729 + ls.seed)
    record = RunRecord(stable=ls.deployed)
    while record.elapsed_s < BUDGET_S:
        c = ask()
        if c is None:
            break
        v = judge(ls, c, rng)
        record.trials += 1
        record.elapsed_s += (START_S + v.windows * WINDOW_S) if v.started else FAILED_START_S
        record.failed_starts += 0 if v.started else 1
        record.history.append((c, v))
        if v.passed and c.kv_bytes < record.stable.kv_bytes:
            record.worse_promotions += regret(c) > regret(record.stable)
            record.stable, record.promotions = c, record.promotions + 1
            record.elapsed_s += RESTART_S
            if record.first_promotion_s is None:
                record.first_promotion_s = record.elapsed_s
        tell(c, v, result_of(ls, c, v, rng))
    return record


Strategy = Callable[[Landscape, int, Callable[[Config], float]], RunRecord]


def registered_suggesters() -> tuple[str, ...]:
    """The names `tuning.suggester` accepts, as the product registers them; grid is left
    out: a fixed walk of the grid, not a search within a budget."""
    return tuple(name for name in SUGGESTERS if name != "grid")


# The learned window's measure of the KV a running request holds errs against the truth
# by this log-normal spread: an assumption (gauges sampled each tick over the window, the
# replay faster than the traffic measured), not a measurement.
OBSERVED_KV_SD = 0.1


def knowledge_of(ls: Landscape, seed: int = 0) -> Knowledge:
    """What the product knows on this landscape before its first trial, the fields the agent
    fills (`agent/tuning/study.py`): the stable side's flags, the planner's KV need (its
    exact bytes per token times the tokens in flight at the batch the load needs: the true
    knee errs against it by about 30 %), the KV-budget knob's identity axis, and the load's
    shape as the study computes it for an open-loop load: Little's law at the inter-token
    SLO's limit (the replayed rate times the output times the SLO's gap; the simulator has
    no TTFT limit), an upper end of the batch the load needs (here 1.0-2.7x it), the
    planner's KV bytes a request holds and the output tokens a second the load offers. The
    stable server's gauges measured the KV a running request holds (the learned window's
    `kv_blocks_per_running`): the true bytes a sequence holds times a drawn error
    (`OBSERVED_KV_SD`, seeded by the run), which the study tells in place of the planner's
    with the band of a measurement."""
    in_flight_tokens = ls.need * (ls.prompt_tokens + ls.output_tokens / 2)
    requests = ls.target_rps * ls.output_tokens * ls.itl_slo_s
    load = LoadShape.from_planner(
        ls.geometry, requests, ls.prompt_tokens, ls.output_tokens, ls.target_rps
    )
    error = random.Random(f"kv:{ls.seed}:{seed}").gauss(0.0, OBSERVED_KV_SD)
    measured = dataclasses.replace(
        load,
        kv_bytes_per_request=ls.seq_bytes * math.exp(error),
        error_ratio=MEASURED_KV_ERROR_RATIO,
    )
    return Knowledge(
        prior=KvPrior.from_planner(ls.geometry, in_flight_tokens),
        deployed={
            "kv_cache_memory_bytes": ls.deployed.kv_bytes,
            "max_num_seqs": ls.deployed.max_num_seqs,
            "max_num_batched_tokens": ls.deployed.batched_tokens,
        },
        axis=MemoryAxis.identity(),
        load=measured,
    )


def suggester_strategy(name: str) -> Strategy:
    """The product's suggester `name`, built as the study builds it (`make_suggester` with
    the landscape's knowledge)."""

    def run(ls: Landscape, seed: int, regret: Callable[[Config], float]) -> RunRecord:
        suggester = make_suggester(name, space_of(ls), seed, knowledge_of(ls, seed))
        asked: dict[Config, Candidate] = {}

        def ask() -> Config | None:
            try:
                candidate = suggester.ask()
            except SearchExhausted:
                return None
            c = config_of(candidate)
            asked[c] = candidate
            return c

        def tell(c: Config, _v: Verdict, result: TrialResult) -> None:
            suggester.tell(asked[c], result)

        return run_trials(ls, ask, tell, seed, regret)

    return run


def auto_tune(ls: Landscape, seed: int, regret: Callable[[Config], float]) -> RunRecord:
    """vLLM's auto_tune.sh: memory descends from 98 % of the range's top by 1 % while the
    start fails at the largest seqs and batched tokens (giving up below 90 %), then every
    NUM_SEQS_LIST (128 256) x NUM_BATCHED_TOKENS_LIST (512 1024 2048 4096) at that memory."""
    plan = [Config(int(ls.kv_high * u / 100), 256, 4096) for u in range(98, 89, -1)]
    grid = [(s, t) for s in (128, 256) for t in (512, 1024, 2048, 4096) if s <= t]
    state: dict[str, int | None] = {"memory": None, "i": 0}

    def ask() -> Config | None:
        if state["memory"] is None:
            return plan[state["i"]] if state["i"] < len(plan) else None
        i = state["i"]
        if i >= len(grid):
            return None
        return Config(int(state["memory"]), *grid[i])

    def tell(c: Config, v: Verdict, _r: TrialResult) -> None:
        if state["memory"] is None and v.started:
            state["memory"], state["i"] = c.kv_bytes, 0
            return
        state["i"] += 1

    return run_trials(ls, ask, tell, seed, regret)


def optuna_strategy(kind: str) -> Strategy:
    """Optuna's GP or TPE sampler minimising the KV budget, the judge's verdict as its
    constraint (a failed start or SLO miss infeasible), 3 random trials first."""

    def run(ls: Landscape, seed: int, regret: Callable[[Config], float]) -> RunRecord:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.ERROR)  # its convergence notes

        def constraints(trial: optuna.trial.FrozenTrial) -> list[float]:
            return [float(trial.user_attrs["infeasible"])]

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sampler: optuna.samplers.BaseSampler = (
                optuna.samplers.GPSampler(
                    seed=seed, n_startup_trials=3, constraints_func=constraints
                )
                if kind == "gp"
                else optuna.samplers.TPESampler(
                    seed=seed, n_startup_trials=3, constraints_func=constraints
                )
            )
            study = optuna.create_study(direction="minimize", sampler=sampler)
            pending: dict[Config, optuna.trial.Trial] = {}

            def ask() -> Config | None:
                trial = study.ask()
                seqs = trial.suggest_int("max_num_seqs", *SEQS_RANGE, log=True)
                tokens = trial.suggest_int("max_num_batched_tokens", *BATCHED_RANGE, log=True)
                kv = round(trial.suggest_float("kv_bytes", ls.kv_low, ls.kv_high, log=True))
                c = Config(kv, seqs, max(tokens, seqs))
                pending[c] = trial
                return c

            def tell(c: Config, v: Verdict, _r: TrialResult) -> None:
                trial = pending.pop(c)
                trial.set_user_attr("infeasible", -1.0 if v.passed else 1.0)
                study.tell(trial, math.log(c.kv_bytes))

            return run_trials(ls, ask, tell, seed, regret)

    return run


def strategies() -> dict[str, Strategy]:
    """The anchors and every registered suggester of the product, by name."""
    out: dict[str, Strategy] = {name: suggester_strategy(name) for name in registered_suggesters()}
    out["auto_tune"] = auto_tune
    out["optuna-gp"] = optuna_strategy("gp")
    out["optuna-tpe"] = optuna_strategy("tpe")
    return out
