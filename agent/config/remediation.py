"""The `remediation:` section: the guards in front of a restart."""

from __future__ import annotations

from pydantic import (
    Field,
)

from kvpilot.agent.config.base import (
    Model,
)


class BudgetConfig(Model):
    """At most `max_restarts` restarts of one instance per sliding window."""

    max_restarts: int = Field(3, ge=0, description="Restarts allowed per window (0: none).")
    window_s: float = Field(3600.0, gt=0, description="The sliding window's length.")


class CircuitBreakerConfig(Model):
    """Stops restarting (and pages) when restarts do not keep the condition away."""

    failures_to_open: int = Field(
        2, ge=1, description="Failed restarts in a row that open the breaker."
    )
    hold_s: float = Field(
        600.0,
        gt=0,
        description="A restart failed when its condition fires again within this time.",
    )
    open_for_s: float | None = Field(
        None, gt=0, description="Close again after this long; unset: until an operator closes it."
    )


class PreflightConfig(Model):
    """Checks that the server will have the memory to start again before stopping it."""

    enabled: bool = Field(True, description="Run the memory check before every restart.")
    unknown_blocks_restart: bool = Field(
        False, description="When the memory cannot be measured, refuse the restart."
    )
    margin_ratio: float = Field(
        0.05, ge=0, le=1, description="Headroom required beyond the server's own budget."
    )


class RemediationConfig(Model):
    """The remediation ladder's guards and timings."""

    dry_run: bool = Field(False, description="Decide and audit, but never act.")
    cooldown_s: float = Field(300.0, ge=0, description="Minimum time between two actions.")
    budget: BudgetConfig = Field(default_factory=BudgetConfig, description="Restart budget.")
    circuit_breaker: CircuitBreakerConfig = Field(
        default_factory=CircuitBreakerConfig, description="When restarting stops helping."
    )
    preflight: PreflightConfig = Field(
        default_factory=PreflightConfig, description="Memory check before a restart."
    )
    drain_timeout_s: float = Field(
        60.0,
        ge=0,
        description="Before a restart, wait up to this long for running requests to finish "
        "(0: rely on the server's own SIGTERM drain).",
    )
    verify_timeout_s: float = Field(
        300.0, gt=0, description="After a restart: healthy and a probe answered, within this."
    )
    light_step_reset_prefix_cache: bool = Field(
        False,
        description="Try vLLM's /reset_prefix_cache before restarting. Needs "
        "VLLM_SERVER_DEV_MODE=1, whose endpoints are unauthenticated.",
    )
