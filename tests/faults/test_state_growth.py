"""The state directory does not grow with the ticks: every tick commits (the alert states, the
outbox), and SQLite's write-ahead log keeps the largest size it ever reached unless told to
give it back. A long-running agent's directory is the database plus a bounded log."""

from __future__ import annotations

from pathlib import Path

from kvpilot.agent.state import StateStore

MIB = 1 << 20
BOUND_BYTES = MIB  # the log's bound, as `agent/state/db.py` sets it (WAL_LIMIT_BYTES)


def test_the_write_ahead_log_stays_bounded_over_many_commits(tmp_path: Path) -> None:
    with StateStore.open(tmp_path) as store:
        wal = Path(f"{store.path}-wal")
        largest = 0
        for tick in range(1_500):  # as many commits as twenty-five minutes of ticks
            store.set_fact(f"key-{tick % 40}", "x" * 2_000, float(tick))
            largest = max(largest, wal.stat().st_size)
        database = store.path.stat().st_size
    # What the commits wrote in all (about 6 MiB of log frames) went through a log that
    # never held more than its bound and the one commit that crossed it.
    assert largest <= BOUND_BYTES + 64 * 1024, f"the log reached {largest / MIB:.2f} MiB"
    assert database < MIB  # forty facts: the file holds what is live, not every write
