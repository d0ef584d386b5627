"""What the API (and the CLI's demo) reach of the running loop: narrow interfaces (the
alerts, remediation, the loop's status and the held canaries) instead of the loop's attributes."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from kvpilot.agent.alert_values import AlertView, Silence
from kvpilot.agent.config import AgentConfig
from kvpilot.agent.mode import LiveMode
from kvpilot.agent.remediation.status import RemediationStatus
from kvpilot.agent.remediation.trigger import RemediationOutcome
from kvpilot.agent.remediation.vetoes import Veto
from kvpilot.agent.runtimes import Runtime
from kvpilot.agent.state.store import RemediationRecord
from kvpilot.agent.tuning.held import HeldTrial, Released
from kvpilot.tuner.rollout.record import Release


class Alerts(Protocol):
    """The alerts as the tracker holds them; a silence, saved and audited."""

    def alerts(self) -> list[AlertView]: ...

    def silence(
        self,
        matchers: Mapping[str, str],
        duration_s: float,
        *,
        comment: str,
        requested_by: str | None,
    ) -> Silence: ...

    def silences(self) -> list[Silence]: ...

    def expire_silence(self, silence_id: str, *, requested_by: str | None) -> bool: ...


class Remediation(Protocol):
    """An operator's restart, veto and breaker reset, the switch, and remediation's status."""

    @property
    def mode(self) -> LiveMode: ...

    def status(self) -> RemediationStatus: ...

    async def trigger(
        self, instance: str, *, requested_by: str, force: bool = False, reason: str = ""
    ) -> RemediationOutcome: ...

    def veto(
        self,
        *,
        requested_by: str,
        reason: str,
        instance: str | None = None,
        incident_id: str | None = None,
        duration_s: float | None = None,
    ) -> Veto: ...

    def lift_veto(
        self,
        *,
        requested_by: str,
        reason: str,
        instance: str | None = None,
        incident_id: str | None = None,
    ) -> bool: ...

    def reset_breaker(self, instance: str, *, requested_by: str, reason: str) -> bool: ...


class LoopStatus(Protocol):
    """The loop's own figures for `/api/v1/status`."""

    @property
    def ticks_total(self) -> int: ...

    def last_actions(self, limit: int) -> list[RemediationRecord]: ...

    def outbox_backlog(self) -> int: ...


class HeldCanaries(Protocol):
    """Canaries held for a person's review (`agent.tuning.held.HeldTrials`)."""

    def held(self) -> list[HeldTrial]: ...

    def check(self, trial_id: str, action: Release) -> Released | None: ...

    async def release(
        self, trial_id: str, action: Release, *, by: str, reason: str
    ) -> Released: ...


@dataclass(frozen=True, slots=True)
class ControlPorts:
    """Everything the API reads or changes. The runtime is read off the event loop only."""

    config: AgentConfig
    runtime: Runtime
    alerts: Alerts
    remediation: Remediation
    status: LoopStatus
    held: HeldCanaries | None = None  # None: no tuning here, so nothing is ever held
    # The settings in force taken from the Deployment's annotations (path -> annotation text).
    from_deployment: Callable[[], Mapping[str, str]] | None = None
