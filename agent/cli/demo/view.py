"""The demo's full-screen view: typed snapshots in, a rich Layout out.

The view owns the terminal's alternate screen while it runs (`rich.live` with
`screen=True`): nothing is printed under it, log lines go into its own panel
(`LogPanel`, a logging handler), so the scrollback keeps no copies of the view.
"""

from __future__ import annotations

import io
import logging
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console, Group, RenderableType
from rich.layout import Layout
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

FragState = str  # ok, pending, firing, unknown
_STATE_STYLE = {
    "ok": "green",
    "inactive": "green",
    "resolved": "green",
    "pending": "yellow",
    "firing": "bold red",
    "unknown": "magenta",
}


@dataclass(frozen=True, slots=True)
class ServerRow:
    name: str
    role: str
    up: str  # the runtime's word: running, starting, stopped, ...
    kv_usage_ratio: float | None
    blocks_total: int | None
    blocks_free: int | None
    preemptions_total: float | None
    frag_ratio: float | None
    frag_threshold: float
    frag_state: FragState
    frag_reason: str | None = None  # why unknown


@dataclass(frozen=True, slots=True)
class AlertRow:
    alertname: str
    instance: str
    state: str
    since_wall_s: float | None


@dataclass(frozen=True, slots=True)
class ActionRow:
    wall_s: float
    action: str
    target: str
    decision: str
    reason: str


@dataclass(frozen=True, slots=True)
class TrialRow:
    number: int
    candidate: str
    state: str
    verdict: str | None


@dataclass(frozen=True, slots=True)
class DemoSnapshot:
    title: str
    phase: str
    wall_s: float
    servers: tuple[ServerRow, ...] = ()
    alerts: tuple[AlertRow, ...] = ()
    actions: tuple[ActionRow, ...] = ()
    trials: tuple[TrialRow, ...] = ()
    outbox_backlog: int = 0
    deliveries: tuple[str, ...] = ()  # what the receiver got, newest last
    logs: tuple[str, ...] = ()


def _clock(wall_s: float | None) -> str:
    return "-" if wall_s is None else time.strftime("%H:%M:%S", time.localtime(wall_s))


def _num(value: float | None, fmt: str = "{:.0f}") -> str:
    return "-" if value is None else fmt.format(value)


def _state(word: str) -> Text:
    return Text(word, style=_STATE_STYLE.get(word, ""))


def _servers(rows: tuple[ServerRow, ...]) -> Table:
    table = Table(expand=True, box=None, header_style="bold")
    for column in ("server", "up", "KV usage", "blocks free/total", "preempt", "fragmentation"):
        table.add_column(column, no_wrap=column != "fragmentation")
    for r in rows:
        frag = Text(f"{_num(r.frag_ratio, '{:.2f}')} (> {r.frag_threshold:.2f}) ")
        frag.append_text(_state(r.frag_state))
        if r.frag_reason:
            frag.append(f": {r.frag_reason}", style="dim")
        usage = None if r.kv_usage_ratio is None else 100 * r.kv_usage_ratio
        table.add_row(
            f"{r.name} ({r.role})",
            r.up,
            _num(usage, "{:.1f} %"),
            f"{_num(r.blocks_free)}/{_num(r.blocks_total)}",
            _num(r.preemptions_total),
            frag,
        )
    return table


def _alerts(rows: tuple[AlertRow, ...]) -> RenderableType:
    if not rows:
        return Text("no alert pending or firing", style="dim")
    table = Table(expand=True, box=None, header_style="bold")
    for column in ("alert", "instance", "state", "since"):
        table.add_column(column, no_wrap=True)
    for r in rows:
        table.add_row(r.alertname, r.instance, _state(r.state), _clock(r.since_wall_s))
    return table


def _actions(rows: tuple[ActionRow, ...]) -> RenderableType:
    if not rows:
        return Text("no action yet", style="dim")
    table = Table(expand=True, box=None, header_style="bold")
    for column in ("time", "action", "target", "decision", "reason"):
        table.add_column(
            column, no_wrap=True, overflow="ellipsis", ratio={"reason": 6, "time": 1}.get(column, 2)
        )
    for r in rows:
        table.add_row(_clock(r.wall_s), r.action, r.target, r.decision, r.reason)
    return table


def _trials(rows: tuple[TrialRow, ...]) -> RenderableType:
    if not rows:
        return Text("no trial yet", style="dim")
    table = Table(expand=True, box=None, header_style="bold")
    for column in ("#", "candidate", "state", "verdict"):
        table.add_column(
            column, no_wrap=column != "verdict", ratio=3 if column == "verdict" else None
        )
    for r in rows:
        table.add_row(str(r.number), r.candidate, r.state, r.verdict or "-")
    return table


def _delivery(snapshot: DemoSnapshot) -> RenderableType:
    head = Text(f"outbox backlog: {snapshot.outbox_backlog}")
    lines = [Text(line) for line in snapshot.deliveries[-4:]] or [
        Text("nothing received yet", style="dim")
    ]
    return Group(head, Text("receiver:", style="bold"), *lines)


def render(snapshot: DemoSnapshot, log_lines: int = 8) -> Layout:
    """The whole screen for one snapshot."""
    root = Layout()
    header = Text(f"{snapshot.title}  {_clock(snapshot.wall_s)}  ", style="bold")
    header.append(snapshot.phase, style="bold cyan")
    root.split_column(
        Layout(header, name="header", size=1),
        Layout(
            Panel(_servers(snapshot.servers), title="servers", title_align="left"),
            name="servers",
            size=max(4, len(snapshot.servers) + 3),
        ),
        Layout(name="middle", size=8),
        Layout(Panel(_actions(snapshot.actions), title="actions", title_align="left"), ratio=3),
        Layout(Panel(_trials(snapshot.trials), title="tuning", title_align="left"), ratio=2),
        Layout(
            Panel(
                Text("\n".join(snapshot.logs[-log_lines:]), no_wrap=True, overflow="ellipsis"),
                title="log",
                title_align="left",
            ),
            name="log",
            size=log_lines + 2,
        ),
    )
    root["middle"].split_row(
        Layout(Panel(_alerts(snapshot.alerts), title="alerts", title_align="left")),
        Layout(Panel(_delivery(snapshot), title="delivery", title_align="left")),
    )
    return root


def export(snapshot: DemoSnapshot, stem: Path, *, width: int = 150, height: int = 50) -> None:
    """The screen for `snapshot` as `stem`.txt and `stem`.svg (the README's capture)."""
    console = Console(file=io.StringIO(), width=width, height=height, record=True)
    console.print(render(snapshot), height=height)
    stem.with_suffix(".txt").write_text(
        "\n".join(line.rstrip() for line in console.export_text(clear=False).splitlines()) + "\n"
    )
    console.save_svg(str(stem.with_suffix(".svg")), title="kvpilot demo")


class LogPanel(logging.Handler):
    """Keeps the last lines logged, for the view's log panel, instead of writing them out."""

    def __init__(self, keep: int = 200) -> None:
        super().__init__()
        self._lines: deque[str] = deque(maxlen=keep)
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._lines.append(self.format(record).replace("\n", " | "))
        except Exception:  # a bad record never stops the view
            self.handleError(record)

    def lines(self) -> tuple[str, ...]:
        return tuple(self._lines)


class DemoView:
    """The alternate screen while in use; the root logger's stream handlers are swapped for
    the log panel meanwhile and given back after, so no line is printed over the view (a
    file handler keeps writing)."""

    def __init__(self, console: Console | None = None) -> None:
        self.panel = LogPanel()
        self._live = Live(
            Text("starting..."),
            console=console,
            screen=True,
            auto_refresh=False,
            redirect_stdout=False,
            redirect_stderr=False,
        )
        self._saved: list[logging.Handler] = []

    def __enter__(self) -> DemoView:
        root = logging.getLogger()
        self._saved = list(root.handlers)
        terminal = [h for h in self._saved if _writes_to_terminal(h)]
        for handler in terminal:
            self.panel.addFilter(_filters_of(handler))
        root.handlers[:] = [h for h in self._saved if h not in terminal] + [self.panel]
        self._live.__enter__()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._live.__exit__(None, None, None)
        logging.getLogger().handlers[:] = self._saved

    def show(self, snapshot: DemoSnapshot) -> None:
        self._live.update(render(snapshot), refresh=True)


def _writes_to_terminal(handler: logging.Handler) -> bool:
    """A stream handler other than a file's: it would print over the view."""
    return isinstance(handler, logging.StreamHandler) and not isinstance(
        handler, logging.FileHandler
    )


class _AllOf(logging.Filter):
    def __init__(self, filters: list[logging.Filter]) -> None:
        super().__init__()
        self._filters = filters

    def filter(self, record: logging.LogRecord) -> bool:
        return all(f.filter(record) for f in self._filters)


def _filters_of(handler: logging.Handler) -> logging.Filter:
    """The handler's filters (secret masking) applied to the panel too."""
    return _AllOf([f for f in handler.filters if isinstance(f, logging.Filter)])
