"""Suggesters: Bayesian (scikit-optimize), random and grid, behind one ask/tell interface.

Importing this package is cheap: the Bayesian suggester imports its scientific stack only
when it first builds a model.
"""

from kvpilot.tuner.suggest.base import SearchExhausted, Suggester, objective_value, warm_start
from kvpilot.tuner.suggest.bayes import BayesianSuggester
from kvpilot.tuner.suggest.grid import GridSuggester, row_major_order
from kvpilot.tuner.suggest.random_search import RandomSuggester

__all__ = [
    "BayesianSuggester",
    "GridSuggester",
    "RandomSuggester",
    "SearchExhausted",
    "Suggester",
    "objective_value",
    "row_major_order",
    "warm_start",
]
