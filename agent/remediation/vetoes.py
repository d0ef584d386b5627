"""Operators' vetoes: the instances and incidents not to remediate, saved in the journal."""

from __future__ import annotations

from collections.abc import Callable

from kvpilot.agent.remediation.audit import AuditTrail
from kvpilot.agent.remediation.journal import RemediationJournal
from kvpilot.agent.remediation.trigger import Trigger

VETO_FACT = "remediation.vetoes"


class Vetoes:
    """A veto skips the pending and future remediations of an instance or an incident."""

    def __init__(
        self, journal: RemediationJournal, audit: AuditTrail, wall_clock: Callable[[], float]
    ) -> None:
        self._journal = journal
        self._audit = audit
        self._wall_clock = wall_clock
        self.instances: set[str] = set()
        self.incidents: set[str] = set()

    def against(self, trigger: Trigger) -> str | None:
        """Why `trigger` is vetoed (the skip's reason), or None when it is not."""
        if trigger.instance in self.instances:
            return f"vetoed: instance {trigger.instance} is vetoed"
        if trigger.incident_id is not None and trigger.incident_id in self.incidents:
            return f"vetoed: incident {trigger.incident_id} is vetoed"
        return None

    def add(
        self,
        *,
        requested_by: str,
        reason: str,
        instance: str | None = None,
        incident_id: str | None = None,
    ) -> None:
        if (instance is None) == (incident_id is None):
            raise ValueError("veto exactly one of instance or incident_id")
        if instance is not None:
            self.instances.add(instance)
        if incident_id is not None:
            self.incidents.add(incident_id)
        self._save()
        self._audit.record(
            "api",
            "veto",
            instance or "*",
            "vetoed",
            reason,
            incident_id=incident_id,
            details={"requested_by": requested_by},
        )

    def lift(
        self,
        *,
        requested_by: str,
        reason: str,
        instance: str | None = None,
        incident_id: str | None = None,
    ) -> bool:
        """Ends a veto; False when there was none."""
        found = False
        if instance is not None and instance in self.instances:
            self.instances.discard(instance)
            found = True
        if incident_id is not None and incident_id in self.incidents:
            self.incidents.discard(incident_id)
            found = True
        if found:
            self._save()
            self._audit.record(
                "api",
                "veto",
                instance or "*",
                "veto lifted",
                reason,
                incident_id=incident_id,
                details={"requested_by": requested_by},
            )
        return found

    def restore(self) -> None:
        """At start-up: the vetoes an earlier kvpilot saved."""
        saved = self._journal.get_fact(VETO_FACT)
        if isinstance(saved, dict):
            self.instances = set(saved.get("instances") or ())
            self.incidents = set(saved.get("incidents") or ())

    def _save(self) -> None:
        self._journal.set_fact(
            VETO_FACT,
            {"instances": sorted(self.instances), "incidents": sorted(self.incidents)},
            self._wall_clock(),
        )
