"""The knee search on a synthetic vLLM: the batch first at ample memory, then the memory at
the least batch; the start limit, the inter-token limit, the prefill step, and when it
applies."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from kvpilot.tuner.problem.constraints import batched_tokens_constraint
from kvpilot.tuner.problem.objective import TrialOutcome, TrialResult
from kvpilot.tuner.problem.space import Candidate, Knob, KnobKind, SearchSpace
from kvpilot.tuner.problem.startup_errors import StartupFailure, StartupFailureKind
from kvpilot.tuner.suggest import (
    InformedSuggester,
    KneeSuggester,
    Knowledge,
    LoadShape,
    MemoryAxis,
    SearchExhausted,
    make_suggester,
)
from kvpilot.tuner.suggest.knee import _BatchFit, knee_applies

MIB = 1 << 20
GOODPUT = 1000.0  # tokens per second when the load is served in full


def space(batched: bool = True) -> SearchSpace:
    knobs = [
        Knob("kv_cache_memory_bytes", KnobKind.INTEGER, 16 * MIB, 16384 * MIB, log_scale=True),
        Knob("max_num_seqs", KnobKind.INTEGER, 1, 512, log_scale=True),
    ]
    if batched:
        knobs.append(Knob("max_num_batched_tokens", KnobKind.INTEGER, 512, 16384, log_scale=True))
    return SearchSpace(tuple(knobs), constraints=(batched_tokens_constraint(),))


@dataclass(frozen=True)
class Vllm:
    """A load that needs `need` sequences of `seq_mib` each; capacity falls as the square of
    the KV budget below what the batch holds, above `itl_limit` sequences the inter-token
    gap breaks the SLO, and a budget above `cliff_mib` fails to start."""

    need: int = 40
    seq_mib: float = 100.0
    itl_limit: int = 10_000
    cliff_mib: float = 12_000.0
    stall_tokens: int | None = None  # the inter-token limit binds only above this step

    def __call__(self, candidate: Candidate) -> TrialResult:
        memory = float(candidate["kv_cache_memory_bytes"])
        seqs = int(candidate["max_num_seqs"])  # type: ignore[call-overload]
        tokens = int(candidate.as_dict().get("max_num_batched_tokens", 0))  # type: ignore[call-overload]
        stalls = self.stall_tokens is None or tokens > self.stall_tokens
        if memory > self.cliff_mib * MIB:
            failure = StartupFailure(StartupFailureKind.OUT_OF_MEMORY, "CUDA out of memory", None)
            return TrialResult(
                TrialOutcome.FAILED_TO_START, None, int(memory), "oom", startup_failure=failure
            )
        held = memory / (self.seq_mib * MIB)  # sequences the budget holds
        usable = min(seqs, self.need)
        served = usable / self.need * min(1.0, held / usable) ** 2
        if seqs > self.itl_limit and stalls:
            served = min(served, 0.8 * self.itl_limit / seqs)
        if served >= 1.0:
            return TrialResult(TrialOutcome.FEASIBLE, GOODPUT, int(memory), None)
        return TrialResult(TrialOutcome.SLO_BROKEN, GOODPUT * served, int(memory), "SLO")


def load(
    requests: float = 52.0,
    seq_mib: float = 100.0,
    prompt: float = 1000.0,
    offered: float | None = GOODPUT,
) -> LoadShape:
    return LoadShape(requests, seq_mib * MIB, prompt, offered_tokens_per_s=offered)


def run(
    suggester: KneeSuggester, vllm: Callable[[Candidate], TrialResult], trials: int = 30
) -> list[tuple[Candidate, TrialResult]]:
    history = []
    for _ in range(trials):
        try:
            candidate = suggester.ask()
        except SearchExhausted:
            break
        result = vllm(candidate)
        history.append((candidate, result))
        suggester.tell(candidate, result)
    return history


def least_held(history: list[tuple[Candidate, TrialResult]]) -> Candidate:
    held = [c for c, r in history if r.feasible]
    return min(held, key=lambda c: float(c["kv_cache_memory_bytes"]))


def test_it_finds_the_batch_then_the_least_memory_that_holds_it() -> None:
    vllm = Vllm(need=40, seq_mib=100.0)
    suggester = KneeSuggester(space(), load=load(requests=52), axis=MemoryAxis.identity())
    history = run(suggester, vllm)
    best = least_held(history)
    assert 40 <= int(best["max_num_seqs"]) <= 44  # type: ignore[call-overload]
    assert float(best["kv_cache_memory_bytes"]) <= 40 * 100 * MIB * 1.1
    # The first probe: the estimated batch at memory that holds it if the planner errs.
    first, _ = history[0]
    assert first["max_num_seqs"] == 52
    assert float(first["kv_cache_memory_bytes"]) >= 52 * 100 * MIB * 1.3
    assert len(history) <= 12  # two bisections, not a walk


def test_an_estimate_short_of_the_batch_is_raised_where_more_served_more() -> None:
    vllm = Vllm(need=40, seq_mib=100.0)
    suggester = KneeSuggester(space(), load=load(requests=20), axis=MemoryAxis.identity())
    history = run(suggester, vllm)
    asked = [int(c["max_num_seqs"]) for c, _ in history]  # type: ignore[call-overload]
    # Downward first (the estimate is an upper end), then up past it when fewer served less.
    assert asked[:3] == [20, 13, 30]
    assert 40 <= int(least_held(history)["max_num_seqs"]) <= 44  # type: ignore[call-overload]


def test_past_the_inter_token_limit_it_looks_below_not_above() -> None:
    # 52 sequences break the inter-token SLO where 40 would hold: more would not help.
    vllm = Vllm(need=40, seq_mib=100.0, itl_limit=45)
    suggester = KneeSuggester(space(), load=load(requests=52), axis=MemoryAxis.identity())
    history = run(suggester, vllm)
    asked = [int(c["max_num_seqs"]) for c, _ in history]  # type: ignore[call-overload]
    assert asked[0] == 52 and asked[1] < 52
    assert max(asked) == 52  # never more sequences than a miss that served less
    assert 40 <= int(least_held(history)["max_num_seqs"]) <= 45  # type: ignore[call-overload]


def test_a_failed_start_is_tried_again_below_it_and_never_above() -> None:
    vllm = Vllm(need=40, seq_mib=100.0, cliff_mib=6000.0)
    suggester = KneeSuggester(space(), load=load(requests=52), axis=MemoryAxis.identity())
    history = run(suggester, vllm)
    failed = [
        float(c["kv_cache_memory_bytes"])
        for c, r in history
        if r.outcome is TrialOutcome.FAILED_TO_START
    ]
    assert failed, "the first probe's ample memory lies above the start limit"
    after = history[len(failed) :]
    assert all(float(c["kv_cache_memory_bytes"]) < min(failed) for c, _ in after)
    assert least_held(history)


def test_it_never_asks_more_memory_than_the_deployed_side_runs_with() -> None:
    deployed = {"kv_cache_memory_bytes": 5000 * MIB, "max_num_seqs": 256}
    suggester = KneeSuggester(
        space(), load=load(requests=52), axis=MemoryAxis.identity(), deployed=deployed
    )
    history = run(suggester, Vllm(need=40, seq_mib=100.0))
    assert all(float(c["kv_cache_memory_bytes"]) <= 5000 * MIB for c, _ in history)
    assert not any(r.outcome is TrialOutcome.FAILED_TO_START for _, r in history)


def test_a_step_prefills_two_prompts_beside_a_decode_token_of_every_sequence() -> None:
    suggester = KneeSuggester(
        space(), load=load(requests=52, prompt=3000), axis=MemoryAxis.identity()
    )
    first = suggester.ask()
    assert first["max_num_batched_tokens"] == 2 * 3000 + 52
    # Never less than vLLM's own step for an online server.
    chat = KneeSuggester(space(), load=load(requests=52, prompt=200), axis=MemoryAxis.identity())
    assert chat.ask()["max_num_batched_tokens"] == 2048
    short = KneeSuggester(space(), load=load(requests=600, prompt=10), axis=MemoryAxis.identity())
    candidate = short.ask()  # never fewer tokens than sequences: vLLM refuses that
    assert int(candidate["max_num_batched_tokens"]) >= int(candidate["max_num_seqs"])  # type: ignore[call-overload]


def test_it_says_why_and_waits_for_a_result_before_the_next_probe() -> None:
    suggester = KneeSuggester(space(), load=load(requests=52), axis=MemoryAxis.identity())
    first = suggester.ask()
    assert "52 requests in flight" in suggester.explain(first)
    # A dry run asks without telling: the next probe follows from this one's result.
    with pytest.raises(SearchExhausted, match="follows from what the last one shows"):
        suggester.ask()
    suggester.tell(first, Vllm(need=40)(first))
    second = suggester.ask()
    assert second != first and "bracketing the batch" in suggester.explain(second)


def test_converged_it_says_so() -> None:
    suggester = KneeSuggester(space(), load=load(requests=40), axis=MemoryAxis.identity())
    history = run(suggester, Vllm(need=40, seq_mib=100.0), trials=50)
    assert len(history) < 50
    with pytest.raises(SearchExhausted, match=r"converged|held"):
        suggester.ask()


def test_a_utilisation_knob_is_searched_through_its_kv_axis() -> None:
    gpu = 80 * 1024 * MIB
    utilisation = SearchSpace(
        (
            Knob("gpu_memory_utilization", KnobKind.REAL, 0.3, 0.95),
            Knob("max_num_seqs", KnobKind.INTEGER, 1, 512, log_scale=True),
        )
    )
    axis = MemoryAxis.for_utilization(gpu, 20 * 1024 * MIB)
    suggester = KneeSuggester(utilisation, load=load(requests=52), axis=axis)
    first = suggester.ask()
    kv = axis.kv_bytes(float(first["gpu_memory_utilization"]))
    assert kv == pytest.approx(52 * 100 * MIB * 1.3 * 1.1, rel=0.01)


def test_informed_searches_the_knee_only_where_it_knows_enough() -> None:
    known = Knowledge(axis=MemoryAxis.identity(), load=load())
    assert isinstance(make_suggester("informed", space(), 0, known), KneeSuggester)
    # Without the load's shape, the memory's KV bytes, or max_num_seqs: memory bisection.
    no_load = Knowledge(axis=MemoryAxis.identity())
    assert isinstance(make_suggester("informed", space(), 0, no_load), InformedSuggester)
    memory_only = SearchSpace(space().knobs[:1])
    assert not knee_applies(memory_only, load(), MemoryAxis.identity())
    assert isinstance(make_suggester("informed", memory_only, 0, known), InformedSuggester)
    assert not knee_applies(space(), load(), None)


@pytest.mark.parametrize(
    "bad",
    [
        {"requests_in_flight": 0},
        {"kv_bytes_per_request": -1},
        {"prompt_tokens": math.inf},
        {"offered_tokens_per_s": 0.0},
        {"offered_tokens_per_s": math.nan},
    ],
)
def test_a_load_shape_is_refused_where_it_cannot_be_one(bad: dict) -> None:
    fields = {"requests_in_flight": 4.0, "kv_bytes_per_request": 1.0, "prompt_tokens": 8.0}
    with pytest.raises(ValueError, match=next(iter(bad))):
        LoadShape(**{**fields, **bad})


def test_two_misses_fit_the_batch_and_the_next_probe_holds_with_room() -> None:
    """Served share grows as batch / (a + b * batch) (each step reads the weights once and
    every sequence's KV): the fit through two points gives it back, and the batch it asks
    for serves the load with the margin asked."""
    a, b = 30.0, 0.4

    def share(s: float) -> float:
        return s / (a + b * s)

    fit = _BatchFit.through((20.0, share(20.0)), (40.0, share(40.0)))
    assert fit.a == pytest.approx(a) and fit.b == pytest.approx(b)
    batch = fit.batch_for(0.035)
    assert batch is not None
    assert share(batch) >= math.exp(0.035) > share(batch - 1)
    assert _BatchFit(a, 1.2).batch_for(0.0) is None  # a share that never reaches the load


def test_a_prefill_step_that_stalls_every_batch_is_halved() -> None:
    """Above 4096 tokens a step stalls the decodes: 10 sequences serve a quarter of the load
    and more serve less. Once fewer and more both served less, the step is halved (never
    below vLLM's 2048) and the batch searched again there, where 40 hold."""
    vllm = Vllm(need=40, seq_mib=100.0, itl_limit=10, stall_tokens=4096)
    suggester = KneeSuggester(
        space(), load=load(requests=12, prompt=3000), axis=MemoryAxis.identity()
    )
    history = run(suggester, vllm, trials=40)
    steps = [int(c["max_num_batched_tokens"]) for c, _ in history]  # type: ignore[call-overload]
    assert steps[0] == 2 * 3000 + 12 and min(steps) >= 2048
    assert any(step <= 4096 for step in steps), "the step was never halved"
    best = least_held(history)
    assert int(best["max_num_batched_tokens"]) <= 4096  # type: ignore[call-overload]
    assert 40 <= int(best["max_num_seqs"]) <= 46  # type: ignore[call-overload]


def test_a_miss_that_came_close_keeps_the_step() -> None:
    """Where the best miss served 90 % of what the load offers (38 sequences, 95 %), the
    batch is searched on at the same step: the limit is near, not a stall."""
    vllm = Vllm(need=40, seq_mib=100.0, itl_limit=38, stall_tokens=4096)
    suggester = KneeSuggester(
        space(), load=load(requests=38, prompt=3000), axis=MemoryAxis.identity()
    )
    history = run(suggester, vllm, trials=8)
    steps = {int(c["max_num_batched_tokens"]) // 100 for c, _ in history}  # type: ignore[call-overload]
    assert all(step >= 60 for step in steps)  # 2 * 3000 + seqs: never halved


def test_a_step_that_serves_most_at_one_sequence_is_halved_too() -> None:
    """Above 4096 tokens every added sequence serves less, one the most: with no fewer to
    try, the knob's floor bounds the best from below and the step is halved."""
    smooth = Vllm(need=40, seq_mib=100.0)

    def vllm(candidate: Candidate) -> TrialResult:
        tokens = int(candidate["max_num_batched_tokens"])  # type: ignore[call-overload]
        if tokens <= 4096:
            return smooth(candidate)
        seqs = int(candidate["max_num_seqs"])  # type: ignore[call-overload]
        memory = int(candidate["kv_cache_memory_bytes"])  # type: ignore[call-overload]
        return TrialResult(TrialOutcome.SLO_BROKEN, GOODPUT * 0.02 / seqs, memory, "SLO")

    suggester = KneeSuggester(
        space(), load=load(requests=12, prompt=3000), axis=MemoryAxis.identity()
    )
    history = run(suggester, vllm, trials=40)
    assert any(int(c["max_num_batched_tokens"]) <= 4096 for c, _ in history)  # type: ignore[call-overload]
    assert 40 <= int(least_held(history)["max_num_seqs"]) <= 46  # type: ignore[call-overload]
