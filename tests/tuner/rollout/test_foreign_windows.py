"""A rollout's windows: a side that carried foreign requests (users' traffic on the serving
instance) is observed again, the window left out of the judgement and said in the record;
a sequential canary's window k replays its baseline's window k prompts."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvpilot.tuner.rollout.canary import Phase, Strategy
from kvpilot.tuner.rollout.foreign import ForeignRequests
from kvpilot.tuner.rollout.ports import Observation
from tests.tuner.rollout.test_canary import GOOD, STABLE, Rig, ScriptedObserver

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class ForeignObserver(ScriptedObserver):
    """The scripted windows, the stable side carrying `foreign` requests among 60 of its own
    in its first `busy` windows; the prompts each window was asked for are kept."""

    busy = 1
    foreign = 6
    asked: list[str | None]

    async def observe(
        self, urls: Sequence[str], *, prompts: str | None = None
    ) -> tuple[Observation, ...]:
        self.asked = [*getattr(self, "asked", []), prompts]
        out = []
        for observed in await super().observe(urls, prompts=prompts):
            stable = self._argv(observed.url) == STABLE if observed.url else False
            crowded = stable and self.busy > 0
            counted = ForeignRequests(self.foreign if crowded else 0, 60)
            out.append(
                Observation(observed.url, observed.measurement, observed.samples, foreign=counted)
            )
        self.busy -= 1
        return tuple(out)


def rig_with_foreign(busy: int) -> Rig:
    rig = Rig()
    rig.observer = ForeignObserver(rig.runtime)
    rig.observer.busy = busy
    return rig


async def test_a_crowded_window_is_left_out_and_said() -> None:
    rig = rig_with_foreign(busy=1)
    outcome = await rig.rollout().run(rig.trial(), GOOD, Strategy.PARALLEL)
    assert outcome.promoted, outcome.record.reason
    # The crowded window, then the one judged, then the bake's.
    assert rig.observer.windows == [STABLE, GOOD, STABLE, GOOD, GOOD]
    assert "1 windows left out of the judgement" in (outcome.record.reason or "")
    assert "6 requests the load generator did not send" in (outcome.record.reason or "")


async def test_a_share_under_the_setting_is_judged() -> None:
    rig = rig_with_foreign(busy=1)
    outcome = await rig.rollout(max_foreign_share=0.2).run(rig.trial(), GOOD, Strategy.PARALLEL)
    assert rig.observer.windows == [STABLE, GOOD, GOOD]
    assert "left out" not in (outcome.record.reason or "")


async def test_traffic_that_never_calms_ends_the_trial_with_the_stable_kept() -> None:
    rig = rig_with_foreign(busy=100)
    with pytest.raises(RuntimeError, match="windows left out"):
        await rig.rollout().run(rig.trial(), GOOD, Strategy.PARALLEL)
    assert rig.runtime.argv == STABLE and rig.runtime.canary is None
    record = rig.journal.get("t1")
    assert record is not None and record.phase is Phase.FAILED


async def test_a_sequential_canary_replays_its_baselines_prompts() -> None:
    rig = rig_with_foreign(busy=0)
    await rig.rollout(windows=2).run(rig.trial(), GOOD, Strategy.SEQUENTIAL)
    asked = rig.observer.asked
    assert asked[:2] == ["t1 0", "t1 1"]  # the baseline's windows
    assert asked[2:4] == ["t1 0", "t1 1"]  # the candidate's, the same prompts
