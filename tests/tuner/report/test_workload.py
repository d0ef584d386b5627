"""The report's workload section: the learned lengths drawn with the configured ones marked,
or a sentence where the run replayed no learned workload; the record the report reads."""

from __future__ import annotations

import re
from pathlib import Path

from kvpilot.agent.config.tuning import TuningConfig
from kvpilot.agent.state import StateStore
from kvpilot.agent.tuning.workload.choice import WorkloadChoice, choose_workload
from kvpilot.agent.tuning.workload.record import WORKLOAD_FACT, last_workload, remember_workload
from kvpilot.tuner.load.learned import learned_workload
from kvpilot.tuner.report.html import ReportContext, render_report
from kvpilot.tuner.report.workload import workload_svg
from tests.tuner.report.history import SHAPE, history


def test_the_chart_has_one_bar_per_observed_bucket_and_marks_the_configured_lengths() -> None:
    svg = workload_svg(SHAPE, (384, 64))
    bars = re.findall(r"<rect [^>]*height='([0-9.]+)'", svg)
    # prompt: 6 observed buckets (11-20 .. 501-1000), output: 6 (3-5 .. 101-200); the
    # configured 384 and 64 fall inside the shown range, so no bar is added for them
    assert len(bars) == 12 and all(float(h) > 0 for h in bars)
    assert "configured 384" in svg and "configured 64" in svg
    assert "300 requests over 176 s" in svg and "prefix hits 35%" in svg


def test_a_configured_length_outside_the_observed_range_widens_the_axis() -> None:
    svg = workload_svg(SHAPE, (1500, 64))
    assert "configured 1500" in svg
    assert ">2k</text>" in svg  # the bucket of 1001..2000 is shown, empty


def test_the_page_says_what_the_last_run_replayed(tmp_path: Path) -> None:
    page = render_report(history(), context=ReportContext(workload=SHAPE, workload_note="x"))
    assert "id='plot-workload'" in page
    plain = render_report(history(), context=ReportContext())
    assert "id='plot-workload'" not in plain and "No run recorded its workload yet." in plain


def test_the_record_keeps_the_learned_shape_and_survives_damage(tmp_path: Path) -> None:
    store = StateStore.open(tmp_path)
    try:
        assert last_workload(store) is None
        tuning = TuningConfig()
        learned = WorkloadChoice(
            learned_workload(SHAPE, requests=16),
            "learned",
            "learned from 300 requests",
            "k",
            SHAPE,
        )
        remember_workload(store, learned, 100.0)
        back = last_workload(store)
        assert back is not None and back.source == "learned" and back.wall_s == 100.0
        assert back.shape is not None and back.shape.requests == 300
        assert back.shape.prompt_tokens.buckets == SHAPE.prompt_tokens.buckets
        remember_workload(store, choose_workload(tuning, None), 200.0)
        configured = last_workload(store)
        assert configured is not None and configured.source == "configured"
        assert configured.shape is None and "nothing has been observed" in configured.reason
        store.set_fact(WORKLOAD_FACT, {"source": "learned", "reason": "r", "shape": [1]}, 300.0)
        damaged = last_workload(store)
        assert damaged is not None and damaged.shape is None
        assert "cannot be read" in damaged.reason
    finally:
        store.close()
