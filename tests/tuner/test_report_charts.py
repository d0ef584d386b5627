"""The report's charts: the planner's infeasible region is computed from the constraints,
the stable configuration is marked on every chart, and a chart without data is a sentence."""

from __future__ import annotations

import dataclasses
import re

from kvpilot.tuner.constraints import planner_constraint
from kvpilot.tuner.planner import FeasibleBounds
from kvpilot.tuner.report import ReportContext, knob_scatter_svg, render_report
from kvpilot.tuner.trials import TrialState
from tests.tuner.report_history import BOUNDS, MIB, SPACE, STABLE, history


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
    # The log axis runs from 1 MiB to 128 MiB over 56..544 px: 4 MiB sits at 2/7, 96 MiB near
    # the right end; the planner's cells stop there.
    assert max(x + w for x, w, _ in below) <= 56 + 488 * 2 / 7 + 10
    assert min(x for x, _, _ in above) >= 56 + 488 * 0.93
    wider = dataclasses.replace(
        SPACE, constraints=(planner_constraint(FeasibleBounds(None, None, MIB, None, 1, ())),)
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
    planned = [dataclasses.replace(t, state=TrialState.PLANNED, result=None, judgement=None,
                                   baseline=None) for t in history()]  # fmt: skip
    page = render_report(planned, context=ReportContext(SPACE, STABLE))
    assert "No measured trials yet" in page and "plot-convergence" not in page


def test_what_the_report_could_not_know_is_said() -> None:
    page = render_report(history(), context=ReportContext(notes=("no region: no model config",)))
    assert "no region: no model config" in page
    assert "class='infeasible'" not in page and "<polygon class='stable'" not in page
