"""A live canary that crashes is judged on its crash, not on the readings that survived: a
restart (its counters back to zero) or its /metrics not answering twice running aborts the
analysis and takes its traffic back. Stand-in vLLM /metrics and a recording split double."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from kvpilot.tuner.rollout.ports import CanaryAborted
from tests.agent.tuning.test_live_observer import (
    PodScript,
    RecordingSplit,
    Step,
    SteppedClock,
    observer,
    url,
)
from tests.fakes.standin_vllm import StandInVllm


@pytest.fixture
def pods() -> Iterator[tuple[StandInVllm, StandInVllm]]:
    with StandInVllm() as stable, StandInVllm() as canary:
        yield stable, canary


def crashing(after: int, then) -> object:
    """A canary's /metrics: a healthy pod for `after` scrapes, then `then()`."""
    healthy = PodScript([Step(9)])
    scrapes = [0]

    def metrics() -> str:
        scrapes[0] += 1
        return healthy.render() if scrapes[0] <= after else then()

    return metrics


def analyse(stable, canary) -> tuple[RecordingSplit, BaseException | None]:
    split, clock = RecordingSplit(canary), SteppedClock()
    live = observer(split, clock)

    async def run() -> None:
        await live.warm([url(stable), url(canary)])
        await live.observe([url(stable), url(canary)])

    try:
        asyncio.run(run())
    except CanaryAborted as exc:
        return split, exc
    return split, None


def test_a_canary_that_restarts_mid_analysis_is_aborted(pods) -> None:
    stable, canary = pods
    stable.metrics = PodScript([Step(9)]).render
    fresh = PodScript([Step(1)])  # the restarted process counts from zero again
    canary.metrics = crashing(3, fresh.render)

    split, aborted = analyse(stable, canary)

    assert aborted is not None and "the canary restarted" in str(aborted)
    assert [c for c, _ in split.calls] == ["send_share", "pull_back"]


def test_a_canary_whose_metrics_stop_answering_is_aborted(pods) -> None:
    stable, canary = pods
    stable.metrics = PodScript([Step(9)]).render

    def gone() -> str:
        raise ConnectionResetError("the canary's container is being restarted")

    canary.metrics = crashing(3, gone)

    split, aborted = analyse(stable, canary)

    assert aborted is not None and "did not answer 2 times running" in str(aborted)
    assert [c for c, _ in split.calls] == ["send_share", "pull_back"]
