"""Operators' vetoes: the instances and incidents not to remediate, saved in the journal.

A veto lasts until it is lifted, or for `duration_s` when given. Expiry runs on the
monotonic clock; the journal keeps the wall-clock end, which a restarted kvpilot turns back
into monotonic time (a veto that ended while kvpilot was down is not restored).

Where several replicas serve one Deployment, a veto is the Deployment's: `watch` hears of
each operator's veto and lift (to keep them beyond this pod), and `merge_kept` takes in the
vetoes the Deployment keeps, whichever replica set or lifted them.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
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
class VetoChange:
    """An operator's veto, or its lift (then `veto` names the target, the lift's reason and
    who asked), for what keeps vetoes beyond this process."""

    veto: Veto
    lifted: bool


Key = tuple[Kind, str]


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
        self._held: dict[Key, _Held] = {}
        self._kept: set[Key] = set()  # held because the Deployment keeps them
        self._on_change: Callable[[VetoChange], None] | None = None

    def watch(self, on_change: Callable[[VetoChange], None]) -> None:
        """Call `on_change` after each operator's veto and lift (not for merged ones)."""
        self._on_change = on_change

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
        if self._on_change is not None:
            self._on_change(VetoChange(veto, lifted=False))
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
        kind, target = _target(instance, incident_id)
        if self._held.pop((kind, target), None) is None:
            return False
        self._kept.discard((kind, target))
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
        if self._on_change is not None:
            lift = Veto(kind, target, reason, requested_by, self._wall_clock(), None)
            self._on_change(VetoChange(lift, lifted=True))
        return True

    def merge_kept(self, rows: Iterable[object], *, pending: Collection[Key] = ()) -> int:
        """Hold the Deployment's kept vetoes (rows as `veto_row` writes them): new ones are
        taken, ones it kept before and keeps no more (lifted on another replica) dropped. A
        target in `pending` (a change made here, not kept yet) stays as it is here. Returns
        how many vetoes changed."""
        now_s, now_wall_s = self._clock(), self._wall_clock()
        kept: dict[Key, Veto] = {}
        for row in rows:
            try:
                if not isinstance(row, dict):
                    raise TypeError(f"not a veto: {row!r}")
                veto = _veto_from(row)
            except (KeyError, TypeError, ValueError):
                continue  # a row this version cannot read is not a veto it may enforce
            if veto.until_wall_s is None or veto.until_wall_s > now_wall_s:
                kept[(veto.kind, veto.target)] = veto
        changed = 0
        for key in sorted(self._kept - kept.keys() - set(pending)):
            if self._held.pop(key, None) is not None:
                changed += 1
                self._merged_audit(key, "veto lifted", "lifted on another replica")
        for key, veto in kept.items():
            held = self._held.get(key)
            if key in pending or (held is not None and held.veto == veto):
                continue
            until_s = None if veto.until_wall_s is None else now_s + veto.until_wall_s - now_wall_s
            self._held[key] = _Held(veto, until_s)
            changed += 1
            if held is None:
                self._merged_audit(key, "vetoed", f"{veto.reason} (kept by the Deployment)")
        self._kept = (self._kept & set(pending)) | set(kept)
        if changed:
            self._save()
        return changed

    def _merged_audit(self, key: Key, outcome: str, reason: str) -> None:
        kind, target = key
        self._audit.record(
            "agent",
            "veto",
            target if kind == "instance" else "*",
            outcome,
            reason,
            incident_id=target if kind == "incident" else None,
        )

    def restore(self) -> None:
        """At start-up: the vetoes an earlier kvpilot saved that have not ended since."""
        saved = self._journal.get_fact(VETO_FACT)
        if not isinstance(saved, dict):
            return
        now_s, now_wall_s = self._clock(), self._wall_clock()
        held: dict[Key, _Held] = {}
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
        kept = saved.get("kept") or ()
        self._kept = {k for k in held if list(k) in kept}

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
        rows = [veto_row(h.veto) for h in self._held.values()]
        kept = [list(k) for k in sorted(self._kept & self._held.keys())]
        self._journal.set_fact(VETO_FACT, {"vetoes": rows, "kept": kept}, self._wall_clock())


def veto_row(veto: Veto) -> dict[str, object]:
    """A veto as the journal and the Deployment's kept vetoes store it."""
    return {
        "kind": veto.kind,
        "target": veto.target,
        "reason": veto.reason,
        "requested_by": veto.requested_by,
        "since_wall_s": veto.since_wall_s,
        "until_wall_s": veto.until_wall_s,
    }


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
