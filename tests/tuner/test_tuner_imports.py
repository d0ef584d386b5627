"""Importing the tuner never pulls in the scientific stack; only tuning does."""

from __future__ import annotations

import subprocess
import sys

MODULES = (
    "kvpilot.tuner",
    "kvpilot.tuner.problem.space",
    "kvpilot.tuner.problem.constraints",
    "kvpilot.tuner.problem.objective",
    "kvpilot.tuner.problem.startup_errors",
    "kvpilot.tuner.suggest",
    "kvpilot.tuner.problem.fingerprint",
    "kvpilot.tuner.trials",
    "kvpilot.tuner.judge.judgement",
    "kvpilot.tuner.measure.traces",
    "kvpilot.tuner.report.html",
    "kvpilot.tuner.report.table",
)


def _heavy_after(code: str) -> list[str]:
    probe = (
        f"{code}\nimport sys\n"
        "print(','.join(m for m in ('numpy', 'scipy', 'skopt', 'sklearn') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return [m for m in out.stdout.strip().split(",") if m]


def test_importing_every_tuner_module_loads_no_numpy_scipy_or_skopt() -> None:
    assert _heavy_after("\n".join(f"import {m}" for m in MODULES)) == []


def test_the_probe_sees_skopt_when_a_model_is_built() -> None:
    # The same probe must notice the stack once the Bayesian suggester models something.
    code = (
        "from kvpilot.tuner.problem.space import Knob, KnobKind, SearchSpace\n"
        "from kvpilot.tuner.problem.objective import TrialOutcome, TrialResult\n"
        "from kvpilot.tuner.suggest import BayesianSuggester\n"
        "space = SearchSpace((Knob('max_num_seqs', KnobKind.INTEGER, 1, 64, log_scale=True),))\n"
        "s = BayesianSuggester(space, n_initial_points=2)\n"
        "for g in (10.0, 20.0):\n"
        "    c = s.ask(); s.tell(c, TrialResult(TrialOutcome.FEASIBLE, g, None, None))\n"
        "s.ask()\n"
    )
    assert {"numpy", "skopt"} <= set(_heavy_after(code))
