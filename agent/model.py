"""Values passed between the sidecar loop's parts: conditions, alerts, instances, outbox rows."""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Literal

# The exposition's label pairs; an alert's are kept sorted by name (`labels_of`).
from kvpilot.collectors.promtext import Labels as Labels

AlertState = Literal["inactive", "pending", "firing", "resolved"]
Role = Literal["stable", "canary"]


def labels_of(mapping: Mapping[str, str]) -> Labels:
    return tuple(sorted((str(k), str(v)) for k, v in mapping.items()))


@functools.lru_cache(maxsize=8192)  # every tick asks again for the same few hundred
def fingerprint(labels: Labels) -> str:
    """A stable id for an alert: the hash of its sorted labels (alertname included)."""
    text = "\x1f".join(f"{k}\x1e{v}" for k, v in sorted(labels))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class Action(StrEnum):
    """What a rule is configured to do when its alert fires."""

    ALERT = "alert"  # notify only
    RESTART = "restart"
    LADDER = "ladder"  # the preemption spike's: promote, restart for a leak, or recommend


@dataclass(frozen=True, slots=True)
class AlertFacts:
    """What the remediation ladder decides on, as the rule made it (never read back from
    the annotations, which are text for people)."""

    action: Action = Action.ALERT
    # The preemption rule's capacity-leak signature (KV usage high while few requests run);
    # None when the rule could not tell or does not report it.
    capacity_leak: bool | None = None
    # The preemption rule's thrash: the same requests evicted again and again (a share of
    # its window's finished requests preempted more than once), not a burst spread over many.
    thrash: bool | None = None
    # The saturation rule's: a queue limit refused requests while KV was saturated, so load
    # is turned away, not only queued.
    admission_refused: bool | None = None


@dataclass(frozen=True, slots=True)
class Condition:
    """What one rule says about one target at one tick.

    `active` is None when the rule cannot tell (a source is down, a guard holds); `reason`
    says why. Unknown is never treated as healthy: an alert that is pending or firing stays
    so while its condition is unknown. The rule's own settings travel with it: `for_s` (how
    long it must hold before its alert fires; 0 fires on the first tick) for the alert
    tracker, and `facts` for the remediator.
    """

    rule: str
    labels: Labels  # alertname and the target's labels (instance, model_name, engine, ...)
    active: bool | None
    value: float | None
    summary: str
    reason: str | None = None
    annotations: Labels = ()
    for_s: float = 0.0
    facts: AlertFacts = AlertFacts()

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.labels)


@dataclass(frozen=True, slots=True)
class AlertEvent:
    """A notification-worthy change of one alert: it fired, is still firing, or resolved.

    `incident_id` is the same for every event of one firing episode; receivers
    de-duplicate on (fingerprint, starts_at_wall_s, status).
    """

    fingerprint: str
    incident_id: str
    status: Literal["firing", "resolved"]
    labels: Labels
    annotations: Labels
    starts_at_wall_s: float
    ends_at_wall_s: float | None
    generator_url: str

    @property
    def dedup_key(self) -> str:
        return f"{self.fingerprint}:{self.starts_at_wall_s:.3f}:{self.status}"


@dataclass(frozen=True, slots=True)
class Instance:
    """One vLLM server a runtime knows about. `pids` are in the agent's PID namespace."""

    name: str
    role: Role
    url: str
    kvpool_url: str | None
    pids: frozenset[int]
    main_pid: int | None
    argv: tuple[str, ...] | None
    started_at_wall_s: float | None
    # The served model's config.json where the runtime knows it without an argv.
    model_config: Path | None = None
