"""The learned workload's window kept in the state database, so that a restart of kvpilot does
not forget the traffic it has seen (the window takes up to `tuning.learn.window_s` to fill).

Once a minute, and as kvpilot stops, the window's increases are written merged into one per
minute, on the wall clock (a new process has another monotonic clock); as kvpilot starts they
are read back and what is older than the window is dropped. The scrapes the restart missed
are missing from the window (its rate reads a little low until they age out). A record that
cannot be read is logged with its reason and ignored: the window starts empty, as before.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvpilot.agent.state.store import StateStore
from kvpilot.agent.tuning.workload.as_json import histogram_from_json, histogram_json
from kvpilot.agent.tuning.workload.window import Increase, WorkloadWindow
from kvpilot.collectors.histogram import Histogram, add

log = logging.getLogger(__name__)

WINDOW_FACT = "tuning.window"
SAVE_EVERY_S = 60.0
MINUTE_S = 60.0
FORMAT = 1


class WindowKeeper:
    """Saves `window` to `store` at most once per `every_s`, and restores it once at start."""

    def __init__(
        self,
        window: WorkloadWindow,
        store: StateStore,
        *,
        every_s: float = SAVE_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._window = window
        self._store = store
        self._every_s = every_s
        self._clock = clock
        self._wall = wall
        self._saved_at: float | None = None

    def restore(self) -> str:
        """Read the window back; returns what happened, for the log."""
        try:
            data = self._store.get_fact(WINDOW_FACT)
        except Exception as exc:  # a damaged JSON text, a locked database: start empty
            return f"the kept window is unreadable ({exc}); it starts empty"
        if data is None:
            return "no kept window; it starts empty"
        return restore_window(self._window, data, clock=self._clock, wall=self._wall)

    def maybe_save(self) -> None:
        """Save when the last save is `every_s` old (called after every tick)."""
        now = self._clock()
        if self._saved_at is None or now - self._saved_at >= self._every_s:
            self.save()

    def save(self) -> None:
        """Write the window now; a failure is logged, never raised into the tick."""
        self._saved_at = self._clock()
        first = self._window.first_s
        if first is None:
            return
        offset = self._wall() - self._clock()
        minutes = [_increase_json(i, offset) for i in _by_minute(self._window.increases())]
        data = {
            "format": FORMAT,
            "first_wall_s": first + offset,
            "block_size": self._window.block_size,
            "minutes": minutes,
        }
        try:
            self._store.set_fact(WINDOW_FACT, data, self._wall())
        except Exception:  # a full disk, a locked database: the window lives on in memory
            log.exception("keeping the learned workload's window failed")


def restore_window(
    window: WorkloadWindow,
    data: Any,
    *,
    clock: Callable[[], float] = time.monotonic,
    wall: Callable[[], float] = time.time,
) -> str:
    """Read a kept window (`WindowKeeper`'s record or `window_summary`'s) back into `window`;
    returns what happened, for the log."""
    offset = wall() - clock()  # wall time = monotonic + offset
    try:
        first_wall, block, increases = _parse(data)
    except (KeyError, TypeError, ValueError) as exc:
        return f"the kept window is unreadable ({exc}); it starts empty"
    now = clock()
    moved = [dataclasses.replace(i, at_s=i.at_s - offset) for i in increases]
    window.restore(moved, first_wall - offset, block, now)
    return f"restored {window.requests()} requests of the kept window"


def window_summary(
    window: WorkloadWindow,
    *,
    clock: Callable[[], float] = time.monotonic,
    wall: Callable[[], float] = time.time,
) -> dict[str, Any] | None:
    """The whole window as one increase, in the kept record's format: the shape a new
    replica replays (not the samples: it ages out of the window all at once), or None."""
    total, first = window.total(), window.first_s
    if total is None or first is None:
        return None
    offset = wall() - clock()
    return {
        "format": FORMAT,
        "first_wall_s": first + offset,
        "block_size": window.block_size,
        "minutes": [_increase_json(total, offset)],
    }


def _by_minute(increases: Sequence[Increase]) -> list[Increase]:
    """The increases merged per minute of their time (kept at the latest of each minute);
    two of other bucket layouts (a vLLM upgrade) stay apart."""
    merged: list[Increase] = []
    for inc in increases:
        last = merged[-1] if merged else None
        if last is not None and math.floor(last.at_s / MINUTE_S) == math.floor(inc.at_s / MINUTE_S):
            prompt_adds, prompt = _added(last.prompt, inc.prompt)
            generation_adds, generation = _added(last.generation, inc.generation)
            if prompt_adds and generation_adds:
                merged[-1] = Increase(
                    at_s=inc.at_s,
                    prompt=prompt,
                    generation=generation,
                    finished=last.finished + inc.finished,
                    hits=last.hits + inc.hits,
                    queries=last.queries + inc.queries,
                )
                continue
        merged.append(inc)
    return merged


def _added(a: Histogram | None, b: Histogram | None) -> tuple[bool, Histogram | None]:
    """(whether they add up, a + b): None + h is h; two layouts do not add up."""
    if a is None or b is None:
        return True, (a if b is None else b)
    total = add(a, b)
    return total is not None, total


def _increase_json(i: Increase, offset: float) -> dict[str, Any]:
    return {
        "wall_s": i.at_s + offset,
        "prompt": None if i.prompt is None else histogram_json(i.prompt),
        "generation": None if i.generation is None else histogram_json(i.generation),
        "finished": i.finished,
        "hits": i.hits,
        "queries": i.queries,
    }


def _parse(data: Any) -> tuple[float, int | None, list[Increase]]:
    """(first wall time, block size, increases on the wall clock); ValueError, KeyError or
    TypeError when the record is not one this kvpilot writes."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError("not a window record of this kvpilot")
    block = data["block_size"]
    if block is not None and (not isinstance(block, int) or block <= 0):
        raise ValueError(f"block size {block!r}")
    increases = [
        Increase(
            at_s=_number(m["wall_s"]),
            prompt=None if m["prompt"] is None else _checked(histogram_from_json(m["prompt"])),
            generation=(
                None if m["generation"] is None else _checked(histogram_from_json(m["generation"]))
            ),
            finished=_count(m["finished"]),
            hits=_count(m["hits"]),
            queries=_count(m["queries"]),
        )
        for m in data["minutes"]
    ]
    return _number(data["first_wall_s"]), block, increases


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{value!r} is not a finite number")
    return float(value)


def _count(value: Any) -> float:
    number = _number(value)
    if number < 0:
        raise ValueError(f"a negative count {value!r}")
    return number


def _checked(h: Histogram) -> Histogram:
    counts = [c for _, c in h.buckets]
    if any(not math.isfinite(c) or c < 0 for c in [*counts, h.count]) or not math.isfinite(h.sum):
        raise ValueError("a histogram with a negative or non-finite count")
    return h
