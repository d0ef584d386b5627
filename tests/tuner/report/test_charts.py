"""The report's charts: the planner's infeasible region is computed from the constraints,
the stable configuration is marked on every chart, and a chart without data is a sentence."""

from __future__ import annotations

import dataclasses
import re

from kvpilot.tuner.planner import FeasibleBounds
from kvpilot.tuner.problem.constraints import planner_constraint
from kvpilot.tuner.report.html import ReportContext, knob_scatter_svg, render_report
from kvpilot.tuner.report.svg import axis_for
from kvpilot.tuner.trials import TrialState
from tests.tuner.report.history import BOUNDS, MIB, SPACE, STABLE, history


def _svg(page: str, plot_id: str) -> str:
    found = re.search(rf"<svg [^>]*id='{plot_id}'.*?</svg>", page, flags=re.S)
    assert found is not None, plot_id
    return found.group(0)


def _shaded(svg: str) -> list[tuple[float, float, str]]:
    """(x, width, reason) of every shaded rect."""
    return [
        (float(x), float(w), why)
        for x, w, why in re.findall(
            r"<rect class='infeasible' x='([\d.]+)' y='[\d.]+' width='([\d.]+)'.*?<title>(.*?)<",
            svg,
        )
    ]


def test_the_infeasible_region_is_what_the_planner_refuses() -> None:
    svg = knob_scatter_svg(history(), SPACE, STABLE)
    rects = _shaded(svg)
    below = [r for r in rects if "&lt; 4194304 (one request)" in r[2]]
    above = [r for r in rects if "kv_cache_memory_bytes" in r[2] and "&gt; 100663296" in r[2]]
    batched = [r for r in rects if "max_num_seqs" in r[2] and "max_num_batched_tokens" in r[2]]
    assert below and above and batched
    # The planner's cells end at its bounds (4 MiB, 96 MiB), give or take a cell.
    axis = axis_for("kv_cache_memory_bytes", [MIB, 128 * MIB], SPACE, (56, 544))
    cell = 488 / 56
    assert abs(max(x + w for x, w, _ in below) - axis.at(4 * MIB)) <= cell + 1
    assert abs(min(x for x, _, _ in above) - axis.at(96 * MIB)) <= cell + 1
    wider = dataclasses.replace(
        SPACE, constraints=(planner_constraint(FeasibleBounds(None, None, 1, None, 1, ())),)
    )
    assert _shaded(knob_scatter_svg(history(), wider, STABLE)) == []
    assert BOUNDS.min_kv_cache_memory_bytes == 4 * MIB


def test_the_stable_is_marked_on_every_chart() -> None:
    page = render_report(history(), context=ReportContext(SPACE, STABLE))
    assert "class='stable'" in _svg(page, "plot-convergence")  # its goodput, dashed
    assert "stable 1030 tok/s" in _svg(page, "plot-convergence")
    assert "<polygon class='stable'" in _svg(page, "plot-knobs")
    for number in (1, 2, 5):
        trial = _svg(page, f"plot-trial-{number}")
        assert "stable (baseline): 1030" in trial and "fill='#e65100'" in trial
        assert "stable (baseline) p95 0.42" in trial  # the window's p95, from the trial
    assert "high ✗" in _svg(page, "plot-trial-5")


def test_a_chart_without_data_is_a_sentence_never_an_empty_frame() -> None:
    page = render_report([])
    assert "<svg" not in page
    for sentence in ("no convergence to draw", "no knob map to draw", "ran a canary beside"):
        assert sentence in page
    planned = [
        dataclasses.replace(t, state=TrialState.PLANNED, result=None, judgement=None, baseline=None)
        for t in history()
    ]
    page = render_report(planned, context=ReportContext(SPACE, STABLE))
    assert "No measured trials yet" in page and "plot-convergence" not in page


def test_what_the_report_could_not_know_is_said() -> None:
    page = render_report(history(), context=ReportContext(notes=("no region: no model config",)))
    assert "no region: no model config" in page
    assert "class='infeasible'" not in page and "<polygon class='stable'" not in page
