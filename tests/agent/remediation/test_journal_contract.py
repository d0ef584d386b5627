"""The contract of the remediation journal, run over every implementation.

The SQLite store (`StateStore`, what `kvpilot run` writes) and the in-memory double the
remediator's tests use (`tests/fakes/remediation_journal.py`) must answer alike: records
read back as written, newest first, the same refusals, the records a crash leaves unfinished
and what reconcile makes of them, audit rows with their decisions, facts through JSON. The
protocol has no retention: that is the store's own (tests/agent/state/test_state_store.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpilot.agent.model import Action, AlertFacts
from kvpilot.agent.remediation import Remediator, Trigger
from kvpilot.agent.remediation.journal import RemediationJournal, restart_began, unfinished
from kvpilot.agent.state import StateStore
from kvpilot.agent.state.decision import Decision
from tests.fakes.remediation_journal import MemoryJournal

from .remediation_helpers import (
    FakeClock,
    RecordingRuntimeDouble,
    make_instance,
    remediation_config,
)


@pytest.fixture(params=["sqlite", "memory"])
def journal(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[RemediationJournal]:
    if request.param == "sqlite":
        with StateStore.open(tmp_path) as store:
            yield store
    else:
        yield MemoryJournal()


def start(journal: RemediationJournal, **fields) -> int:
    values = {
        "instance": "vllm-0",
        "action": "restart",
        "state": "planned",
        "reason": "planned",
        "started_wall_s": 100.0,
    }
    return journal.start_remediation(**{**values, **fields})


# -- remediations ------------------------------------------------------------------------


def test_a_remediation_reads_back_as_written_and_moves_on(journal: RemediationJournal) -> None:
    rid = start(journal, incident_id="inc-1", fingerprint="fp-1", old_pid=41)
    (record,) = journal.remediations()
    assert (record.id, record.instance, record.action, record.state) == (
        rid,
        "vllm-0",
        "restart",
        "planned",
    )
    assert (record.incident_id, record.fingerprint, record.old_pid, record.new_pid) == (
        "inc-1",
        "fp-1",
        41,
        None,
    )
    assert (record.started_wall_s, record.finished_wall_s, record.finished) == (100.0, None, False)

    journal.update_remediation(rid, state="draining", reason="SIGTERM", now_wall_s=101.0)
    journal.update_remediation(rid, state="verifying", now_wall_s=102.0, new_pid=42)
    (record,) = journal.remediations()
    # No reason: the last one stays; the new PID stays once set.
    assert (record.state, record.reason, record.new_pid) == ("verifying", "SIGTERM", 42)
    journal.update_remediation(rid, state="succeeded", reason="cleared", now_wall_s=130.0)
    (record,) = journal.remediations()
    assert (record.state, record.reason, record.new_pid) == ("succeeded", "cleared", 42)
    assert (record.finished_wall_s, record.finished) == (130.0, True)


def test_a_remediation_decided_before_it_started_is_born_finished(
    journal: RemediationJournal,
) -> None:
    rid = start(journal, state="skipped", reason="skipped: canary")
    (record,) = journal.remediations()
    assert record.id == rid and record.finished_wall_s == 100.0
    assert journal.remediations(unfinished_only=True) == []


def test_queries_filter_and_order_newest_first(journal: RemediationJournal) -> None:
    a1 = start(journal, instance="a", started_wall_s=10.0, incident_id="inc-a")
    b = start(journal, instance="b", started_wall_s=20.0)
    a2 = start(journal, instance="a", started_wall_s=30.0, incident_id="inc-a")
    tie = start(journal, instance="c", started_wall_s=30.0)  # same time: the later id first
    assert [r.id for r in journal.remediations()] == [tie, a2, b, a1]
    assert [r.id for r in journal.remediations(instance="a")] == [a2, a1]
    assert [r.id for r in journal.remediations(incident_id="inc-a")] == [a2, a1]
    assert journal.remediations(incident_id="other") == []
    assert [r.id for r in journal.remediations(since_wall_s=20.0)] == [tie, a2, b]
    assert [r.id for r in journal.remediations(limit=2)] == [tie, a2]


def test_unknown_states_actors_and_ids_are_refused(journal: RemediationJournal) -> None:
    with pytest.raises(ValueError, match="remediation state"):
        start(journal, state="exploded")
    rid = start(journal)
    with pytest.raises(ValueError, match="remediation state"):
        journal.update_remediation(rid, state="exploded", now_wall_s=1.0)  # type: ignore[arg-type]
    with pytest.raises(KeyError):
        journal.update_remediation(rid + 100, state="failed", now_wall_s=1.0)
    with pytest.raises(ValueError, match="actor"):
        journal.record_audit(
            wall_s=1.0,
            actor="robot",
            action="x",
            target="a",
            decision="d",
            reason="r",  # type: ignore[arg-type]
        )


# -- in progress, interrupted, reconciled ------------------------------------------------


def test_unfinished_records_are_the_in_progress_ones_oldest_first(
    journal: RemediationJournal,
) -> None:
    late = start(journal, started_wall_s=50.0)
    early = start(journal, started_wall_s=10.0)
    done = start(journal, started_wall_s=20.0)
    journal.update_remediation(late, state="restarting", now_wall_s=51.0)
    journal.update_remediation(done, state="failed", now_wall_s=21.0)
    assert [r.id for r in unfinished(journal)] == [early, late]
    restarting, planned = journal.remediations(unfinished_only=True)
    assert restart_began(restarting) and not restart_began(planned)


def test_reconcile_fails_what_a_crash_left_and_restores_the_guards(
    journal: RemediationJournal,
) -> None:
    clock = FakeClock()
    runtime = RecordingRuntimeDouble(make_instance())

    def remediator() -> Remediator:  # a fresh kvpilot over the same journal
        return Remediator(
            runtime,
            journal,
            remediation_config(cooldown_s=0.0, preflight={"enabled": False}),
            clock=clock,
            wall_clock=clock.wall,
        )

    mid_restart = start(journal, incident_id="inc-1", started_wall_s=clock.wall() - 5)
    journal.update_remediation(mid_restart, state="restarting", now_wall_s=clock.wall() - 4)
    planned = start(journal, incident_id="inc-2", started_wall_s=clock.wall() - 3)
    first = remediator()
    first.veto(instance="vllm-1", requested_by="carol", reason="maintenance")

    second = remediator()
    reconciled = [
        (r.remediation_id, r.previous_state, r.restart_may_have_happened)
        for r in second.reconcile()
    ]
    assert reconciled == [(mid_restart, "restarting", True), (planned, "planned", False)]
    assert unfinished(journal) == []
    records = {r.id: r for r in journal.remediations()}
    assert records[mid_restart].reason.startswith("interrupted after the restart began: ")
    assert records[planned].reason.startswith("not restarted: ")
    assert all(records[i].state == "failed" and records[i].finished for i in records)
    interrupted = [a for a in journal.audit_records() if a.decision is Decision.INTERRUPTED]
    assert sorted((a.remediation_id, a.details["previous_state"]) for a in interrupted) == [
        (mid_restart, "restarting"),
        (planned, "planned"),
    ]
    # The restart that may have happened counts against the budget; the veto holds.
    assert second.budget.used("vllm-0", clock.now_s) == 1
    assert second.status().vetoed_instances == ("vllm-1",)

    async def again() -> None:
        facts = AlertFacts(Action.RESTART)
        trigger = Trigger("vllm-0", "fragmentation_allocator", "fp-1", "inc-1", facts=facts)
        outcome = await second.remediate(trigger)
        assert outcome.decision is Decision.SKIPPED and "already restarted" in outcome.reason

    asyncio.run(again())
    assert runtime.entered == 0


# -- audit and facts ---------------------------------------------------------------------


def test_audit_rows_read_back_newest_first_with_their_decisions(
    journal: RemediationJournal,
) -> None:
    rid = start(journal)
    first = journal.record_audit(
        wall_s=5.0,
        actor="rule",
        action="restart",
        target="vllm-0",
        decision=Decision.PLANNED,
        reason="planned",
        incident_id="inc-1",
        remediation_id=rid,
        details={"steps": ("restart",), "rule": "kv_saturation"},
    )
    second = journal.record_audit(
        wall_s=6.0,
        actor="api",
        action="cooldown",
        target="vllm-0",
        decision="allowed",
        reason="no earlier action",
    )
    legacy = journal.record_audit(
        wall_s=6.0,
        actor="agent",
        action="restart",
        target="vllm-0",
        decision="dry-run",
        reason="written before the enum",
    )
    assert first < second < legacy
    newest, middle, oldest = journal.audit_records()
    assert [newest.id, middle.id, oldest.id] == [legacy, second, first]
    assert (oldest.wall_s, oldest.actor, oldest.action, oldest.target) == (
        5.0,
        "rule",
        "restart",
        "vllm-0",
    )
    assert (oldest.incident_id, oldest.remediation_id, oldest.reason) == ("inc-1", rid, "planned")
    assert oldest.details == {"steps": ["restart"], "rule": "kv_saturation"}  # through JSON
    assert oldest.decision is Decision.PLANNED
    assert middle.decision == "allowed" and not isinstance(middle.decision, Decision)
    assert middle.details == {} and middle.incident_id is None
    assert newest.decision is Decision.DRY_RUN
    assert [a.id for a in journal.audit_records(since_wall_s=5.5)] == [legacy, second]
    assert [a.id for a in journal.audit_records(limit=1)] == [legacy]


def test_facts_round_trip_through_json(journal: RemediationJournal) -> None:
    assert journal.get_fact("remediation.vetoes") is None
    journal.set_fact("remediation.vetoes", {"instances": ("a",), "incidents": []}, 1.0)
    assert journal.get_fact("remediation.vetoes") == {"instances": ["a"], "incidents": []}
    journal.set_fact("remediation.vetoes", {"instances": [], "incidents": ["inc-1"]}, 2.0)
    assert journal.get_fact("remediation.vetoes") == {"instances": [], "incidents": ["inc-1"]}
