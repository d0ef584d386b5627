"""Suggesters: Bayesian (scikit-optimize), informed (bisection on what kvpilot knows), random
and grid, behind one ask/tell interface, and registered by name (`make_suggester`).

Importing this package is cheap: the Bayesian suggester imports its scientific stack only
when it first builds a model.
"""

from kvpilot.tuner.suggest.base import (
    Explaining,
    Observing,
    SearchExhausted,
    ServerObservation,
    Suggester,
    objective_value,
    tell_observed,
    warm_start,
)
from kvpilot.tuner.suggest.bayes import BayesianSuggester
from kvpilot.tuner.suggest.grid import GridSuggester, row_major_order
from kvpilot.tuner.suggest.informed import InformedSuggester, ScreeningHint
from kvpilot.tuner.suggest.knee import KneeSuggester
from kvpilot.tuner.suggest.prior import KvPrior, LoadShape, MemoryAxis, tokens_in_flight
from kvpilot.tuner.suggest.random_search import RandomSuggester
from kvpilot.tuner.suggest.registry import SUGGESTERS, Knowledge, make_suggester

__all__ = [
    "SUGGESTERS",
    "BayesianSuggester",
    "Explaining",
    "GridSuggester",
    "InformedSuggester",
    "KneeSuggester",
    "Knowledge",
    "KvPrior",
    "LoadShape",
    "MemoryAxis",
    "Observing",
    "RandomSuggester",
    "ScreeningHint",
    "SearchExhausted",
    "ServerObservation",
    "Suggester",
    "make_suggester",
    "objective_value",
    "row_major_order",
    "tell_observed",
    "tokens_in_flight",
    "warm_start",
]
