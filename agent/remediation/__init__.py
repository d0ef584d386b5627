"""Remediation: the ladder per rule, the guards, and the remediator that runs them."""

from kvpilot.agent.remediation.events import CIRCUIT_OPEN_ALERT, TUNING_RECOMMENDED_ALERT
from kvpilot.agent.remediation.execute import RestartTarget
from kvpilot.agent.remediation.guards import (
    CircuitBreaker,
    Cooldown,
    GuardDecision,
    RestartBudget,
)
from kvpilot.agent.remediation.journal import RemediationJournal, restart_began, unfinished
from kvpilot.agent.remediation.ladder import LadderPlan, manual_plan, plan_for
from kvpilot.agent.remediation.prefix_cache import (
    HttpPrefixCacheReset,
    LightStep,
    LightStepResult,
)
from kvpilot.agent.remediation.preflight import MemoryCheck, MemoryPreflight
from kvpilot.agent.remediation.progress import ActiveRemediation
from kvpilot.agent.remediation.reconcile import Reconciled
from kvpilot.agent.remediation.remediator import Remediator
from kvpilot.agent.remediation.status import RemediationStatus
from kvpilot.agent.remediation.trigger import RemediationOutcome, Trigger
from kvpilot.agent.remediation.watch import WatchWindows
from kvpilot.agent.state.decision import Decision

__all__ = [
    "CIRCUIT_OPEN_ALERT",
    "TUNING_RECOMMENDED_ALERT",
    "ActiveRemediation",
    "CircuitBreaker",
    "Cooldown",
    "Decision",
    "GuardDecision",
    "HttpPrefixCacheReset",
    "LadderPlan",
    "LightStep",
    "LightStepResult",
    "MemoryCheck",
    "MemoryPreflight",
    "Reconciled",
    "RemediationJournal",
    "RemediationOutcome",
    "RemediationStatus",
    "Remediator",
    "RestartBudget",
    "RestartTarget",
    "Trigger",
    "WatchWindows",
    "manual_plan",
    "plan_for",
    "restart_began",
    "unfinished",
]
