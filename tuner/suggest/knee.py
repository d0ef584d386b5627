"""The batch first, then the memory: a suggester for when the load's batch is known.

vLLM holds a load at the SLO when `max_num_seqs` lets it run the batch the load needs
(fewer queue; many more let a burst stretch every inter-token gap) and the KV budget holds
that batch's tokens. So the least memory that holds follows the least batch that holds: KV
need is sequences times the KV bytes each holds (the planner's exact bytes per token times
the prompt and half the output). Knowing the requests in flight (Little's law on the
learned load, an estimate), the search is two bisections instead of a guess in three knobs:

1. **The batch.** `max_num_seqs` from the estimate, each probe at memory that holds that
   many sequences even where the planner errs (`error_ratio` and a margin above its need,
   never more than the deployed side runs with): below the least batch that held, a miss
   had too few sequences, and what it served says how many the load needs. Each decode
   step reads the weights once and every sequence's KV, so the share served grows as
   batch / (a + b * batch); two misses far enough apart fit it (one miss gets a second,
   far below it, quick to fail), and the next probe goes where the fit serves the load
   with `_HOLD_MARGIN` to spare: a probe right at the load takes the judge all its
   windows. The bracket closes when the two are `seqs_tolerance_ratio` apart. Before
   anything holds, served goodput rises with sequences up to the inter-token limit and
   falls past it, so the search moves around the miss that served most, downward first
   (the estimate is an upper end).
2. **The memory.** At the least batch that held, the KV budget from the planner's low end
   for that batch (further down while it holds), then where the misses put the least that
   holds with that margin: capacity below the knee falls as a power of the budget (about
   2), which two misses far enough apart measure; never above the knee, where the batch's
   own margin is all there is. It stops when the aim is what already held, or the least
   that held and the highest miss are `memory_tolerance_ratio` apart.

`max_num_batched_tokens` (when searched) is what one step needs to prefill two mean prompts
(arrivals come in bursts) beside a decode token of every running sequence, never below
vLLM's own default (2048) or `max_num_seqs` (vLLM refuses that), within the knob's range.
Where nothing holds at any batch (fewer and more sequences both served less, and the best
far short of the load), the step's prefill stalls the decodes past the inter-token limit:
it is halved, not below the default, and the batch searched again. A failed start marks the
cliff: later probes stay a tenth below it. Converged, it says so (`SearchExhausted`): the
caller promotes what held.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass

from kvpilot.tuner.problem.constraints import Value
from kvpilot.tuner.problem.objective import TrialOutcome, TrialResult
from kvpilot.tuner.problem.space import MEMORY_KNOBS, Candidate, Knob, SearchSpace
from kvpilot.tuner.problem.startup_errors import StartupFailureKind
from kvpilot.tuner.suggest.base import SearchExhausted
from kvpilot.tuner.suggest.prior import LoadShape, MemoryAxis

SEQS = "max_num_seqs"
# vLLM's own max_num_batched_tokens for an online server with chunked prefill (the V1
# engine's default on most GPUs): a step never prefills less than vLLM would itself.
_VLLM_BATCHED_TOKENS = 2048
BATCHED = "max_num_batched_tokens"
_FLOOR_KINDS = (StartupFailureKind.CACHE_TOO_SMALL, StartupFailureKind.NO_CACHE_MEMORY)
_EXPAND = 1.5  # a step outward while one side of the batch's bracket is unknown
_BELOW_CLIFF = 0.1  # the next probe's memory under the least that failed to start
# Aim a little above an estimated threshold: a probe there passes the judge in few windows,
# one right at it takes all of them.
_AIM = 0.05
# Below the KV knee capacity falls about as the square of the budget (preempted sequences
# recompute): 1.9 measured on the CPU rig's chat table (benchmarks/data). Two misses at one
# batch measure it for this load, within these bounds.
_KV_EXPONENT = 2.0
_KV_EXPONENT_RANGE = (1.2, 3.5)
# The margin over the load a probe aims for: the judge passes a log margin of 0.03 in 80 %
# of trials (benchmarks/tuner_sim_run.py, margin_passed), one right at the load never.
_HOLD_MARGIN = 0.035
# Two misses this far apart (a ratio of the knob) measure a fit; closer, the noise of what
# they served would be the fit.
_FIT_SPREAD = 1.3
_NEAR = 0.9  # a miss that served this share of the load or more came close to holding
# An aim this close to what already held is not worth a trial: a probe there decides little
# in many windows.
_CLOSE = 0.03


@dataclass(frozen=True, slots=True)
class _Told:
    seqs: int
    memory: float  # the memory knob's value
    result: TrialResult
    chunk: int = 0  # how many times the prefill step had been halved when it was asked


def knee_applies(space: SearchSpace, load: LoadShape | None, axis: MemoryAxis | None) -> bool:
    """Whether the space and the knowledge allow this search: a continuous memory knob whose
    KV bytes are known, a numeric max_num_seqs, and the load's shape."""
    memory = next((k for k in space.knobs if k.name in MEMORY_KNOBS and k.numeric), None)
    return (
        memory is not None
        and not memory.levels
        and SEQS in space.names
        and space.knob(SEQS).numeric
        and load is not None
        and axis is not None
    )


class KneeSuggester:
    """Bisection on the batch at ample memory, then on the memory at the least batch."""

    def __init__(
        self,
        space: SearchSpace,
        *,
        load: LoadShape,
        axis: MemoryAxis,
        deployed: Mapping[str, Value] | None = None,
        seqs_tolerance_ratio: float = 0.1,
        memory_tolerance_ratio: float = 0.03,
        ample_margin_ratio: float = 0.1,
    ) -> None:
        if not knee_applies(space, load, axis):
            raise ValueError("the knee search needs a memory knob and max_num_seqs")
        self._space = space
        self._memory = next(k for k in space.knobs if k.name in MEMORY_KNOBS and k.numeric)
        self._seqs = space.knob(SEQS)
        self._load = load
        self._axis = axis
        self._deployed = dict(deployed or {})
        home = self._deployed.get(self._memory.name)
        self._deployed_memory = (
            _number(home) if home is not None and self._memory.contains(home) else None
        )
        self._seqs_tolerance = seqs_tolerance_ratio
        self._memory_tolerance = memory_tolerance_ratio
        self._ample = (1 + load.error_ratio) * (1 + ample_margin_ratio)
        self._told: list[_Told] = []
        self._asked: set[Candidate] = set()
        self._why: dict[Candidate, str] = {}
        self._told_candidates: set[Candidate] = set()
        self._chunk = 0  # times the prefill step was halved: nothing held at any batch
        self._chunk_of: dict[Candidate, int] = {}

    def tell(self, candidate: Candidate, result: TrialResult) -> None:
        self._told_candidates.add(candidate)
        values = candidate.as_dict()
        seqs, memory = round(_number(values[SEQS])), _number(values[self._memory.name])
        chunk = self._chunk_of.get(candidate, self._chunk)
        self._told.append(_Told(seqs, memory, result, chunk))

    def ask(self) -> Candidate:
        if self._pending():
            raise SearchExhausted("the next probe follows from what the last one shows")
        seqs = self._next_seqs()
        if seqs is not None:
            candidate = self._candidate(seqs, self._memory_for(seqs, self._ample))
            if candidate is not None:
                return self._take(candidate, self._why_batch(seqs))
        best = self._least_held_seqs()
        if best is None:
            raise SearchExhausted("no batch held the SLO below the start limit")
        memory = self._next_memory(best)
        if memory is None:
            raise SearchExhausted(
                f"converged: max_num_seqs {best} and the least memory that held it"
            )
        candidate = self._candidate(best, memory)
        if candidate is None:
            raise SearchExhausted(f"converged: max_num_seqs {best}, nothing untried between")
        why = f"the memory at max_num_seqs {best}, the least batch that held"
        return self._take(candidate, why)

    def explain(self, candidate: Candidate) -> str:
        return self._why.get(candidate, "not asked by this search")

    def _why_batch(self, seqs: int) -> str:
        if not self._told:
            return (
                f"the batch the load needs ({self._load.requests_in_flight:.3g} requests in "
                "flight) at memory that holds it if the planner errs"
            )
        return f"max_num_seqs {seqs} at memory that holds it: bracketing the batch"

    def _pending(self) -> bool:
        """Whether a candidate was asked and its result not told yet."""
        return bool(self._asked - self._told_candidates)

    # --- the batch ---------------------------------------------------------------------

    def _next_seqs(self) -> int | None:
        """The next batch to probe at ample memory, or None once the bracket is closed."""
        probes = self._ample_probes()
        if not probes:
            start = self._snap_seqs(math.ceil(self._load.requests_in_flight))
            return None if self._tried_seqs(start) else start
        held = [t.seqs for t in probes if t.result.feasible]
        if not held:
            return self._toward_best(probes)
        # Below the least batch that held, every miss had too few sequences.
        high = min(held)
        below = [t for t in probes if not t.result.feasible and t.seqs < high]
        if not below:
            return self._untried(math.floor(high / _EXPAND), below=high)
        short = max(below, key=lambda t: t.seqs)
        low = short.seqs
        if high - low <= 1 or high <= low * (1 + self._seqs_tolerance):
            return None
        ratio = self._served_ratio(short)
        if ratio is not None:
            fit = self._batch_fit(below)
            if fit is None:  # one miss: a second one far below it measures the growth
                calibrate = self._untried(math.floor(low / _FIT_SPREAD / _FIT_SPREAD))
                if calibrate is not None:
                    return calibrate
                aimed = math.ceil(low / ratio * (1 + _AIM))
            else:
                aimed = fit.batch_for(_HOLD_MARGIN) or high
            if high / (1 + _CLOSE) <= aimed <= high:
                return None  # the least that held is about what the load needs
            if low < aimed < high and not self._tried_seqs(self._snap_seqs(aimed)):
                return self._snap_seqs(aimed)
        middle = self._snap_seqs(round(math.sqrt(low * high)))
        return self._untried(min(max(middle, low + 1), high - 1), below=high)

    def _batch_fit(self, below: list[_Told]) -> _BatchFit | None:
        """The served share over the batch through the highest miss and the lowest one at
        least `_FIT_SPREAD` below it; None without two such misses."""
        points = sorted((t.seqs, r) for t in below if (r := self._served_ratio(t)) is not None)
        if len(points) < 2 or points[-1][0] < points[0][0] * _FIT_SPREAD:
            return None
        return _BatchFit.through(points[0], points[-1])

    def _toward_best(self, misses: list[_Told]) -> int | None:
        """Nothing held yet: served goodput rises with sequences up to the inter-token limit
        and falls past it, so search around the miss that served most. Downward first: the
        estimate is an upper end of the batch the load needs."""
        best = max(misses, key=lambda t: (_goodput(t), -t.seqs))
        lower = [t.seqs for t in misses if t.seqs < best.seqs]
        higher = [t.seqs for t in misses if t.seqs > best.seqs]
        ratio = self._served_ratio(best)
        near = ratio is not None and ratio >= _NEAR
        at_floor = best.seqs <= self._snap_seqs(1)  # no fewer sequences to try
        if (lower or at_floor) and higher and not near and self._can_halve(best):
            # Fewer (or none fewer) and more sequences both served less and none held: the
            # inter-token limit binds at every batch, where the prefill step stalls the
            # decodes. Halve the step and search the batch again from the best.
            self._chunk += 1
            return best.seqs
        if not lower:
            down = self._untried(math.floor(best.seqs / _EXPAND), below=best.seqs)
            if down is not None or higher:
                return down
        if not higher:
            return self._untried(math.ceil(best.seqs * _EXPAND), above=best.seqs)
        # Between the neighbours: probe the wider side of the best.
        low, high = max(lower, default=best.seqs), min(higher)
        if high / best.seqs >= best.seqs / max(low, 1):
            return self._untried(round(math.sqrt(best.seqs * high)), above=best.seqs, below=high)
        return self._untried(round(math.sqrt(low * best.seqs)), above=low, below=best.seqs)

    def _untried(self, seqs: int, *, above: int = 0, below: int | None = None) -> int | None:
        """`seqs` as the knob takes it, if strictly inside (above, below) and not tried."""
        value = self._snap_seqs(seqs)
        inside = value > above and (below is None or value < below)
        return value if inside and not self._tried_seqs(value) else None

    def _was_ample(self, told: _Told) -> bool:
        """Whether the trial's memory held its batch by the planner's upper end, or was the
        most that starts (just below a known cliff): no more memory could have helped."""
        need = told.seqs * self._load.kv_bytes_per_request * (1 + self._load.error_ratio)
        cliff = self._cliff()
        limit = min(
            (v for v in (self._deployed_memory, cliff and cliff * (1 - _BELOW_CLIFF)) if v),
            default=None,
        )
        at_limit = limit is not None and told.memory >= limit * 0.999
        return at_limit or self._axis.kv_bytes(told.memory) >= need * 0.999

    def _least_held_seqs(self) -> int | None:
        held = [t.seqs for t in self._told if t.result.feasible]
        return min(held, default=None)

    def _tried_seqs(self, seqs: int) -> bool:
        """Whether `seqs` started once at this prefill step (a start that failed is tried
        again below the cliff)."""
        return any(
            t.seqs == seqs and t.result.outcome is not TrialOutcome.FAILED_TO_START
            for t in self._current()
        )

    def _ample_probes(self) -> list[_Told]:
        """The batch's probes at this prefill step: started, at memory that held the batch."""
        return [
            t
            for t in self._current()
            if t.result.outcome is not TrialOutcome.FAILED_TO_START and self._was_ample(t)
        ]

    def _current(self) -> list[_Told]:
        """The trials at the prefill step now searched."""
        return [t for t in self._told if t.chunk == self._chunk]

    def _can_halve(self, told: _Told) -> bool:
        """Whether a smaller prefill step is there to try: the knob is searched and a step
        half as large would stay above vLLM's own default."""
        if BATCHED not in self._space.names or not self._space.knob(BATCHED).numeric:
            return False
        return self._step_tokens(told.seqs) / 2 >= _VLLM_BATCHED_TOKENS

    def _snap_seqs(self, seqs: int) -> int:
        """`seqs` as the knob takes it (at least 1, within its range and levels)."""
        value = self._seqs.from_unit(self._seqs.to_unit(max(1, seqs)))
        return int(value)

    # --- the memory ----------------------------------------------------------------------

    def _next_memory(self, seqs: int) -> float | None:
        """The next KV budget at `seqs`: first the planner's low end (lower while it holds),
        then where the misses put the least that holds (`_memory_aim`), else halfway
        between the highest miss and the least that held."""
        here = [t for t in self._told if t.seqs == seqs]
        held = min(t.memory for t in here if t.result.feasible)
        misses = [
            t
            for t in here
            if t.memory < held and t.result.outcome is not TrialOutcome.FAILED_TO_START
        ]
        floor = self._floor()
        if not misses:  # the planner's low end; held there, further down till a miss
            low = self._memory_for(seqs, 1 - self._load.error_ratio, clamp=False)
            if held <= low * (1 + self._memory_tolerance):
                low = held / _FIT_SPREAD
            if floor is not None and low <= floor * (1 + self._memory_tolerance):
                low = math.sqrt(floor * held)  # vLLM refused less: between that and what held
            return None if held <= low * (1 + self._memory_tolerance) else low
        missed = max(misses, key=lambda t: t.memory)
        if held <= missed.memory * (1 + self._memory_tolerance):
            return None
        ratio = self._served_ratio(missed)
        if ratio is not None:
            aimed = self._memory_aim(seqs, missed, ratio, misses)
            if aimed is not None and aimed >= held / (1 + self._memory_tolerance):
                return None  # what held is where the misses put the least that holds
            if aimed is not None and aimed > missed.memory:
                return aimed
        return math.sqrt(missed.memory * held)

    def _memory_aim(
        self, seqs: int, missed: _Told, ratio: float, misses: list[_Told]
    ) -> float | None:
        """Where the misses put the least memory that holds `seqs` with `_HOLD_MARGIN`:
        capacity below the knee falls as a power of the KV budget, which two misses
        `_FIT_SPREAD` apart measure (None with fewer: one miss's shortfall read with an
        assumed power lands too close to the threshold to be worth its windows). Above the
        knee more memory adds nothing: never past where the batch's own margin (the batch
        fit's) is reached."""
        top = self._axis.kv_bytes(missed.memory)
        points = sorted(
            (kv, r)
            for t in misses
            if (r := self._served_ratio(t)) is not None
            and (kv := self._axis.kv_bytes(t.memory)) > 0
        )
        if len(points) < 2 or points[-1][0] < points[0][0] * _FIT_SPREAD:
            return None
        (k0, r0), (k1, r1) = points[0], points[-1]
        measured = math.log(r1 / r0) / math.log(k1 / k0)
        low, high = _KV_EXPONENT_RANGE
        exponent = min(max(measured, low), high) if math.isfinite(measured) else _KV_EXPONENT
        margin = _HOLD_MARGIN
        batch = self._batch_fit([t for t in self._ample_probes() if not t.result.feasible])
        share = batch.share(seqs) if batch is not None else math.inf
        if share > 1:  # the batch's own margin at ample memory caps what KV can add
            margin = min(margin, math.log(share))
        return self._axis.value_for(top * math.pow(math.exp(margin) / ratio, 1 / exponent))

    def _served_ratio(self, told: _Told) -> float | None:
        """The share of the load a miss served: its goodput over the median of the trials
        that held (the load served in full), or before any held over what the load offers;
        in (0, 1); None when unknown."""
        full = [_goodput(t) for t in self._told if t.result.feasible and _goodput(t) > 0]
        offered = self._load.offered_tokens_per_s
        if (not full and offered is None) or _goodput(told) <= 0:
            return None
        ratio = _goodput(told) / (statistics.median(full) if full else offered or 1.0)
        return ratio if 0 < ratio < 1 else None

    def _memory_for(self, seqs: int, factor: float, *, clamp: bool = True) -> float:
        """The memory knob's value that gives `seqs` sequences `factor` times the planner's
        KV bytes each, kept below a known cliff and above a known floor."""
        value = self._axis.value_for(seqs * self._load.kv_bytes_per_request * factor)
        if not clamp:
            return value
        if self._deployed_memory is not None:  # it starts: the stable side runs with it
            value = min(value, self._deployed_memory)
        cliff = self._cliff()
        if cliff is not None:
            value = min(value, cliff * (1 - _BELOW_CLIFF))
        floor = self._floor()
        if floor is not None:
            value = max(value, floor * (1 + self._memory_tolerance))
        return value

    def _cliff(self) -> float | None:
        """The least memory that failed to start for want of memory."""
        cliffs = [
            t.memory
            for t in self._told
            if t.result.outcome in (TrialOutcome.FAILED_TO_START, TrialOutcome.CRASHED)
            and _failure_kind(t.result) not in (*_FLOOR_KINDS, StartupFailureKind.INVALID_FLAGS)
        ]
        return min(cliffs, default=None)

    def _floor(self) -> float | None:
        floors = [
            t.memory
            for t in self._told
            if t.result.outcome is TrialOutcome.FAILED_TO_START
            and _failure_kind(t.result) in _FLOOR_KINDS
        ]
        return max(floors, default=None)

    # --- candidates ----------------------------------------------------------------------

    def _candidate(self, seqs: int, memory: float) -> Candidate | None:
        """The candidate at `seqs` and `memory`, the other knobs at their deployed values
        (batched tokens by the prompt); None when it is invalid or already asked."""
        values: dict[str, Value] = {}
        for knob in self._space.knobs:
            if knob.name == self._memory.name:
                values[knob.name] = _snap(knob, memory)
            elif knob.name == SEQS:
                values[knob.name] = seqs
            elif knob.name == BATCHED and knob.numeric:
                values[knob.name] = self._batched_tokens(knob, seqs)
            else:
                values[knob.name] = self._home(knob)
        candidate = Candidate(tuple((n, values[n]) for n in self._space.names))
        if candidate in self._asked or self._space.violation(candidate) is not None:
            return None
        return candidate

    def _batched_tokens(self, knob: Knob, seqs: int) -> Value:
        """A step that prefills two mean prompts (arrivals come in bursts) beside a decode
        token of every running sequence, and no less than vLLM's own default."""
        return _snap(knob, max(self._step_tokens(seqs), float(seqs)))

    def _step_tokens(self, seqs: int) -> float:
        """Two mean prompts and a token of every sequence, halved as often as the step
        stalled every batch, never below vLLM's own default."""
        wanted = (2 * self._load.prompt_tokens + seqs) / math.pow(2, self._chunk)
        return max(wanted, float(_VLLM_BATCHED_TOKENS))

    def _home(self, knob: Knob) -> Value:
        value = self._deployed.get(knob.name)
        return value if value is not None and knob.contains(value) else knob.from_unit(0.5)

    def _take(self, candidate: Candidate, why: str) -> Candidate:
        self._asked.add(candidate)
        self._chunk_of[candidate] = self._chunk
        self._why[candidate] = why
        return candidate


@dataclass(frozen=True, slots=True)
class _BatchFit:
    """The load's served share at ample memory as the batch grows: each decode step reads
    the weights once and every running sequence's KV, so the inter-token gap grows about
    linearly with the batch and the share with batch / (a + b * batch): 1 / share is linear
    in 1 / batch."""

    a: float
    b: float

    @classmethod
    def through(cls, low: tuple[float, float], high: tuple[float, float]) -> _BatchFit:
        (s0, r0), (s1, r1) = low, high
        a = (1 / r0 - 1 / r1) / (1 / s0 - 1 / s1)
        return cls(a, 1 / r1 - a / s1)

    def share(self, batch: float) -> float:
        denominator = self.a / batch + self.b
        return 1 / denominator if denominator > 0 else math.inf

    def batch_for(self, margin: float) -> int | None:
        """The least batch whose share reaches exp(margin); None where none does."""
        room = math.exp(-margin) - self.b
        if self.a <= 0 or room <= 0:
            return None
        return math.ceil(self.a / room)


def _snap(knob: Knob, value: float) -> Value:
    """`value` as the knob takes it (its type, rounding and range)."""
    low, high = float(knob.low or 0.0), float(knob.high or 0.0)
    return knob.from_unit(knob.to_unit(min(max(value, low), high)))


def _number(value: Value) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"a numeric knob's value, not {value!r}")
    return float(value)


def _goodput(told: _Told) -> float:
    return told.result.goodput_tokens_per_s or 0.0


def _failure_kind(result: TrialResult) -> StartupFailureKind | None:
    failure = result.startup_failure
    return failure.kind if failure is not None else None
