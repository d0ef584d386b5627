"""The strategies the replay pits against each other, each as it would really run.

* `bayesian`: the project's BayesianSuggester (tuner/suggest/bayes.py), as the tuner runs it.
* `random`: the project's RandomSuggester: untried cells, uniform in each knob's log scale.
* `auto_tune`: vLLM's `benchmarks/auto_tune/auto_tune.sh`. The script first descends
  `--gpu-memory-utilization` from 0.98 by 0.01 while a server fails to start (at the largest
  `max_num_seqs` and `max_num_batched_tokens`), giving up below 0.90; each try is a server
  start with no measurement. Then it walks its full grid at that utilisation: every
  `NUM_SEQS_LIST` value in the order given (ascending), with every
  `NUM_BATCHED_TOKENS_LIST` value inside, one server start and one benchmark each, and keeps
  the best throughput among those that met its latency limit. Mapped onto these tables: the
  utilisation is the KV budget, and 0.98 is the table's largest budget (the level nearest
  the device's whole free memory). The descent's range, 0.98 down to 0.90, is less than one
  level of these grids (each level halves the budget), so the descent tries the largest
  budget only: one start that measures nothing, or, where that cell failed to start, a give
  up with no recommendation. The grid is then every `max_num_seqs` of the table, ascending,
  at the largest budget (the tables hold `max_num_batched_tokens` fixed: a list of one).
  Its trials end there (one more than the grid's rows in starts); the script's final
  profiling run is left out.
* `optuna-gp`: Optuna's GPSampler with `constraints_func` (an infeasible trial's constraint
  is 1, a feasible one's -1), maximising the trial's score (0 where none was measured).
* `optuna-tpe`: Optuna's TPESampler with the same constraints.

Both Optuna samplers search the two knobs as integer indices over the table's levels (the
levels double, so the index is the log scale the project's suggesters use), and start with
as many random trials as the BayesianSuggester's initial design (one more than the knobs)
rather than Optuna's default of 10, so that all three model-based searches spend the same
trials before modelling. Optuna may propose a cell again; that is a trial and a server
start, as it would be on a real server. Optuna is a dev dependency: without it the two are
not run and the replay says so.

Every trial draws one measured window of its cell (`tuner_noise.draw`); its score is the
table's (goodput, or capacity at the SLO), and that is what every strategy maximises.
"""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Callable
from dataclasses import dataclass

from tuner_noise import Drawn, Key, NoisyTable, draw, levels
from tuner_replay import table_space

from kvpilot.tuner.problem.space import Candidate
from kvpilot.tuner.suggest import BayesianSuggester, RandomSuggester, SearchExhausted, Suggester

OPTUNA_STRATEGIES = ("optuna-gp", "optuna-tpe")
STRATEGIES = ("bayesian", "random", "auto_tune", *OPTUNA_STRATEGIES)


@dataclass(frozen=True, slots=True)
class Trial:
    """One trial: the cell asked for and the window it drew."""

    key: Key
    drawn: Drawn


@dataclass(frozen=True, slots=True)
class Run:
    """One strategy's run on one landscape: its trials, and server starts that measured
    nothing before them (auto_tune's descent)."""

    trials: tuple[Trial, ...]
    setup_starts: int = 0

    def starts_after(self, trials: int) -> int:
        """Server starts spent by the end of the first `trials` trials."""
        return self.setup_starts + min(trials, len(self.trials))


def optuna_missing() -> str | None:
    """Why the Optuna strategies cannot run, or None when they can."""
    if importlib.util.find_spec("optuna") is None:
        return "optuna is not installed (a dev dependency: .venv/bin/pip install optuna)"
    if importlib.util.find_spec("torch") is None:  # Optuna's GPSampler is built on it
        return "torch is not installed (Optuna's GP sampler needs it; the cpu extra has it)"
    return None


class _Visits:
    """Draws the next window of a cell: the n-th visit of a cell in a run is its n-th draw."""

    def __init__(self, table: NoisyTable, seed: int) -> None:
        self._table, self._seed, self._count = table, seed, dict[Key, int]()

    def trial(self, key: Key) -> Trial:
        visit = self._count.get(key, 0)
        self._count[key] = visit + 1
        return Trial(key, draw(self._table[key], self._seed, key, visit))


def _key(candidate: Candidate) -> Key:
    return int(candidate["kv_cache_memory_bytes"]), int(candidate["max_num_seqs"])


def _suggested(make: Callable[..., Suggester]) -> Callable[[NoisyTable, int, int], Run]:
    def run(table: NoisyTable, seed: int, budget: int) -> Run:
        truth = {key: cell.truth for key, cell in table.items()}
        suggester, visits, trials = make(table_space(truth), seed=seed), _Visits(table, seed), []
        for _ in range(budget):
            try:
                candidate = suggester.ask()
            except SearchExhausted:
                break
            trial = visits.trial(_key(candidate))
            suggester.tell(candidate, trial.drawn.as_trial_result())
            trials.append(trial)
        return Run(tuple(trials))

    return run


def auto_tune(table: NoisyTable, seed: int, budget: int) -> Run:
    """auto_tune.sh mapped onto the table (see the module's docstring)."""
    kv, seqs = levels(table)
    top = table[(kv[-1], seqs[-1])].truth
    if top.reason.startswith("failed to start"):
        return Run((), setup_starts=1)  # below 0.90 nothing is tried: the script exits
    visits = _Visits(table, seed)
    return Run(tuple(visits.trial((kv[-1], s)) for s in seqs[:budget]), setup_starts=1)


def _optuna(kind: str) -> Callable[[NoisyTable, int, int], Run]:
    def run(table: NoisyTable, seed: int, budget: int) -> Run:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        kv, seqs = levels(table)
        startup = 3  # the BayesianSuggester's initial design: one more than the two knobs

        def constraints(trial: optuna.trial.FrozenTrial) -> list[float]:
            return [float(trial.user_attrs["infeasible"])]

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Optuna marks constraints_func experimental
            sampler: optuna.samplers.BaseSampler = (
                optuna.samplers.GPSampler(
                    seed=seed, n_startup_trials=startup, constraints_func=constraints
                )
                if kind == "gp"
                else optuna.samplers.TPESampler(
                    seed=seed, n_startup_trials=startup, constraints_func=constraints
                )
            )
            study = optuna.create_study(direction="maximize", sampler=sampler)
            visits, trials = _Visits(table, seed), []
            for _ in range(budget):
                asked = study.ask()
                key = (
                    kv[asked.suggest_int("kv_level", 0, len(kv) - 1)],
                    seqs[asked.suggest_int("seqs_level", 0, len(seqs) - 1)],
                )
                trial = visits.trial(key)
                asked.set_user_attr("infeasible", 1.0 if not trial.drawn.feasible else -1.0)
                study.tell(asked, trial.drawn.score or 0.0)
                trials.append(trial)
        return Run(tuple(trials))

    return run


RUNNERS: dict[str, Callable[[NoisyTable, int, int], Run]] = {
    "bayesian": _suggested(BayesianSuggester),
    "random": _suggested(RandomSuggester),
    "auto_tune": auto_tune,
    "optuna-gp": _optuna("gp"),
    "optuna-tpe": _optuna("tpe"),
}
