"""One spelling of every decision: the outcome, the audit row read back, the metric's label."""

from __future__ import annotations

import asyncio
from pathlib import Path

from prometheus_client import generate_latest

from kvpilot.agent.app.exposition import build_registry, sidecar_families
from kvpilot.agent.remediation import RemediationOutcome
from kvpilot.agent.state import StateStore
from kvpilot.agent.state.decision import OUTCOMES, Decision, read_decision
from kvpilot.agent.tick.views import SidecarCounters

from .remediation_helpers import FixedPreflight, Harness, condition, remediation_config


def test_the_values_are_the_strings_already_exported() -> None:
    # kvpilot_remediations_total's `outcome` label (documented in the README) and the audit.
    assert {d.value for d in OUTCOMES} == {
        "succeeded",
        "failed",
        "skipped",
        "vetoed",
        "dry_run",
        "alert_only",
        "recommended",
    }
    assert {d.value for d in set(Decision) - OUTCOMES} == {"planned", "escalated", "interrupted"}


def test_stored_rows_in_the_old_spellings_read_back_as_the_enum(tmp_path: Path) -> None:
    with StateStore.open(tmp_path) as store:
        for written in ("dry-run", "alert only", "dry_run", "escalated", "allowed", "created"):
            store.record_audit(
                wall_s=1.0, actor="rule", action="restart", target="a", decision=written, reason="r"
            )
        read = [a.decision for a in reversed(store.audit_records())]
    assert read == [
        Decision.DRY_RUN,
        Decision.ALERT_ONLY,
        Decision.DRY_RUN,
        Decision.ESCALATED,
        "allowed",
        "created",
    ]
    assert all(isinstance(d, Decision) for d in read[:4])
    assert not any(isinstance(d, Decision) for d in read[4:])  # guard verdicts, the API's own
    assert read_decision("alert only") is Decision.ALERT_ONLY


def _label(outcome: RemediationOutcome) -> str:
    counters = SidecarCounters(
        alerts_by_state=(),
        outbox_backlog=None,
        notifications_total=(),
        remediations_total=(((outcome.instance, outcome.decision), 1),),
        breakers_open=(),
        remediation_in_progress=False,
    )
    text = generate_latest(build_registry(lambda: [], sidecar_families(lambda: counters)))
    (line,) = [x for x in text.decode().splitlines() if x.startswith("kvpilot_remediations_total")]
    return line


def test_a_dry_run_is_dry_run_in_the_journal_the_audit_and_the_metric(tmp_path: Path) -> None:
    async def main() -> None:
        with StateStore.open(tmp_path) as store:
            h = Harness(
                remediation_config(dry_run=True),
                preflight=FixedPreflight(True),
                journal=store,  # type: ignore[arg-type]
            )
            (task,) = h.tick(condition())
            outcome = await task
            assert outcome.decision is Decision.DRY_RUN
            (record,) = store.remediations()
            assert record.state == "skipped"  # the journal's state: nothing was done
            ending = [a for a in store.audit_records() if a.action == "restart"]
            assert [a.decision for a in ending] == [Decision.DRY_RUN, Decision.PLANNED]
            assert all(isinstance(a.decision, Decision) for a in ending)
            assert 'outcome="dry_run"' in _label(outcome)

    asyncio.run(main())


def test_alert_only_and_escalated_end_to_end(tmp_path: Path) -> None:
    async def main() -> None:
        with StateStore.open(tmp_path) as store:
            h = Harness(
                remediation_config(cooldown_s=0.0, preflight={"enabled": False}),
                journal=store,  # type: ignore[arg-type]
            )
            (task,) = h.tick(condition("fragmentation_kv_blocks", action="alert"))
            alert_only = await task
            assert alert_only.decision is Decision.ALERT_ONLY
            assert 'outcome="alert_only"' in _label(alert_only)
            h.runtime.failures.append(RuntimeError("exit code 1"))
            (task,) = h.tick(condition())
            failed = await task
            assert failed.decision is Decision.FAILED
            assert 'outcome="failed"' in _label(failed)
            decisions = [a.decision for a in reversed(store.audit_records())]
            assert decisions[0] is Decision.ALERT_ONLY
            # The failed restart's own record says it escalated to the circuit breaker.
            assert decisions[-1] is Decision.ESCALATED

    asyncio.run(main())
