"""The remediator's decisions, spelled one way: in the audit log, in outcomes, in metrics. The
state store reads them back from audit rows, so they live in the state room, below remediation."""

from __future__ import annotations

from enum import StrEnum


class Decision(StrEnum):
    """What the remediator decided about one remediation.

    The values are the strings written to the audit log's `decision` column and exported as
    the `outcome` label of `kvpilot_remediations_total`; `OUTCOMES` are those a
    `RemediationOutcome` (how a remediation ended) can carry, the others only mark an audit
    record.
    """

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    SKIPPED = "skipped"  # a guard, the pre-flight, a canary or an incident already restarted
    VETOED = "vetoed"
    DRY_RUN = "dry_run"  # decided and audited, nothing done (remediation.dry_run)
    ALERT_ONLY = "alert_only"  # the rule's action is to notify only
    RECOMMENDED = "recommended"  # a tuning run is recommended instead of a restart
    PLANNED = "planned"  # audit only: a remediation was opened with these steps
    ESCALATED = "escalated"  # audit only: a failed restart, counted against the breaker
    INTERRUPTED = "interrupted"  # audit only: kvpilot stopped in the middle; reconciled


OUTCOMES = frozenset(Decision) - {Decision.PLANNED, Decision.ESCALATED, Decision.INTERRUPTED}

# Spellings audit rows written before the enum carry; read back as the enum's.
LEGACY_SPELLINGS = {"dry-run": Decision.DRY_RUN, "alert only": Decision.ALERT_ONLY}


def read_decision(text: str) -> Decision | str:
    """An audit row's decision: the remediator's as a `Decision`, anyone else's as written."""
    if text in LEGACY_SPELLINGS:
        return LEGACY_SPELLINGS[text]
    try:
        return Decision(text)
    except ValueError:
        return text  # guard verdicts, alert transitions, tuning runs: free text
