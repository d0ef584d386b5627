"""What the state database writes is masked at the point of writing: audit rows, facts,
remediation reasons, outbox errors, trials and rollout records. An argv read back from the
journal holds `***` for its secrets, and recovery compares it as stored."""

from __future__ import annotations

import shlex
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from kvpilot.agent.state import StateStore
from kvpilot.agent.state.trials import SqliteRolloutJournal, SqliteTrialStore
from kvpilot.tuner.rollout.canary import Phase, RolloutRecord, Strategy, recover
from kvpilot.tuner.trials import TrialState, new_trial
from tests.agent.notify.notify_helpers import make_event

KEY = "sk-state-key-81f2"
STABLE = ("vllm", "serve", "m", "--api-key", KEY, "--max-num-seqs", "8")
CANDIDATE = ("vllm", "serve", "m", "--api-key", KEY, "--max-num-seqs", "16")


@pytest.fixture
def store(tmp_path: Path) -> Iterator[StateStore]:
    with StateStore.open(tmp_path) as opened:
        yield opened


def _file_bytes(tmp_path: Path) -> bytes:
    return b"".join(p.read_bytes() for p in tmp_path.iterdir() if p.name.startswith("kvpilot.db"))


def test_audit_rows_facts_and_remediations_are_masked(store: StateStore, tmp_path: Path) -> None:
    why = f"cannot run {shlex.join(STABLE)}"
    store.record_audit(
        wall_s=1.0,
        actor="agent",
        action="tune",
        target="vllm",
        decision="failed",
        reason=why,
        details={"argv": list(STABLE), "url": "http://h/x?token=abcdef12"},
    )
    store.set_fact("tuning.promoted", {"argv": list(CANDIDATE), "reason": "trial 1"}, 1.0)
    rid = store.start_remediation(
        instance="vllm", action="restart", state="planned", reason=why, started_wall_s=1.0
    )
    store.update_remediation(rid, state="failed", reason=f"{why}: exited", now_wall_s=2.0)

    (audit,) = store.audit_records()
    assert audit.reason == "cannot run vllm serve m --api-key *** --max-num-seqs 8"
    assert audit.details == {
        "argv": [*STABLE[:4], "***", *STABLE[5:]],
        "url": "http://h/x?token=***",
    }
    assert store.get_fact("tuning.promoted")["argv"][4] == "***"
    remediation = store.remediation(rid)
    assert remediation is not None and "--api-key ***" in remediation.reason
    assert KEY.encode() not in _file_bytes(tmp_path)


def test_an_outbox_error_is_masked(store: StateStore, tmp_path: Path) -> None:
    item = store.outbox.enqueue("webhook", make_event(), 1.0)
    store.outbox.mark_failed([item], "webhook: HTTP 503: POST /alerts?token=querytoken12", 2.0)
    (pending,) = store.outbox.pending()
    assert pending.last_error == "webhook: HTTP 503: POST /alerts?token=***"
    assert b"querytoken12" not in _file_bytes(tmp_path)


def test_trials_and_rollout_records_are_masked(store: StateStore, tmp_path: Path) -> None:
    journal, trials = SqliteRolloutJournal(store.db), SqliteTrialStore(store.db)
    trial = new_trial("t1", "study", 1, {"max_num_seqs": 16}, 1.0)
    trials.add(trial)
    why = f"not switched: {shlex.join(CANDIDATE)}"
    trials.save(trial.to(TrialState.ABORTED, at_wall_s=2.0, reason=why))
    journal.save(
        RolloutRecord("t1", Strategy.SEQUENTIAL, Phase.ABORTED, STABLE, CANDIDATE, 2.0, reason=why)
    )
    got = journal.get("t1")
    assert got is not None and got.stable_argv[4] == got.candidate_argv[4] == "***"
    aborted = trials.get("t1")
    assert aborted is not None and aborted.reason == why.replace(KEY, "***")
    assert KEY.encode() not in _file_bytes(tmp_path)


class _Stable:
    """The stable instance as a restarted kvpilot finds it, running its real key."""

    def __init__(self, argv: Sequence[str]) -> None:
        self.argv = tuple(argv)
        self.restored: list[tuple[str, ...]] = []

    def stable_argv(self) -> tuple[str, ...]:
        return self.argv

    def stable_url(self) -> str:
        return "http://stable"

    async def start_canary(self, argv: Sequence[str], *, ready_timeout_s: float) -> str:
        raise AssertionError("recovery never starts a canary")

    async def stop_canary(self) -> None:
        return None

    async def set_stable(
        self, argv: Sequence[str], *, reason: str, ready_timeout_s: float, restore: bool = False
    ) -> None:
        self.restored.append(tuple(argv))

    def remediation_in_progress(self) -> bool:
        return False


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize(
    ("running", "restored"), [(STABLE, False), (CANDIDATE, True)], ids=["kept", "restored"]
)
async def test_recovery_compares_the_flags_as_stored(
    store: StateStore, running: tuple[str, ...], restored: bool
) -> None:
    journal, trials = SqliteRolloutJournal(store.db), SqliteTrialStore(store.db)
    journal.save(RolloutRecord("t1", Strategy.SEQUENTIAL, Phase.OBSERVING, STABLE, CANDIDATE, 1.0))
    runtime = _Stable(running)
    (done,) = await recover(journal, trials, runtime, at_wall_s=2.0)
    # The stable's own flags, its key masked in the file, are not a change to undo.
    assert done.stable_restored is restored
    # A restore hands the stored (masked) argv over: the runtime takes the key back.
    assert runtime.restored == ([(*STABLE[:4], "***", *STABLE[5:])] if restored else [])
