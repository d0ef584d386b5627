"""Operators' vetoes: the instances and incidents not to remediate, saved in the journal.

A veto lasts until it is lifted, or for `duration_s` when given. Expiry runs on the
monotonic clock; the journal keeps the wall-clock end, which a restarted kvpilot turns back
into monotonic time (a veto that ended while kvpilot was down is not restored).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from kvpilot.agent.remediation.audit import AuditTrail
from kvpilot.agent.remediation.journal import RemediationJournal
from kvpilot.agent.remediation.trigger import Trigger

VETO_FACT = "remediation.vetoes"
Kind = Literal["instance", "incident"]


@dataclass(frozen=True, slots=True)
class Veto:
    """One veto; `until_wall_s` is None for one that lasts until lifted."""

    kind: Kind
    target: str
    reason: str
    requested_by: str
    since_wall_s: float
    until_wall_s: float | None


@dataclass(frozen=True, slots=True)
class _Held:
    veto: Veto
    until_s: float | None  # monotonic


class Vetoes:
    """A veto skips the pending and future remediations of an instance or an incident."""

    def __init__(
        self,
        journal: RemediationJournal,
        audit: AuditTrail,
        wall_clock: Callable[[], float],
        clock: Callable[[], float],
    ) -> None:
        self._journal = journal
        self._audit = audit
        self._wall_clock = wall_clock
        self._clock = clock
        self._held: dict[tuple[Kind, str], _Held] = {}

    @property
    def instances(self) -> set[str]:
        return {v.target for v in self.active() if v.kind == "instance"}

    @property
    def incidents(self) -> set[str]:
        return {v.target for v in self.active() if v.kind == "incident"}

    def active(self) -> list[Veto]:
        """The vetoes in force, instances then incidents, by name; expired ones are dropped."""
        self._expire()
        return [self._held[key].veto for key in sorted(self._held)]

    def against(self, trigger: Trigger) -> str | None:
        """Why `trigger` is vetoed (the skip's reason), or None when it is not."""
        self._expire()
        if ("instance", trigger.instance) in self._held:
            return f"vetoed: instance {trigger.instance} is vetoed"
        if trigger.incident_id is not None and ("incident", trigger.incident_id) in self._held:
            return f"vetoed: incident {trigger.incident_id} is vetoed"
        return None

    def add(
        self,
        *,
        requested_by: str,
        reason: str,
        instance: str | None = None,
        incident_id: str | None = None,
        duration_s: float | None = None,
    ) -> Veto:
        kind, target = _target(instance, incident_id)
        if duration_s is not None and not duration_s > 0:
            raise ValueError("a veto's duration must be above 0 s")
        now_s, now_wall_s = self._clock(), self._wall_clock()
        veto = Veto(
            kind,
            target,
            reason,
            requested_by,
            now_wall_s,
            None if duration_s is None else now_wall_s + duration_s,
        )
        self._held[(kind, target)] = _Held(veto, None if duration_s is None else now_s + duration_s)
        self._save()
        lasting = "until lifted" if duration_s is None else f"for {duration_s:g} s"
        self._audit.record(
            "api",
            "veto",
            instance or "*",
            "vetoed",
            f"{reason} ({lasting})",
            incident_id=incident_id,
            details={"requested_by": requested_by, "duration_s": duration_s},
        )
        return veto

    def lift(
        self,
        *,
        requested_by: str,
        reason: str,
        instance: str | None = None,
        incident_id: str | None = None,
    ) -> bool:
        """Ends a veto; False when there was none (or it had expired)."""
        self._expire()
        if self._held.pop(_target(instance, incident_id), None) is None:
            return False
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
        return True

    def restore(self) -> None:
        """At start-up: the vetoes an earlier kvpilot saved that have not ended since."""
        saved = self._journal.get_fact(VETO_FACT)
        if not isinstance(saved, dict):
            return
        now_s, now_wall_s = self._clock(), self._wall_clock()
        held: dict[tuple[Kind, str], _Held] = {}
        # The earlier form: names only, each lasting until lifted.
        for name in saved.get("instances") or ():
            held[("instance", str(name))] = _Held(
                Veto("instance", str(name), "", "", 0, None), None
            )
        for name in saved.get("incidents") or ():
            held[("incident", str(name))] = _Held(
                Veto("incident", str(name), "", "", 0, None), None
            )
        for row in saved.get("vetoes") or ():
            try:
                veto = _veto_from(row)
            except (KeyError, TypeError, ValueError):
                continue  # a row this version cannot read is not a veto it may enforce
            until_s = None
            if veto.until_wall_s is not None:
                if veto.until_wall_s <= now_wall_s:
                    continue
                until_s = now_s + (veto.until_wall_s - now_wall_s)
            held[(veto.kind, veto.target)] = _Held(veto, until_s)
        self._held = held

    def _expire(self) -> None:
        now_s = self._clock()
        ended = [k for k, h in self._held.items() if h.until_s is not None and h.until_s <= now_s]
        for key in ended:
            held = self._held.pop(key)
            self._audit.record(
                "agent",
                "veto",
                held.veto.target if held.veto.kind == "instance" else "*",
                "veto expired",
                f"the veto of {held.veto.kind} {held.veto.target} ran its duration",
                incident_id=held.veto.target if held.veto.kind == "incident" else None,
            )
        if ended:
            self._save()

    def _save(self) -> None:
        rows = [
            {
                "kind": h.veto.kind,
                "target": h.veto.target,
                "reason": h.veto.reason,
                "requested_by": h.veto.requested_by,
                "since_wall_s": h.veto.since_wall_s,
                "until_wall_s": h.veto.until_wall_s,
            }
            for h in self._held.values()
        ]
        self._journal.set_fact(VETO_FACT, {"vetoes": rows}, self._wall_clock())


def _target(instance: str | None, incident_id: str | None) -> tuple[Kind, str]:
    if instance is not None and incident_id is None:
        return "instance", instance
    if incident_id is not None and instance is None:
        return "incident", incident_id
    raise ValueError("veto exactly one of instance or incident_id")


def _veto_from(row: dict[str, object]) -> Veto:
    kind = row["kind"]
    if kind not in ("instance", "incident"):
        raise ValueError(f"unknown veto kind {kind!r}")
    until = row.get("until_wall_s")
    return Veto(
        "instance" if kind == "instance" else "incident",
        str(row["target"]),
        str(row.get("reason") or ""),
        str(row.get("requested_by") or ""),
        _seconds(row.get("since_wall_s") or 0.0),
        None if until is None else _seconds(until),
    )


def _seconds(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"not a time: {value!r}")
    return float(value)
