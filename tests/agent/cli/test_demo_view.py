"""The demo's full-screen view, rendered from typed snapshots, and its log panel."""

from __future__ import annotations

import io
import logging
from pathlib import Path

import pytest
from rich.console import Console

from kvpilot.agent.alert_values import AlertView
from kvpilot.agent.cli.demo.state import alert_rows, frag_state
from kvpilot.agent.cli.demo.view import (
    ActionRow,
    AlertRow,
    DemoSnapshot,
    DemoView,
    LogPanel,
    ServerRow,
    TrialRow,
    export,
    render,
)

WIDTH, HEIGHT = 150, 50


def _snapshot() -> DemoSnapshot:
    return DemoSnapshot(
        title="kvpilot demo: http://127.0.0.1:8000",
        phase="phase 2/4: burst",
        wall_s=1_700_000_000.0,
        servers=(
            ServerRow("demo", "stable", "running", 0.97, 64, 2, 41.0, 0.42, 0.3, "pending"),
            ServerRow(
                "canary",
                "canary",
                "running",
                0.1,
                384,
                380,
                0.0,
                None,
                0.3,
                "unknown",
                "only 3 blocks free, fewer than 16",
            ),
        ),
        alerts=(AlertRow("VllmPreemptionSpike", "demo", "firing", 1_700_000_000.0),),
        actions=(ActionRow(1_700_000_000.0, "restart", "demo", "succeeded", "cleared"),),
        trials=(TrialRow(0, "kv 8.0 MiB, seqs 8", "complete", "pass: goodput 1.8x"),),
        outbox_backlog=1,
        deliveries=("VllmPreemptionSpike firing (signature verified)",),
        logs=tuple(f"log line {i}" for i in range(20)),
    )


def _text(snapshot: DemoSnapshot) -> str:
    console = Console(file=io.StringIO(), width=WIDTH, height=HEIGHT, record=True)
    console.print(render(snapshot), height=HEIGHT)
    return console.export_text()


def test_every_panel_shows_its_part_of_the_loop() -> None:
    text = _text(_snapshot())
    for title in ("servers", "alerts", "actions", "tuning", "delivery", "log"):
        assert f" {title} " in text
    assert "0.42 (> 0.30) pending" in text
    assert "unknown: only 3 blocks free, fewer than 16" in text
    assert "97.0 %" in text and "2/64" in text
    assert "VllmPreemptionSpike" in text and "firing" in text
    assert "pass: goodput 1.8x" in text
    assert "signature verified" in text and "outbox backlog: 1" in text
    assert "phase 2/4: burst" in text


def test_the_screen_is_its_height_and_the_log_panel_keeps_the_newest_lines() -> None:
    lines = _text(_snapshot()).splitlines()
    assert len(lines) == HEIGHT
    text = "\n".join(lines)
    assert "log line 19" in text and "log line 11" not in text


def test_an_empty_snapshot_says_nothing_happened_yet() -> None:
    text = _text(DemoSnapshot(title="t", phase="starting", wall_s=0.0))
    assert "no alert pending or firing" in text
    assert "no action yet" in text and "no trial yet" in text
    assert "nothing received yet" in text


def _alert(rule: str, state: str, active: bool | None, reason: str | None = None) -> AlertView:
    labels = (("alertname", "X"), ("instance", "demo"))
    return AlertView("f", rule, labels, (), state, active, None, reason, 5.0, None)  # type: ignore[arg-type]


def test_the_fragmentation_state_follows_its_alert() -> None:
    rule = "fragmentation_kv_blocks"
    assert frag_state([], "demo", 0.1) == ("ok", None)
    assert frag_state([_alert(rule, "pending", True)], "demo", 0.5) == ("pending", None)
    assert frag_state([_alert(rule, "firing", True)], "demo", 0.5) == ("firing", None)
    assert frag_state([_alert(rule, "firing", True)], "other", 0.1) == ("ok", None)
    shown = alert_rows([_alert(rule, "inactive", False), _alert(rule, "firing", True)])
    assert [a.state for a in shown] == ["firing"]


def test_the_fragmentation_state_is_unknown_with_its_reason_while_it_cannot_be_computed() -> None:
    rule = "fragmentation_kv_blocks"
    assert frag_state([_alert(rule, "inactive", None, "few free")], "demo", None) == (
        "unknown",
        "few free",
    )
    assert frag_state([], "demo", None, "3 blocks free, fewer than 16") == (
        "unknown",
        "3 blocks free, fewer than 16",
    )
    assert frag_state([], "demo", None) == ("unknown", "no free-list figures")
    # An alert still pending from before: the figure is unknown now, and the alert is said.
    assert frag_state([_alert(rule, "pending", True)], "demo", None, "2 free") == (
        "unknown",
        "2 free (alert pending)",
    )


def test_log_lines_go_to_the_panel_while_the_view_is_on_and_nowhere_else() -> None:
    out = io.StringIO()
    root = logging.getLogger()
    root.addHandler(logging.StreamHandler(out))
    before = list(root.handlers)
    view = DemoView(Console(file=out, width=WIDTH, height=HEIGHT, force_terminal=True))
    with view:
        assert view.panel in root.handlers
        assert (
            not [  # nothing else that writes to a terminal
                h
                for h in root.handlers
                if type(h) is logging.StreamHandler or getattr(h, "stream", None) is out
            ]
        )
        logging.getLogger("kvpilot.test").warning("a line for the panel")
        view.show(_snapshot())
    assert root.handlers == before
    root.removeHandler(before[-1])
    assert any("a line for the panel" in line for line in view.panel.lines())
    screen = out.getvalue()
    assert "\x1b[?1049h" in screen and "\x1b[?1049l" in screen  # the alternate screen
    assert "a line for the panel" not in screen.split("\x1b[?1049l")[-1]


def test_the_panel_formats_multiline_records_as_one_line() -> None:
    panel = LogPanel(keep=2)
    for i in range(3):
        panel.emit(logging.LogRecord("x", logging.INFO, "f", 1, f"a\nb{i}", None, None))
    lines = panel.lines()
    assert len(lines) == 2
    assert lines[0].endswith("a | b1") and lines[1].endswith("a | b2")


def test_frames_redraw_in_place_so_the_scrollback_keeps_no_copies() -> None:
    pyte = pytest.importorskip("pyte")
    out = io.StringIO()
    view = DemoView(Console(file=out, width=WIDTH, height=HEIGHT, force_terminal=True))
    with view:
        for i in range(6):
            logging.getLogger("kvpilot.test").warning("line %d", i)
            view.show(_snapshot())
    out.write("summary: done\n")
    screen = pyte.HistoryScreen(WIDTH, HEIGHT, history=1000)
    pyte.ByteStream(screen).feed(out.getvalue().replace("\n", "\r\n").encode())
    history = ["".join(c.data for c in line.values()) for line in screen.history.top]
    every = history + list(screen.display)
    assert sum("kvpilot demo: http://127.0.0.1:8000" in line for line in every) == 1
    assert not any("line 3" in line and "log line" not in line for line in history)


def test_a_file_handler_keeps_writing_while_the_view_is_on(tmp_path: Path) -> None:
    root = logging.getLogger()
    handler = logging.FileHandler(tmp_path / "demo.log")
    root.addHandler(handler)
    try:
        with DemoView(Console(file=io.StringIO(), width=WIDTH, height=HEIGHT)) as view:
            assert handler in root.handlers and view.panel in root.handlers
            logging.getLogger("kvpilot.test").warning("to the file too")
    finally:
        root.removeHandler(handler)
        handler.close()
    assert "to the file too" in (tmp_path / "demo.log").read_text()


def test_the_capture_is_one_screen_of_text_and_an_svg(tmp_path: Path) -> None:
    export(_snapshot(), tmp_path / "view")
    lines = (tmp_path / "view.txt").read_text().splitlines()
    assert len(lines) == HEIGHT and "phase 2/4: burst" in lines[0]
    assert (tmp_path / "view.svg").read_text().lstrip().startswith("<svg")


def test_a_trial_row_says_why_a_trial_did_not_complete_before_its_judgement() -> None:
    from kvpilot.agent.cli.demo.state import trial_rows
    from kvpilot.tuner.judge.judgement import Classification, Judgement
    from kvpilot.tuner.trials import Trial, TrialState

    judged = Judgement(Classification.PASS, 1.0, (), "score 100%")
    values = (("kv_cache_memory_bytes", 3 * 2**20), ("max_num_seqs", 11))
    trials = [
        Trial("b", "f", 2, values, TrialState.COMPLETE, 0.0, 0.0, None, None, judged),
        Trial(
            "a",
            "f",
            1,
            values,
            TrialState.INFEASIBLE,
            0.0,
            0.0,
            "ttft p95 over the SLO",
            None,
            judged,
        ),
    ]
    first, second = trial_rows(trials)
    assert first.number == 1 and first.candidate == "kv 3.0 MiB, seqs 11"
    assert first.verdict == "ttft p95 over the SLO (judge: pass: score 100%)"
    assert second.verdict == "pass: score 100%"
