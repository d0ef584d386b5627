"""The `RolloutJournal` contract, run over every implementation: the agent's SQLite journal and
the in-memory double (tests/fakes/rollout_journal.py).

`journal` gives an empty journal of each implementation. `reopen` exists only for the
implementations whose records outlive the process (`PERSISTENT`): each call closes the
previous opening and opens the same database again (journal and trial store), as a restarted
kvpilot does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from kvpilot.agent.state.db import Database
from kvpilot.agent.state.trials import SqliteRolloutJournal, SqliteTrialStore
from kvpilot.tuner.rollout.canary import Phase, RolloutRecord, Strategy, recover
from kvpilot.tuner.rollout.ports import RolloutJournal
from kvpilot.tuner.trials import TrialState, TrialStore, new_trial
from tests.fakes.rollout_journal import InMemoryRolloutJournal

IMPLEMENTATIONS = ("sqlite", "memory")
PERSISTENT = ("sqlite",)  # records survive closing and reopening the database

STABLE = ("vllm", "serve", "m", "--kv-cache-memory-bytes", "2097152")
CANDIDATE = ("vllm", "serve", "m", "--kv-cache-memory-bytes", "8388608", "--max-num-seqs", "16")
Reopen = Callable[[], tuple[RolloutJournal, TrialStore]]


@pytest.fixture(params=IMPLEMENTATIONS)
def journal(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[RolloutJournal]:
    if request.param == "memory":
        yield InMemoryRolloutJournal()
        return
    db = Database.open(tmp_path)
    try:
        yield SqliteRolloutJournal(db)
    finally:
        db.close()


@pytest.fixture(params=PERSISTENT)
def reopen(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Reopen]:
    assert request.param == "sqlite"
    opened: list[Database] = []

    def open_again() -> tuple[RolloutJournal, TrialStore]:
        if opened:
            opened.pop().close()
        opened.append(Database.open(tmp_path))
        return SqliteRolloutJournal(opened[-1]), SqliteTrialStore(opened[-1])

    yield open_again
    for db in opened:
        db.close()


def record(
    trial_id: str,
    phase: Phase = Phase.PLANNED,
    *,
    strategy: Strategy = Strategy.PARALLEL,
    at_wall_s: float = 1.0,
) -> RolloutRecord:
    return RolloutRecord(trial_id, strategy, phase, STABLE, CANDIDATE, at_wall_s)


def trial_ids(records: Sequence[RolloutRecord]) -> list[str]:
    return [r.trial_id for r in records]


# --- save and get --------------------------------------------------------------------


def test_a_saved_record_reads_back_equal(journal: RolloutJournal) -> None:
    a = record("a")
    journal.save(a)
    assert journal.get("a") == a
    assert journal.get("missing") is None
    assert journal.records() == [a] and journal.open_records() == [a]


def test_every_field_round_trips(journal: RolloutJournal) -> None:
    full = RolloutRecord(
        "t-ü",
        Strategy.SEQUENTIAL,
        Phase.BAKING,
        ("python", "-m", "vllm", "--chat-template", 'a "quoted" {{ x }}\n'),
        (),
        1_760_000_000.125,
        reason="judged pass (ttft_s within 10 %)",
        baseline_goodput_tokens_per_s=1234.5,
        bake_goodput_tokens_per_s=0.0,
    )
    journal.save(full)
    assert journal.get("t-ü") == full
    bare = record("bare")
    journal.save(bare)
    got = journal.get("bare")
    assert got == bare and got is not None and got.reason is None
    assert got.baseline_goodput_tokens_per_s is None and got.bake_goodput_tokens_per_s is None


@pytest.mark.parametrize("phase", list(Phase), ids=[p.value for p in Phase])
def test_each_phase_is_stored_and_only_final_ones_close(
    journal: RolloutJournal, phase: Phase
) -> None:
    moved = record("t").at(phase, at_wall_s=2.0, reason=f"now {phase.value}")
    journal.save(record("t"))
    journal.save(moved)
    assert journal.get("t") == moved
    assert journal.records() == [moved]
    assert journal.open_records() == ([] if phase.final else [moved])


# --- idempotency and ordering --------------------------------------------------------


def test_saving_the_same_record_twice_keeps_one(journal: RolloutJournal) -> None:
    a = record("a")
    journal.save(a)
    journal.save(a)
    assert journal.records() == [a] and journal.open_records() == [a]


def test_one_record_per_trial_in_first_saved_order(journal: RolloutJournal) -> None:
    a = record("a", at_wall_s=1.0)
    b = record("b", strategy=Strategy.SEQUENTIAL, at_wall_s=2.0)
    journal.save(a)
    journal.save(b)
    a2 = a.at(Phase.ROLLED_BACK, at_wall_s=3.0, reason="judged fail")
    journal.save(a2)
    assert journal.get("a") == a2
    assert journal.records() == [a2, b]  # a's update keeps its place
    assert journal.open_records() == [b]
    b2 = b.at(Phase.OBSERVING, at_wall_s=4.0, baseline_goodput_tokens_per_s=12.5)
    journal.save(b2)
    assert journal.open_records() == [b2]


def test_order_is_the_first_save_not_the_record_time(journal: RolloutJournal) -> None:
    journal.save(record("z", at_wall_s=9.0))
    journal.save(record("a", at_wall_s=1.0))  # an earlier time, saved later
    journal.save(record("m", Phase.STARTING, at_wall_s=5.0))
    assert trial_ids(journal.records()) == ["z", "a", "m"]
    journal.save(record("z", Phase.ABORTED, at_wall_s=10.0))
    assert trial_ids(journal.open_records()) == ["a", "m"]
    assert trial_ids(journal.records()) == ["z", "a", "m"]


# --- what survives a reopen (persistent implementations only) ------------------------


def test_records_survive_a_reopen_in_their_order(reopen: Reopen) -> None:
    journal, _ = reopen()
    done = record("a").at(Phase.PROMOTED, at_wall_s=3.0, reason="promoted; the bake held")
    open_one = record("b", strategy=Strategy.SEQUENTIAL).at(
        Phase.OBSERVING, at_wall_s=4.0, baseline_goodput_tokens_per_s=99.5
    )
    journal.save(record("a"))
    journal.save(open_one)
    journal.save(done)
    journal, _ = reopen()
    assert journal.records() == [done, open_one]
    assert journal.open_records() == [open_one]
    later = open_one.at(Phase.JUDGING, at_wall_s=5.0)
    journal.save(later)
    journal, _ = reopen()
    assert journal.records() == [done, later]


class StableOnly:
    """The runtime a restarted kvpilot finds: the stable flags it left, maybe a canary."""

    def __init__(self, argv: Sequence[str], canary: bool) -> None:
        self.argv = tuple(argv)
        self.canary = canary
        self.restored: list[tuple[str, ...]] = []

    def stable_argv(self) -> tuple[str, ...]:
        return self.argv

    def stable_url(self) -> str:
        return "http://stable"

    async def start_canary(self, argv: Sequence[str], *, ready_timeout_s: float) -> str:
        raise AssertionError("recovery never starts a canary")

    async def stop_canary(self) -> None:
        self.canary = False

    async def set_stable(
        self, argv: Sequence[str], *, reason: str, ready_timeout_s: float, restore: bool = False
    ) -> None:
        assert restore, "recovery only restores"
        self.argv = tuple(argv)
        self.restored.append(self.argv)

    def remediation_in_progress(self) -> bool:
        return False


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize(
    ("strategy", "live", "restored"),
    [(Strategy.PARALLEL, STABLE, False), (Strategy.SEQUENTIAL, CANDIDATE, True)],
    ids=["parallel", "sequential"],
)
async def test_a_rollout_cut_short_is_recovered_after_a_reopen(
    reopen: Reopen, strategy: Strategy, live: tuple[str, ...], restored: bool
) -> None:
    journal, store = reopen()
    trial = new_trial("t1", "s", 1, {"kv_cache_memory_bytes": 8388608}, at_wall_s=1.0)
    store.add(trial)
    store.save(trial.to(TrialState.RUNNING, at_wall_s=2.0))
    journal.save(record("t1", Phase.OBSERVING, strategy=strategy, at_wall_s=3.0))
    journal, store = reopen()  # kvpilot was killed while the canary served
    runtime = StableOnly(live, canary=strategy is Strategy.PARALLEL)
    done = await recover(journal, store, runtime, at_wall_s=50.0)
    assert [(d.trial_id, d.phase, d.stable_restored) for d in done] == [
        ("t1", Phase.OBSERVING, restored)
    ]
    assert runtime.argv == STABLE and not runtime.canary
    journal, store = reopen()
    got = journal.get("t1")
    assert got is not None and got.phase is Phase.ABORTED and journal.open_records() == []
    assert got.reason is not None and "phase observing" in got.reason
    aborted = store.get("t1")
    assert aborted is not None and aborted.state is TrialState.ABORTED
    assert await recover(journal, store, runtime, at_wall_s=60.0) == []  # idempotent
    assert runtime.restored == ([STABLE] if restored else [])
