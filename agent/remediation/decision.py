"""The remediator's decisions, as the remediation modules import them; the vocabulary itself is
the audit log's and lives in the state room (agent/state/decision.py), which the store reads."""

from kvpilot.agent.state.decision import LEGACY_SPELLINGS, OUTCOMES, Decision, read_decision

__all__ = ["LEGACY_SPELLINGS", "OUTCOMES", "Decision", "read_decision"]
