"""The benchmarks' short modes run in CI: they must run, and their goals must hold."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, *args: str) -> str:
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        capture_output=True, text=True, timeout=600, cwd=ROOT, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_collect_cycle_costs_under_a_quarter_of_the_library_parser() -> None:
    out = _run("collect_cycle.py", "--quick")
    ratio = float(out.split("ratio (cycle / prometheus_client):")[1].split()[0])
    assert ratio <= 0.25


def test_tuner_replay_runs_on_the_measured_grid() -> None:
    out = _run("tuner_efficiency.py", "--quick")
    for method in ("bayesian", "random", "grid"):
        assert f"{method}:" in out


@pytest.mark.slow
def test_soak_runs_against_every_kind_of_flapping_server() -> None:
    # 90 s: the agent must survive every mode and report each goal; the figures are for
    # the 30-minute run, not asserted here (the machine is shared).
    out = _run("soak.py", "--quick")
    assert "modes ok, restart, garbage, drip, huge, refused, nan" in out
    assert out.count("goal ") == 4


@pytest.mark.slow
def test_agent_footprint_runs_the_baseline_and_the_candidate() -> None:
    # HEAD as the baseline: every checkout holds it, a shallow one perhaps not the default.
    out = _run("agent_footprint.py", "--quick", "--baseline", "HEAD")
    # A run whose agent did not tick exits 1 (checked in `_run`); these lines say both ran.
    for servers in (1, 2):
        for kind in ("baseline", "candidate"):
            assert f"{servers} server(s), round 1, {kind}: " in out
        assert f"\n{servers} server(s)\n" in out
    assert out.count("ratio candidate / baseline") == 2
    assert "goal 1 server(s), CPU under 0.25 % of a core at 1 Hz: " in out
