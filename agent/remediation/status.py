"""What `GET /api/v1/status` shows of remediation: the mode, runs in progress, breakers,
vetoes."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvpilot.agent.mode import Mode, ModeSetting
from kvpilot.agent.remediation.guards import BreakerState, CircuitBreaker
from kvpilot.agent.remediation.progress import ActiveRemediation
from kvpilot.agent.remediation.vetoes import Veto, Vetoes


@dataclass(frozen=True, slots=True)
class BreakerView:
    """One instance's circuit breaker."""

    instance: str
    state: BreakerState
    failures: int


@dataclass(frozen=True, slots=True)
class RemediationStatus:
    """Everything `GET /api/v1/status` shows of remediation."""

    dry_run: bool
    active: tuple[ActiveRemediation, ...]
    breakers: tuple[BreakerView, ...]
    vetoed_instances: tuple[str, ...]
    vetoed_incidents: tuple[str, ...]
    mode: str = Mode.ARMED.value
    mode_source: str = ""
    vetoes: tuple[Veto, ...] = ()


def remediation_status(
    *,
    mode: ModeSetting,
    active: tuple[ActiveRemediation, ...],
    breaker: CircuitBreaker,
    instances: Iterable[str],
    vetoes: Vetoes,
    now_s: float,
) -> RemediationStatus:
    """The view at `now_s`; a breaker for each of `instances`, sorted by name."""
    held = tuple(vetoes.active())
    return RemediationStatus(
        dry_run=mode.mode is Mode.DRY_RUN,
        active=active,
        breakers=tuple(
            BreakerView(name, breaker.state(name, now_s), breaker.failures(name))
            for name in sorted(set(instances))
        ),
        vetoed_instances=tuple(v.target for v in held if v.kind == "instance"),
        vetoed_incidents=tuple(v.target for v in held if v.kind == "incident"),
        mode=mode.mode.value,
        mode_source=mode.source.value,
        vetoes=held,
    )
