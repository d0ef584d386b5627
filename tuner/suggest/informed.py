"""A suggester that uses what kvpilot knows about vLLM instead of a generic model.

The product's objective is the least memory that holds the SLO at the learned load: a
plateau with a feasibility cliff. Along the memory knob (other flags equal) more KV never
hurts until the start limit, so the least memory that holds is a threshold, found by
BISECTION between the highest budget that missed the SLO and the lowest that held it, until
the two are `tolerance_ratio` apart. Around that:

* the first ask is the stable server's KV high-water mark plus a margin when it has been
  observed, else the planner's need at the top of its error band, else the deployed budget;
* a failed start marks the cliff: nothing at or above it is asked while the search is
  structured (only a last-resort walk of what is left may ask at it, never above). A start
  refused for too little memory marks a floor likewise;
* an SLO miss marks the floor of the bracket, unless memory was not the cause: the server's
  observation shows no preemptions and a high-water mark well below its budget, or a miss
  at more memory served no more goodput than one at less. Then more memory cannot help at
  that max_num_seqs, and the search moves on;
* a feasible trial's high-water mark (without preemptions) is the next probe when it lies
  inside the bracket: one trial instead of several halvings;
* a trust region around the deployed memory: no probe goes more than `trust_radius` (in the
  knob's unit scale) below it, and the radius doubles with every feasible trial.

max_num_seqs is searched after memory, on a log ladder of factor 2 from the deployed value
(lower first), each rung probing only for a saving below the least memory found so far (its
first probe `seqs_saving_ratio` below it; on a hold the rung is bisected like the first):
with a load of fixed rate the KV in use follows the requests in flight, which max_num_seqs
only caps, so it moves the threshold less than memory does, and a joint model would spend
the few trials there are on a knob that matters second. A direction stops at its first rung
that saves nothing. When no memory holds at the deployed value (an inter-token SLO that a
large batch breaks, or queueing that a small cap causes), the ladder's rungs are full
searches instead. Other knobs stay at their deployed values. When the structured search is
done, the untried candidates are walked nearest the best first.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvpilot.tuner.problem.constraints import Value
from kvpilot.tuner.problem.objective import TrialOutcome, TrialResult
from kvpilot.tuner.problem.space import MEMORY_KNOBS, Candidate, Knob, SearchSpace
from kvpilot.tuner.problem.startup_errors import StartupFailureKind
from kvpilot.tuner.suggest.base import SearchExhausted, ServerObservation
from kvpilot.tuner.suggest.prior import KvPrior, MemoryAxis

SEQS = "max_num_seqs"
_FLOOR_KINDS = (StartupFailureKind.CACHE_TOO_SMALL, StartupFailureKind.NO_CACHE_MEMORY)
_MISSES = (
    TrialOutcome.SLO_BROKEN,
    TrialOutcome.PREEMPTED,
    TrialOutcome.REQUESTS_FAILED,
    TrialOutcome.NO_DATA,
)
_NO_PRIOR_WIDTH = 0.25  # the bracket's width in unit scale when the planner gave no prior
_INSIDE_POINTS = 32  # how finely a continuous bracket is searched for an untried point
_FALLBACK_POOL = 256
_MEMORY_BLIND_USE_RATIO = 0.9  # a miss under this share of the budget in use: not memory
_FLAT_GOODPUT_RATIO = 1.02  # misses whose goodput gains less than this with more memory


@dataclass(frozen=True, slots=True)
class ScreeningHint:
    """Whether a candidate is worth a short screen before its judged windows.

    A screen may only reject: a candidate that passes it still needs the judged windows.
    """

    screen: bool
    windows: int
    reason: str


@dataclass(frozen=True, slots=True)
class _Told:
    candidate: Candidate
    memory_u: float
    rest: tuple[Value, ...]  # the other knobs' values, in the space's order
    result: TrialResult


@dataclass(frozen=True, slots=True)
class _Bracket:
    """What is known along the memory axis at one setting of the other knobs."""

    lowest_held_u: float | None
    highest_missed_u: float | None
    misses: int
    memory_blind: bool


class InformedSuggester:
    """Bisection on the memory knob with a planner prior, a learned cliff and a trust region."""

    def __init__(
        self,
        space: SearchSpace,
        seed: int = 0,
        *,
        prior: KvPrior | None = None,
        deployed: Mapping[str, Value] | None = None,
        axis: MemoryAxis | None = None,
        tolerance_ratio: float = 0.03,
        trust_radius: float = 0.15,
        high_water_margin_ratio: float = 0.1,
        seqs_saving_ratio: float = 0.15,
        screening_windows: int = 4,
    ) -> None:
        self._space = space
        self._rng = random.Random(seed)
        self._memory = next((k for k in space.knobs if k.name in MEMORY_KNOBS and k.numeric), None)
        self._axis = axis
        if axis is None and self._memory is not None and self._memory.name in MEMORY_KNOBS[1:]:
            self._axis = MemoryAxis.identity()  # --kv-cache-memory-bytes is KV bytes
        self._prior = prior
        self._tolerance = tolerance_ratio
        self._trust_radius = trust_radius
        self._margin = high_water_margin_ratio
        self._saving = seqs_saving_ratio
        self._screening_windows = screening_windows
        self._home = self._home_values(deployed or {})
        deployed_memory = (deployed or {}).get(self._memory.name) if self._memory else None
        self._deployed_u = (
            self._memory.to_unit(deployed_memory)
            if self._memory is not None
            and deployed_memory is not None
            and self._memory.contains(deployed_memory)
            else None
        )
        self._told: list[_Told] = []
        self._seen: set[Candidate] = set()
        self._observations: dict[Candidate, ServerObservation] = {}

    # --- ask/tell, and the observation extension -----------------------------------------

    def tell(self, candidate: Candidate, result: TrialResult) -> None:
        self._seen.add(candidate)
        if self._memory is not None:
            self._told.append(_Told(candidate, self._mu(candidate), self._rest(candidate), result))

    def observe(self, candidate: Candidate, observation: ServerObservation) -> None:
        self._observations[candidate] = observation

    def ask(self) -> Candidate:
        candidate = self._structured() if self._memory is not None else None
        if candidate is None:
            candidate = self._walk_rest()
        self._seen.add(candidate)
        return candidate

    def screening_hint(self, candidate: Candidate) -> ScreeningHint:
        """Screen a candidate below the least memory known to hold at its other flags: it
        is the likeliest to miss, and a short screen rejects it before the judged windows."""
        if self._memory is None:
            return ScreeningHint(False, 0, "no memory knob: nothing is a saving probe")
        held = self._bracket(self._rest(candidate)).lowest_held_u
        if held is not None and self._mu(candidate) < held:
            return ScreeningHint(
                True, self._screening_windows, "below the least memory known to hold the SLO"
            )
        return ScreeningHint(False, 0, "not below any memory known to hold the SLO")

    # --- the structured search ----------------------------------------------------------

    def _structured(self) -> Candidate | None:
        floor_u, cliff_u = self._limits()
        home_rest = self._rest_of(self._home)
        abandoned: set[int] = set()
        for direction, rest in self._ladder():
            if direction in abandoned:
                continue
            best_other = self._lowest_held(exclude=rest)
            full = rest == home_rest or best_other is None
            candidate = self._probe(rest, full, best_other, floor_u, cliff_u)
            if candidate is not None:
                return candidate
            held = self._bracket(rest).lowest_held_u
            if rest != home_rest and (held is None or best_other is None or held >= best_other):
                abandoned.add(direction)  # this rung saved nothing: the next one further won't
        return None

    def _probe(
        self,
        rest: tuple[Value, ...],
        full: bool,
        best_other: float | None,
        floor_u: float,
        cliff_u: float,
    ) -> Candidate | None:
        bracket = self._bracket(rest)
        top = min(1.0, cliff_u)
        held, missed = bracket.lowest_held_u, bracket.highest_missed_u
        if held is None:
            if bracket.memory_blind or (missed is not None and not full):
                return None  # more memory cannot help here, or this rung saves nothing
            if missed is None:
                if full:
                    start = self._start_u()
                else:  # a rung of the max_num_seqs ladder: does it save a little?
                    best = best_other if best_other is not None else top
                    start = self._knob_memory().to_unit(self._raw(best) * (1 - self._saving))
                    top = min(top, best)
                start = min(max(start, floor_u, self._trust_floor()), top)
                return self._near(rest, start, max(floor_u, -1e-9), top, upper_open=cliff_u <= 1.0)
            # Every try missed: step up, doubling; with a known cliff, at most half-way to it.
            cliff_known = cliff_u <= 1.0
            if cliff_known and self._close(missed, top):
                return None  # nothing between the miss and the cliff: not at these flags
            target = missed + self._width() * 2 ** (bracket.misses - 1)
            if cliff_known:
                target = min(target, (missed + top) / 2)
            return self._near(rest, min(target, top), missed, top, upper_open=cliff_known)
        hard_low = max(floor_u, missed if missed is not None else -1.0)
        low = missed if missed is not None else self._soft_low(held, floor_u)
        if self._close(low, held):
            if missed is not None:
                return None  # converged: `held` is within tolerance of a miss
            low = max(floor_u, 0.0, held - self._width(), self._trust_floor())
            if self._close(low, held):
                return None
        target = (low + held) / 2
        jump = self._high_water_u(rest, held)
        if jump is not None and max(hard_low, self._trust_floor()) < jump < held:
            target, low = jump, min(low, jump)  # measured: it may go below the prior's band
        return self._near(rest, target, max(hard_low, low - 1e-9), held, upper_open=True)

    def _near(
        self,
        rest: tuple[Value, ...],
        target_u: float,
        low_u: float,
        high_u: float,
        upper_open: bool,
    ) -> Candidate | None:
        """The untried valid candidate at `rest` nearest `target_u` inside (low, high)."""
        memory = self._knob_memory()
        if memory.levels:
            units = [memory.to_unit(v) for v in memory.levels]
        else:
            units = [target_u] + [
                low_u + (high_u - low_u) * i / _INSIDE_POINTS for i in range(1, _INSIDE_POINTS)
            ]
        units.sort(key=lambda u: (abs(u - target_u), u))
        for u in units:
            candidate = self._at(rest, memory.from_unit(u))
            mu = self._mu(candidate)
            inside = low_u < mu and (mu < high_u if upper_open else mu <= high_u)
            if inside and candidate not in self._seen and self._space.violation(candidate) is None:
                return candidate
        return None

    # --- what the history says ----------------------------------------------------------

    def _limits(self) -> tuple[float, float]:
        """The floor (a start refused for too little memory) and the cliff (any other
        failed start, or a crash), in unit scale; -1 and 2 where none is known."""
        floor_u, cliff_u = -1.0, 2.0
        for told in self._told:
            outcome = told.result.outcome
            failure = told.result.startup_failure
            kind = failure.kind if failure is not None else None
            if outcome is TrialOutcome.FAILED_TO_START and kind in _FLOOR_KINDS:
                floor_u = max(floor_u, told.memory_u)
            elif (
                outcome is TrialOutcome.FAILED_TO_START and kind is StartupFailureKind.INVALID_FLAGS
            ):
                continue  # says nothing about memory
            elif outcome in (TrialOutcome.FAILED_TO_START, TrialOutcome.CRASHED):
                cliff_u = min(cliff_u, told.memory_u)
        return floor_u, cliff_u

    def _bracket(self, rest: tuple[Value, ...]) -> _Bracket:
        here = [t for t in self._told if t.rest == rest]
        held = [t.memory_u for t in here if t.result.feasible]
        lowest = min(held) if held else None
        missed = [t for t in here if t.result.outcome in _MISSES]
        # A miss above a budget that held is noise against monotonicity: the hold wins.
        below = [t for t in missed if lowest is None or t.memory_u < lowest]
        return _Bracket(
            lowest_held_u=lowest,
            highest_missed_u=max((t.memory_u for t in below), default=None),
            misses=len(below),
            memory_blind=any(self._memory_blind(t) for t in below) or _flat(below),
        )

    def _lowest_held(self, exclude: tuple[Value, ...]) -> float | None:
        held = [t.memory_u for t in self._told if t.result.feasible and t.rest != exclude]
        return min(held) if held else None

    def _memory_blind(self, told: _Told) -> bool:
        """A miss whose server preempted nothing and never filled its KV budget."""
        observation = self._observations.get(told.candidate)
        if observation is None or self._axis is None:
            return False
        high_water = observation.kv_high_water_bytes
        budget = self._axis.kv_bytes(float(told.candidate[self._knob_memory().name]))
        return (
            observation.preemptions_per_request == 0
            and high_water is not None
            and high_water < _MEMORY_BLIND_USE_RATIO * budget
        )

    def _high_water_u(self, rest: tuple[Value, ...], held_u: float) -> float | None:
        """The budget a preemption-free trial at `rest` showed it needs, plus the margin."""
        best: float | None = None
        for told in self._told:
            if told.rest != rest or not told.result.feasible or told.memory_u > held_u + 1e-12:
                continue
            observation = self._observations.get(told.candidate)
            u = self._observed_need_u(observation)
            if u is not None and (best is None or u < best):
                best = u
        return best

    def _observed_need_u(self, observation: ServerObservation | None) -> float | None:
        if observation is None or self._axis is None or observation.kv_high_water_bytes is None:
            return None
        if (observation.preemptions_per_request or 0.0) > 0:
            return None  # it was short of memory: its high-water mark is no bound
        return self._u_of_bytes(observation.kv_high_water_bytes * (1 + self._margin))

    def _start_u(self) -> float:
        """The first probe: the stable's high-water mark, the prior's top, or the deployed."""
        observed = [self._observed_need_u(o) for o in self._observations.values()]
        known = [u for u in observed if u is not None]
        if known:
            start = max(known)
        elif self._prior is not None and self._axis is not None:
            start = self._u_of_bytes(self._prior.high_bytes)
        elif self._deployed_u is not None:
            start = self._deployed_u
        else:
            start = 0.5
        return max(start, self._trust_floor())

    def _soft_low(self, held_u: float, floor_u: float) -> float:
        """The bracket's low end before any miss: the prior's low, or a width below."""
        if self._prior is not None and self._axis is not None:
            low = self._u_of_bytes(self._prior.low_bytes)
        else:
            low = held_u - self._width()
        return max(low, floor_u, 0.0, self._trust_floor())

    def _trust_floor(self) -> float:
        if self._deployed_u is None:
            return -1.0
        successes = sum(1 for t in self._told if t.result.feasible)
        return self._deployed_u - self._trust_radius * float(2**successes)

    def _width(self) -> float:
        if self._prior is None or self._axis is None:
            return _NO_PRIOR_WIDTH
        width = self._u_of_bytes(self._prior.high_bytes) - self._u_of_bytes(self._prior.low_bytes)
        return max(width, 1e-3)

    def _close(self, low_u: float, high_u: float) -> bool:
        """Whether the bracket is within the tolerance, in the knob's own values."""
        low, high = self._raw(max(low_u, 0.0)), self._raw(min(high_u, 1.0))
        return high <= low * (1 + self._tolerance) or high_u - low_u <= 1e-6

    # --- max_num_seqs and the other knobs ----------------------------------------------

    def _ladder(self) -> list[tuple[int, tuple[Value, ...]]]:
        """(direction, other knobs' values): the deployed max_num_seqs, then factors of two
        below and above it, alternating, lower first."""
        home = self._rest_of(self._home)
        if SEQS not in self._space.names or not self._space.knob(SEQS).numeric:
            return [(0, home)]
        knob = self._space.knob(SEQS)
        start = float(self._home[SEQS])
        below = self._rungs(knob, start, 0.5)
        above = self._rungs(knob, start, 2.0)
        out: list[tuple[int, tuple[Value, ...]]] = [(0, home)]
        for i in range(max(len(below), len(above))):
            for direction, rungs in ((-1, below), (1, above)):
                if i < len(rungs):
                    out.append((direction, self._rest_of({**self._home, SEQS: rungs[i]})))
        return out

    @staticmethod
    def _rungs(knob: Knob, start: float, factor: float) -> list[Value]:
        out: list[Value] = []
        if knob.levels:  # each level is a rung: the levels are the user's own ladder
            ordered = sorted(knob.levels, reverse=factor < 1)
            beyond = [v for v in ordered if (v < start if factor < 1 else v > start)]
            return [knob.from_unit(knob.to_unit(v)) for v in beyond]
        value = start
        while True:
            value *= factor
            if knob.low is None or knob.high is None or not knob.low <= value <= knob.high:
                return out
            typed = knob.from_unit(knob.to_unit(value))
            if typed not in out and typed != start:
                out.append(typed)

    def _home_values(self, deployed: Mapping[str, Value]) -> dict[str, Value]:
        home: dict[str, Value] = {}
        for knob in self._space.knobs:
            value = deployed.get(knob.name)
            home[knob.name] = (
                value if value is not None and knob.contains(value) else (knob.from_unit(0.5))
            )
        return home

    def _rest_of(self, values: Mapping[str, Value]) -> tuple[Value, ...]:
        memory = self._memory.name if self._memory is not None else None
        return tuple(values[n] for n in self._space.names if n != memory)

    def _rest(self, candidate: Candidate) -> tuple[Value, ...]:
        return self._rest_of(candidate.as_dict())

    def _at(self, rest: tuple[Value, ...], memory_value: Value) -> Candidate:
        memory = self._knob_memory().name
        others = iter(rest)
        values = {n: memory_value if n == memory else next(others) for n in self._space.names}
        return Candidate(tuple((n, values[n]) for n in self._space.names))

    # --- the memory knob's scale ---------------------------------------------------------

    def _knob_memory(self) -> Knob:
        if self._memory is None:
            raise ValueError("the space has no memory knob")
        return self._memory

    def _mu(self, candidate: Candidate) -> float:
        memory = self._knob_memory()
        return memory.to_unit(candidate[memory.name])

    def _u_of_bytes(self, kv_bytes: float) -> float:
        memory = self._knob_memory()
        if self._axis is None or memory.low is None or memory.high is None:
            return 0.5
        value = min(max(self._axis.value_for(kv_bytes), memory.low), memory.high)
        return memory.to_unit(value)

    def _raw(self, u: float) -> float:
        """The knob's value at u, unsnapped (levels ignored)."""
        memory = self._knob_memory()
        low, high = float(memory.low or 0.0), float(memory.high or 0.0)
        if memory.log_scale:
            return math.exp(math.log(low) + u * (math.log(high) - math.log(low)))
        return low + u * (high - low)

    # --- when the structure has nothing left ---------------------------------------------

    def _walk_rest(self) -> Candidate:
        """Untried valid candidates below the floor's and at most at the cliff's memory,
        nearest the best so far (or home) first."""
        floor_u, cliff_u = self._limits() if self._memory is not None else (-1.0, 2.0)
        pool = self._pool()
        anchor = self._anchor()
        allowed = []
        for candidate in dict.fromkeys(pool):
            if candidate in self._seen or self._space.violation(candidate) is not None:
                continue
            if self._memory is not None and not floor_u < self._mu(candidate) <= cliff_u:
                continue
            allowed.append(candidate)
        if not allowed:
            raise SearchExhausted("no untried candidate meets the constraints below the cliff")
        return min(allowed, key=lambda c: (math.dist(self._space.to_unit(c), anchor), str(c)))

    def _pool(self) -> list[Candidate]:
        size = 1
        for knob in self._space.knobs:
            if knob.numeric and not knob.levels:
                size = -1
                break
            size *= len(knob.levels) if knob.numeric else len(knob.choices)
        if 0 < size <= 4096:
            return self._space.grid(points_per_knob=1)
        dims = len(self._space.knobs)
        points = [[self._rng.random() for _ in range(dims)] for _ in range(_FALLBACK_POOL)]
        return [self._space.from_unit(p) for p in points]

    def _anchor(self) -> Sequence[float]:
        held = [t for t in self._told if t.result.feasible]
        if held:
            return self._space.to_unit(min(held, key=lambda t: t.memory_u).candidate)
        return self._space.to_unit(Candidate(tuple((n, self._home[n]) for n in self._space.names)))


def _flat(misses: Sequence[_Told]) -> bool:
    """Whether more memory bought no goodput between two misses: memory is not what binds
    (more KV lets vLLM run a larger batch, which shows as goodput where memory is short)."""
    ordered = sorted(
        (t for t in misses if t.result.goodput_tokens_per_s is not None), key=lambda t: t.memory_u
    )
    for less, more in itertools.pairwise(ordered):
        gained = more.result.goodput_tokens_per_s or 0.0
        if more.memory_u > less.memory_u and gained <= (
            (less.result.goodput_tokens_per_s or 0.0) * _FLAT_GOODPUT_RATIO
        ):
            return True
    return False
