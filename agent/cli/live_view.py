"""The live terminal view: the same tables as `collect --once`, refreshed every tick."""

from __future__ import annotations

import time

from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

from kvpilot.agent.cli.snapshot_view import render
from kvpilot.agent.tick.ticker import TickState


class LiveView:
    """Owns a rich Live display; `show()` redraws it from a server's latest tick."""

    def __init__(self, *, title: str, console: Console | None = None) -> None:
        self._title = title
        # The alternate screen: each frame replaces the last, and a line logged meanwhile is
        # drawn over, never left in the scrollback between copies of the table.
        self._live = Live(
            Text("waiting for the first tick..."),
            console=console,
            auto_refresh=False,
            screen=True,
        )

    def __enter__(self) -> LiveView:
        self._live.__enter__()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._live.__exit__(None, None, None)

    def show(self, state: TickState | None) -> None:
        if state is None or state.latest is None:
            return
        stamp = time.strftime("%H:%M:%S", time.localtime(state.latest.wall_time_s))
        header = Text(f"{self._title}  {stamp}  tick {state.ticks_total}", style="bold")
        self._live.update(
            Group(header, render(state.latest, state.figures, state.calibrations)), refresh=True
        )
