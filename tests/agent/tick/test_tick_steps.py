"""The tick reads as one list: its steps, by name and in order, are the loop's whole tick, and
a tuning run the schedule marks complete is taken once, by the next re-tune step."""

from __future__ import annotations

import asyncio
from pathlib import Path

from kvpilot.agent.state import StateStore
from kvpilot.agent.tick.after import CompletedRuns
from tests.agent.tick.test_remediation_pages import PagingRemediator, _sidecar

STEPS = [
    "observe",
    "evaluate",
    "commit",
    "deliver",
    "act",
    "re-tune",
    "workload window",
    "keeper",
    "housekeeping",
]


def test_the_tick_is_one_ordered_list_of_named_steps(tmp_path: Path) -> None:
    async def scenario() -> tuple[list[str], int]:
        with StateStore.open(tmp_path) as store:
            sidecar = _sidecar(tmp_path, store, PagingRemediator())
            await sidecar.tick()  # every step, observe (nothing answers) to housekeeping
            await sidecar.aclose()
            return [step.name for step in sidecar.steps], sidecar.ticks_total

    names, ticks = asyncio.run(scenario())
    assert names == STEPS
    assert ticks == 1


def test_a_completed_run_is_taken_once() -> None:
    runs = CompletedRuns()
    assert not runs.take()
    runs.mark()
    runs.mark()
    assert runs.take()
    assert not runs.take()
