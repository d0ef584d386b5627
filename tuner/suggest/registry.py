"""Suggesters by name: what the tuning config's `suggester` choice and the benchmarks pick.

Every factory takes the space, a seed and what the caller knows (the planner's prior, the
deployed flags, the memory axis, the load's shape); suggesters that use none of it ignore it.
`informed` searches the batch first, then the memory (`KneeSuggester`) where it knows the
load's shape and the memory knob's KV bytes and the space has max_num_seqs; otherwise it
bisects the memory at the deployed flags (`InformedSuggester`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from kvpilot.tuner.problem.constraints import Value
from kvpilot.tuner.problem.space import SearchSpace
from kvpilot.tuner.suggest.base import Suggester
from kvpilot.tuner.suggest.bayes import BayesianSuggester
from kvpilot.tuner.suggest.grid import GridSuggester
from kvpilot.tuner.suggest.informed import InformedSuggester
from kvpilot.tuner.suggest.knee import KneeSuggester, knee_applies
from kvpilot.tuner.suggest.prior import KvPrior, LoadShape, MemoryAxis
from kvpilot.tuner.suggest.random_search import RandomSuggester


@dataclass(frozen=True, slots=True)
class Knowledge:
    """What the caller knows before the first trial; every field may be unknown."""

    prior: KvPrior | None = None
    deployed: Mapping[str, Value] = field(default_factory=dict)
    axis: MemoryAxis | None = None
    load: LoadShape | None = None


SuggesterFactory = Callable[[SearchSpace, int, Knowledge], Suggester]


def _informed(space: SearchSpace, seed: int, known: Knowledge) -> Suggester:
    if (
        known.load is not None
        and known.axis is not None
        and knee_applies(space, known.load, known.axis)
    ):
        return KneeSuggester(space, load=known.load, axis=known.axis, deployed=known.deployed)
    return InformedSuggester(
        space, seed, prior=known.prior, deployed=known.deployed, axis=known.axis
    )


SUGGESTERS: Mapping[str, SuggesterFactory] = {
    "bayes": lambda space, seed, _known: BayesianSuggester(space, seed=seed),
    "informed": _informed,
    "random": lambda space, seed, _known: RandomSuggester(space, seed=seed),
    "grid": lambda space, _seed, _known: GridSuggester(space),
}


def make_suggester(
    name: str, space: SearchSpace, seed: int = 0, known: Knowledge | None = None
) -> Suggester:
    """The suggester registered as `name`; ValueError naming the known ones otherwise."""
    try:
        factory = SUGGESTERS[name]
    except KeyError:
        raise ValueError(
            f"unknown suggester {name!r}; known: {', '.join(sorted(SUGGESTERS))}"
        ) from None
    return factory(space, seed, known or Knowledge())
