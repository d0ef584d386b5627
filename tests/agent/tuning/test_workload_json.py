"""The learned shape as JSON and back: the KV a running request held travels with it; an
answer of an older kvpilot (without it) still reads; a value that cannot be one is refused."""

from __future__ import annotations

import dataclasses

import pytest

from kvpilot.agent.tuning.workload.as_json import ShapeJsonError, shape_from_json, shape_json
from kvpilot.agent.tuning.workload.window import WorkloadWindow
from tests.agent.tuning.workload_scrapes import served


def _learned() -> dict[str, object]:
    window = WorkloadWindow(600)
    window.observe(served(0, at_s=0.0))
    window.observe(served(100, at_s=50.0))
    shape = window.shape()
    assert shape is not None
    return shape_json(dataclasses.replace(shape, kv_blocks_per_running=21.5))


def test_the_kv_per_running_request_travels_and_an_older_answer_reads() -> None:
    learned = _learned()
    shape = shape_from_json({"learned": learned})
    assert shape is not None and shape.kv_blocks_per_running == 21.5
    older = {k: v for k, v in learned.items() if k != "kv_blocks_per_running"}
    old = shape_from_json({"learned": older})
    assert old is not None and old.kv_blocks_per_running is None


@pytest.mark.parametrize("bad", [0, -3.0, "many", float("inf")])
def test_a_kv_per_running_request_that_cannot_be_one_is_refused(bad: object) -> None:
    with pytest.raises(ShapeJsonError, match="malformed"):
        shape_from_json({"learned": {**_learned(), "kv_blocks_per_running": bad}})
