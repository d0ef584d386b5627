"""A held canary's release by a person: promoted the way a pass is, or rolled back; only a
held record is released, and a hold keeps the one canary slot until then."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpilot.agent.state.db import Database
from kvpilot.agent.state.trials import SqliteRolloutJournal
from kvpilot.tuner.rollout.canary import NotHeld, Phase, Release, RolloutSettings, Strategy, recover
from kvpilot.tuner.session import TuningBlocked
from tests.tuner.rollout.test_canary import GOOD, STABLE, Rig
from tests.tuner.test_session import session

pytestmark = pytest.mark.anyio
HOLD = {"windows": 5, "judge": RolloutSettings().judge, "hold_inconclusive": True}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def held_rig(tmp_path: Path | None = None) -> Rig:
    """A rig whose trial t1 (the stable's own flags: inconclusive at 5 windows) is held."""
    rig = Rig()
    if tmp_path is not None:  # the agent's SQLite journal instead of the in-memory one
        rig.journal = SqliteRolloutJournal(Database.open(tmp_path))  # type: ignore[assignment]
        rig.runtime._journal = rig.journal  # type: ignore[assignment]
    outcome = await rig.rollout(**HOLD).run(rig.trial(), STABLE, Strategy.PARALLEL)
    assert outcome.held, outcome.record.reason
    return rig


async def test_a_held_canary_promoted_by_a_person_goes_the_way_a_pass_goes() -> None:
    rig = await held_rig()
    record = rig.journal.get("t1")
    trial = rig.store.get("t1")
    assert record is not None and trial is not None
    rig.runtime.calls.clear()
    rig.phases.clear()
    outcome = await rig.rollout(**HOLD).release(
        trial, record, Release.PROMOTE, by="alice", reason="p99 fine on the dashboard"
    )
    assert outcome.promoted, outcome.record.reason
    assert rig.phases == [Phase.PROMOTING, Phase.BAKING, Phase.PROMOTED]
    assert rig.runtime.calls == [  # each step after its phase was saved
        ("stop_canary", None, Phase.PROMOTING),
        ("set_stable", STABLE, Phase.PROMOTING),
    ]
    assert rig.runtime.canary is None and rig.runtime.restores == [False]  # new flags: guarded
    reason = outcome.record.reason or ""
    assert "released for promotion by alice: p99 fine on the dashboard" in reason
    assert outcome.record.released_as() is Release.PROMOTE
    with pytest.raises(NotHeld, match="is promoted, not held"):  # a repeat is no new release
        await rig.rollout(**HOLD).release(
            trial, outcome.record, Release.PROMOTE, by="alice", reason="again"
        )


async def test_a_held_canary_rolled_back_is_stopped_with_the_reason_recorded() -> None:
    rig = await held_rig()
    record, trial = rig.journal.get("t1"), rig.store.get("t1")
    assert record is not None and trial is not None and rig.runtime.canary == STABLE
    outcome = await rig.rollout(**HOLD).release(
        trial, record, Release.ROLLBACK, by="kvpilot", reason="the hold ran out"
    )
    assert outcome.record.phase is Phase.ROLLED_BACK
    assert outcome.record.reason == "released for rollback by kvpilot: the hold ran out"
    assert rig.runtime.canary is None and rig.runtime.argv == STABLE
    assert rig.journal.get("t1") == outcome.record


async def test_a_promotion_the_guards_refuse_ends_rolled_back_and_still_says_who_released() -> None:
    rig = await held_rig()
    record, trial = rig.journal.get("t1"), rig.store.get("t1")
    assert record is not None and trial is not None
    rig.runtime.refuse_new = True
    outcome = await rig.rollout(**HOLD).release(
        trial, record, Release.PROMOTE, by="bob", reason="ship it"
    )
    assert outcome.record.phase is Phase.ROLLED_BACK and outcome.refused is not None
    assert "not promoted: cooldown" in (outcome.record.reason or "")
    assert outcome.record.released_as() is Release.PROMOTE  # a repeat is recognised


async def test_only_a_held_record_is_released() -> None:
    rig = Rig()
    outcome = await rig.rollout().run(rig.trial(), GOOD, Strategy.PARALLEL)
    assert outcome.promoted
    trial = rig.store.get("t1")
    assert trial is not None
    for action in Release:
        with pytest.raises(NotHeld, match="t1 is promoted, not held"):
            await rig.rollout().release(trial, outcome.record, action, by="x", reason="y")
    with pytest.raises(ValueError, match="final"):  # other final phases stay final
        outcome.record.at(Phase.ROLLING_BACK, at_wall_s=1.0)


async def test_recovery_leaves_a_hold_and_its_canary_and_a_release_follows_a_restart(
    tmp_path: Path,
) -> None:
    rig = await held_rig(tmp_path)
    assert await recover(rig.journal, rig.store, rig.runtime, at_wall_s=1e9) == []
    record = rig.journal.get("t1")  # read back from SQLite, as a restarted kvpilot does
    assert record is not None and record.phase is Phase.HELD and rig.runtime.canary == STABLE
    trial = rig.store.get("t1")
    assert trial is not None
    outcome = await rig.rollout(**HOLD).release(
        trial, record, Release.ROLLBACK, by="carol", reason="not tonight"
    )
    assert rig.journal.get("t1") == outcome.record and rig.runtime.canary is None


async def test_a_hold_keeps_the_canary_slot_until_released_through_the_session() -> None:
    rig = await held_rig()
    with pytest.raises(TuningBlocked, match="trial t1 is held for review"):
        await session(rig).run(1)  # no second canary, no second hold beside it
    assert rig.runtime.canary == STABLE and len(rig.store.trials()) == 1
    with pytest.raises(LookupError, match="no trial 'nope'"):
        await session(rig).release("nope", Release.ROLLBACK, by="x", reason="y")
    done = await session(rig).release("t1", Release.ROLLBACK, by="dave", reason="enough")
    assert done.record.phase is Phase.ROLLED_BACK and rig.runtime.canary is None
    with pytest.raises(NotHeld):
        await session(rig).release("t1", Release.ROLLBACK, by="dave", reason="enough")
    summary = await session(rig).run(1)  # the slot is free again
    assert len(summary.outcomes) == 1
