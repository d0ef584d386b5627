"""Bayesian optimisation with scikit-optimize's Gaussian process, and a feasibility model.

The optimiser is told only feasible trials (their goodput). Every trial teaches a feasibility
model (a Gaussian process on feasible/infeasible labels, capped by a logistic trend) where
vLLM fails to start, crashes or breaks the SLO; the acquisition is expected improvement
times the probability of being feasible, evaluated on a pool of untried candidates that
meet the constraints. No made-up value is ever told.

The goodput model's prior mean is a trend along the memory knob that may rise but never
fall: at equal other flags a larger KV budget holds more sequences with fewer preemptions,
so goodput does not drop as it grows (the price of memory is the planner's and the
feasibility model's business, and ties go to less memory). The trend is fitted to the
trials; the Gaussian process models what it leaves. Without it the GP's mean reverts to the
trials' average away from them, and expected improvement spends trials on every uncertain
edge before the memory bound, where the best configuration usually lies.

The first points (one more than the knobs: enough to fit the trend) come from the
planner's safe region (the memory knob pulled away from both bounds), stratified over every
knob. numpy, scikit-learn and scikit-optimize are imported when a model is first needed,
never at import time.
"""

from __future__ import annotations

import math
import random
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvpilot.tuner.problem.objective import TrialResult
from kvpilot.tuner.problem.space import MEMORY_KNOBS, Candidate, SearchSpace
from kvpilot.tuner.suggest.base import SearchExhausted, objective_value

Point = tuple[float, ...]


class BayesianSuggester:
    """GP expected improvement times the probability of feasibility, over the unit cube."""

    def __init__(
        self,
        space: SearchSpace,
        seed: int = 0,
        *,
        n_initial_points: int | None = None,
        safe_margin_ratio: float = 0.15,
        pool_size: int = 2000,
        max_enumerated: int = 4096,
        xi: float = 0.01,
    ) -> None:
        self._space = space
        self._seed = seed
        self._rng = random.Random(seed)
        self._n_initial = n_initial_points or len(space.knobs) + 1
        self._memory_axis = next(
            (i for i, knob in enumerate(space.knobs) if knob.name in MEMORY_KNOBS), None
        )
        self._initial = space.safe_region(safe_margin_ratio).latin_hypercube(
            self._n_initial, self._rng
        )
        self._pool_size = pool_size
        self._max_enumerated = max_enumerated
        self._xi = xi
        self._observed: list[tuple[Point, float | None]] = []
        self._seen: set[Candidate] = set()

    def tell(self, candidate: Candidate, result: TrialResult) -> None:
        self._seen.add(candidate)
        self._observed.append((self._space.to_unit(candidate), objective_value(result)))

    def ask(self) -> Candidate:
        while self._initial and len(self._observed) < self._n_initial:
            candidate = self._initial.pop(0)
            if candidate not in self._seen and self._space.violation(candidate) is None:
                self._seen.add(candidate)
                return candidate
        pool = self._pool()
        if not pool:
            raise SearchExhausted("no untried candidate meets the constraints")
        scores = self._scores([self._space.to_unit(c) for c in pool])
        best = max(range(len(pool)), key=lambda i: (scores[i], -i))
        self._seen.add(pool[best])
        return pool[best]

    # --- the pool of candidates the acquisition chooses from ---------------------------

    def _pool(self) -> list[Candidate]:
        finite = self._finite_size()
        if finite is not None and finite <= self._max_enumerated:
            raw = self._space.grid(points_per_knob=1)
        else:
            raw = [self._space.from_unit(p) for p in self._random_points()]
        pool = []
        seen = set(self._seen)
        for candidate in raw:
            if candidate not in seen and self._space.violation(candidate) is None:
                seen.add(candidate)
                pool.append(candidate)
        return pool

    def _finite_size(self) -> int | None:
        size = 1
        for knob in self._space.knobs:
            if knob.numeric and not knob.levels:
                return None
            size *= len(knob.levels) if knob.numeric else len(knob.choices)
        return size

    def _random_points(self) -> list[Point]:
        dims = len(self._space.knobs)
        points = [tuple(self._rng.random() for _ in range(dims)) for _ in range(self._pool_size)]
        # Half as many again near the best feasible points: refinement, not only exploration.
        feasible = [(x, y) for x, y in self._observed if y is not None]
        ranked = sorted(feasible, key=lambda p: -p[1])
        for centre, _ in ranked[:3]:
            for _ in range(self._pool_size // 6):
                points.append(tuple(min(1.0, max(0.0, self._rng.gauss(c, 0.05))) for c in centre))
        return points

    # --- the acquisition --------------------------------------------------------------

    def _scores(self, units: Sequence[Point]) -> list[float]:
        feasible_prob = self._feasibility(units)
        distance = [self._nearest_distance(u) for u in units]
        feasible = [(x, y) for x, y in self._observed if y is not None]
        if len(feasible) >= 2:
            improvement = self._expected_improvement(units, feasible)
            scores = [ei * p for ei, p in zip(improvement, feasible_prob, strict=True)]
            if max(scores) > 0:
                return scores
        # Too little to model, or nothing left to gain by EI: explore where it likely starts.
        return [p * d for p, d in zip(feasible_prob, distance, strict=True)]

    def _expected_improvement(
        self, units: Sequence[Point], feasible: Sequence[tuple[Point, float]]
    ) -> list[float]:
        import numpy as np
        from skopt import Optimizer
        from skopt.acquisition import gaussian_ei

        optimizer = Optimizer(
            [(0.0, 1.0)] * len(self._space.knobs),
            base_estimator="GP",
            n_initial_points=1,
            acq_optimizer="sampling",
            acq_optimizer_kwargs={"n_points": 64},
            random_state=self._seed,
        )
        xs = np.asarray(optimizer.space.transform([list(x) for x, _ in feasible]))
        ys = np.asarray([-y for _, y in feasible])  # skopt minimises
        trend = MemoryTrend.fit(xs, ys, self._memory_axis)
        optimizer.tell(xs.tolist(), (ys - trend.at(xs)).tolist())
        model = _Trended(optimizer.models[-1], trend)
        grid = np.asarray(optimizer.space.transform([list(u) for u in units]))
        return [float(v) for v in gaussian_ei(grid, model, y_opt=float(ys.min()), xi=self._xi)]

    def _feasibility(self, units: Sequence[Point]) -> list[float]:
        labels = [y is not None for _, y in self._observed]
        if not labels or all(labels):
            return [1.0] * len(units)
        if not any(labels):
            return [1.0] * len(units)  # nothing feasible yet: distance alone steers away
        import numpy as np
        from scipy.stats import norm
        from sklearn.exceptions import ConvergenceWarning
        from sklearn.gaussian_process import GaussianProcessRegressor
        from sklearn.gaussian_process.kernels import ConstantKernel, Matern, WhiteKernel
        from sklearn.linear_model import LogisticRegression

        # A GP on +1 (feasible) / -1 (infeasible) labels with a zero prior mean: far from any
        # trial the probability is 1/2, next to a failed one it falls towards 0. (A Laplace
        # GP classifier stays near 1/2 everywhere with this few points.)
        dims = len(self._space.knobs)
        matern = Matern([0.3] * dims, (0.05, 10.0), nu=2.5)  # one length scale per knob
        kernel = ConstantKernel(1.0, "fixed") * matern + WhiteKernel(0.01, (1e-4, 0.1))
        model = GaussianProcessRegressor(kernel=kernel, random_state=self._seed)
        xs = np.asarray([x for x, _ in self._observed])
        ys = np.asarray([1.0 if label else -1.0 for label in labels])
        with warnings.catch_warnings():
            # A handful of separable points can drive a length scale to its bound; fine.
            warnings.simplefilter("ignore", ConvergenceWarning)
            model.fit(xs, ys)
        grid = np.asarray(units)
        mean, std = model.predict(grid, return_std=True)
        local = norm.cdf(mean / np.maximum(std, 1e-9))
        # The GP is local: half-way between trials it says 1/2. A logistic trend on each knob
        # and its square learns a cliff (or a band) along a knob from a few failures, and
        # keeps the search from testing the same cliff at every other knob's value.
        trend = LogisticRegression(C=10.0).fit(np.hstack([xs, xs**2]), labels)
        column = list(trend.classes_).index(True)
        global_ = trend.predict_proba(np.hstack([grid, grid**2]))[:, column]
        return [float(p) for p in np.minimum(local, global_)]

    def _nearest_distance(self, unit: Point) -> float:
        if not self._observed:
            return 1.0
        return min(math.dist(unit, x) for x, _ in self._observed)


@dataclass(frozen=True, slots=True)
class MemoryTrend:
    """The prior mean of the minimised objective (-goodput): a line along the memory knob
    that never rises, so goodput may grow with the KV budget but is never assumed to fall."""

    intercept: float
    slope: float  # <= 0
    axis: int | None

    @classmethod
    def fit(cls, xs: Any, ys: Any, axis: int | None) -> MemoryTrend:
        """Least squares on the memory coordinate; a rising fit (goodput falling) is flat."""
        import numpy as np

        if axis is None or len(ys) < 2 or float(np.ptp(xs[:, axis])) == 0.0:
            return cls(float(np.mean(ys)), 0.0, None)
        slope = min(0.0, float(np.polyfit(xs[:, axis], ys, 1)[0]))
        return cls(float(np.mean(ys - slope * xs[:, axis])), slope, axis)

    def at(self, xs: Any) -> Any:
        import numpy as np

        if self.axis is None:
            return np.full(len(xs), self.intercept)
        return self.intercept + self.slope * xs[:, self.axis]


@dataclass(frozen=True, slots=True)
class _Trended:
    """The GP fitted to what the trend leaves, plus the trend: the model `gaussian_ei` asks."""

    residual_model: Any
    trend: MemoryTrend

    def predict(self, xs: Any, return_std: bool = False) -> Any:
        if not return_std:
            return self.residual_model.predict(xs) + self.trend.at(xs)
        mean, std = self.residual_model.predict(xs, return_std=True)
        return mean + self.trend.at(xs), std
