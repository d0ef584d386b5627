"""A firing alert's facts as typed values, read once from the annotations the rules write."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from kvpilot.agent.model import Labels


class Action(StrEnum):
    """What a rule is configured to do when it fires (its `action` annotation)."""

    ALERT = "alert"  # notify only
    RESTART = "restart"
    LADDER = "ladder"  # the preemption spike's: promote, restart for a leak, or recommend


@dataclass(frozen=True, slots=True)
class AlertFacts:
    """What the ladder decides on. The annotations stay as they are, for people to read."""

    # The configured action; a string is one this kvpilot does not know (alert only).
    action: Action | str = Action.ALERT
    # The preemption rule's capacity-leak signature (KV usage high while few requests run);
    # None when the rule could not tell or does not report it.
    capacity_leak: bool | None = None

    @classmethod
    def from_annotations(cls, annotations: Labels) -> AlertFacts:
        notes = dict(annotations)
        return cls(
            action=_action(notes.get("action", Action.ALERT)),
            # The rule writes "true", "false" or "unknown".
            capacity_leak={"true": True, "false": False}.get(notes.get("capacity_leak", "")),
        )


def _action(text: str) -> Action | str:
    try:
        return Action(text)
    except ValueError:
        return text
