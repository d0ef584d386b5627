"""A rollout over repeated windows (`RolloutSettings.windows`): the judge's unit of evidence
is the window, and a goodput gain must stand out from the windows' own spread."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvpilot.tuner.judge.windows import MIN_WINDOWS
from kvpilot.tuner.rollout.canary import Phase, Strategy
from kvpilot.tuner.rollout.ports import Observation
from tests.tuner.rollout.test_canary import GOOD, STABLE, Rig, ScriptedObserver, window

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class LuckyWindowObserver(ScriptedObserver):
    """The canary serves as the stable does, except in its first window, where everything
    runs 30 % faster (a lucky draw of the machine's conditions)."""

    canary_windows = 0

    async def observe(
        self, urls: Sequence[str], *, prompts: str | None = None
    ) -> tuple[Observation, ...]:
        out = []
        for url in urls:
            self.windows.append(self._argv(url))
            lucky = url == "http://canary" and self.canary_windows == 0
            self.canary_windows += url == "http://canary"
            out.append(window(0.7 if lucky else 1.0))
        return tuple(out)


async def test_a_parallel_canary_better_in_every_window_is_promoted_on_paired_windows() -> None:
    rig = Rig()
    outcome = await rig.rollout(windows=MIN_WINDOWS).run(rig.trial(), GOOD, Strategy.PARALLEL)
    assert outcome.promoted, outcome.record.reason
    assert f"median of {MIN_WINDOWS} paired windows" in (outcome.record.reason or "")
    # Five windows a side, then the bake's one.
    assert rig.observer.windows == [STABLE, GOOD] * MIN_WINDOWS + [GOOD]
    judged = outcome.trial.judgement
    assert judged is not None
    ttft = next(m for m in judged.metrics if m.name == "ttft_s")
    assert (ttft.canary_count, ttft.baseline_count) == (MIN_WINDOWS, MIN_WINDOWS)  # windows
    errors = next(m for m in judged.metrics if m.name == "errors_ratio")
    assert errors.canary_count == 60 * MIN_WINDOWS  # every window's requests, counted


async def test_a_sequential_canary_is_judged_paired_with_the_stables_windows_around_it() -> None:
    rig = Rig()
    outcome = await rig.rollout(windows=MIN_WINDOWS).run(rig.trial(), GOOD, Strategy.SEQUENTIAL)
    assert outcome.promoted, outcome.record.reason
    assert f"median of {MIN_WINDOWS} paired windows" in (outcome.record.reason or "")
    # A, B, A again (window k of each sends the same prompts), then the bake's one.
    assert rig.observer.windows == (
        [STABLE] * MIN_WINDOWS + [GOOD] * MIN_WINDOWS + [STABLE] * MIN_WINDOWS + [GOOD]
    )


async def test_one_lucky_window_promotes_alone_but_not_among_five() -> None:
    alone = Rig()
    alone.observer = LuckyWindowObserver(alone.runtime)
    one = await alone.rollout(windows=1).run(alone.trial(), STABLE, Strategy.PARALLEL)
    # 43 % more goodput in its only window: promoted (the stable server restarted); the bake
    # judges the promoted flags against the old ones' windows, and equal flags are not worse.
    assert one.record.phase is Phase.PROMOTED, one.record.reason
    assert [c[0] for c in alone.runtime.calls] == ["start_canary", "stop_canary", "set_stable"]

    among = Rig()
    among.observer = LuckyWindowObserver(among.runtime)
    five = await among.rollout(windows=MIN_WINDOWS).run(among.trial(), STABLE, Strategy.PARALLEL)
    assert five.record.phase is Phase.ROLLED_BACK
    assert "does not beat the stable instance" in (five.record.reason or ""), five.record.reason
    assert [c[0] for c in among.runtime.calls] == ["start_canary", "stop_canary"]
