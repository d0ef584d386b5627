"""The `remediation:` section: the guards in front of a restart."""

from __future__ import annotations

from pathlib import Path

from pydantic import (
    Field,
    model_validator,
)

from kvpilot.agent.strict_model import StrictModel


class BudgetConfig(StrictModel):
    """At most `max_restarts` restarts of one instance per sliding window."""

    max_restarts: int = Field(3, ge=0, description="Restarts allowed per window (0: none).")
    window_s: float = Field(3600.0, gt=0, description="The sliding window's length.")


class CircuitBreakerConfig(StrictModel):
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


class PreflightConfig(StrictModel):
    """Checks that the server will have the memory to start again before stopping it."""

    enabled: bool = Field(True, description="Run the memory check before every restart.")
    unknown_blocks_restart: bool = Field(
        False, description="When the memory cannot be measured, refuse the restart."
    )
    margin_ratio: float = Field(
        0.05, ge=0, le=1, description="Headroom required beyond the server's own budget."
    )


class OomConfig(StrictModel):
    """The OOM guard: a server that died of memory is restarted with its memory knob moved."""

    enabled: bool = Field(True, description="Step the memory knob after an out-of-memory death.")
    step_ratio: float = Field(
        0.25,
        gt=0,
        lt=1,
        description="Step down by this fraction of the knob when the log does not say how much "
        "was short (an OOM kill, a CUDA error without figures).",
    )
    step_bytes: int | None = Field(
        None,
        ge=1,
        description="Step --kv-cache-memory-bytes down by this many bytes instead of step_ratio.",
    )
    headroom_ratio: float = Field(
        0.1,
        ge=0,
        lt=1,
        description="When the log says what was available, step to that less this fraction.",
    )
    max_kv_cache_memory_bytes: int | None = Field(
        None,
        ge=1,
        description="No stepped --kv-cache-memory-bytes above this (unset: what is available).",
    )
    step_up: bool = Field(
        True,
        description="Too small (no room for one request): step up to the planner's minimum when "
        "that fits; off: report only. Never stepped down.",
    )
    max_steps: int = Field(
        3, ge=1, description="Steps per instance per agent run, besides the restart budget."
    )
    memory_events_path: Path | None = Field(
        None,
        description="The cgroup file whose oom_kill count rises on an OOM kill (memory.events "
        "or memory.oom_control); unset: the agent's own cgroup, which its servers share.",
    )

    @model_validator(mode="after")
    def _one_step(self) -> OomConfig:
        if self.step_bytes is not None and "step_ratio" in self.model_fields_set:
            raise ValueError("set step_ratio or step_bytes, not both")
        return self


class RemediationConfig(StrictModel):
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
    oom: OomConfig = Field(
        default_factory=OomConfig, description="Out-of-memory deaths: step the memory knob."
    )
    light_step_reset_prefix_cache: bool = Field(
        False,
        description="Try vLLM's /reset_prefix_cache before restarting. Needs "
        "VLLM_SERVER_DEV_MODE=1, whose endpoints are unauthenticated.",
    )
