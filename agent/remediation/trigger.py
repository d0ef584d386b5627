"""What starts a remediation and how it ended: a `Trigger` in, a `RemediationOutcome` out."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvpilot.agent.model import AlertFacts, Labels
from kvpilot.agent.state.decision import Decision

if TYPE_CHECKING:
    from kvpilot.agent.state.store import Actor


# The rule of the tuner's own restarts of the stable instance (a canary switched in, back).
TUNING_RULE = "tuning"


@dataclass(frozen=True, slots=True)
class Trigger:
    """A request to remediate one instance: from a firing alert, or from the API."""

    instance: str
    rule: str
    fingerprint: str | None
    incident_id: str | None
    labels: Labels = ()
    facts: AlertFacts = field(default_factory=AlertFacts)  # what the ladder decides on
    actor: Actor = "rule"
    requested_by: str | None = None
    force: bool = False  # an operator's: past the cooldown, budget, breaker and pre-flight


@dataclass(frozen=True, slots=True)
class RemediationOutcome:
    """How one remediation ended."""

    instance: str
    incident_id: str | None
    decision: Decision
    reason: str
    remediation_id: int | None  # None: decided without a journal record (alert only, advice)
    steps: tuple[str, ...] = ()
    old_pid: int | None = None
    new_pid: int | None = None
