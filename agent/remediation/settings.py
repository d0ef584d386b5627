"""The remediation layer's settings as plain values (the agent maps its config onto them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

GIB = 1024**3

PreflightDevice = Literal["auto", "gpu", "cpu"]


@dataclass(frozen=True, slots=True)
class RemediationSettings:
    """Guards, timings and switches of the remediation ladder; durations in seconds.

    The circuit breaker opens after `breaker_failures_to_open` failed restarts in a row of one
    instance: a restart failed when the runtime raised, when the condition was still active
    at the end of `verify_window_s`, or when the same alert fired again within
    `recurrence_window_s` of the restart. An open breaker blocks restarts and pages once;
    it closes when an operator resets it, or, when `breaker_open_for_s` is set, it
    half-opens after that long and lets one restart through (success closes it, failure
    opens it again and pages again). Unset means it stays open until a human resets it.
    """

    dry_run: bool = False
    cooldown_s: float = 300.0
    budget_max_restarts: int = 3
    budget_window_s: float = 3600.0
    breaker_failures_to_open: int = 2
    recurrence_window_s: float = 600.0
    breaker_open_for_s: float | None = None
    preflight_enabled: bool = True
    unknown_blocks_restart: bool = False
    preflight_margin_ratio: float = 0.05
    preflight_device: PreflightDevice = "auto"
    # CPU servers: weights, activations and the runtime beside the KV pool.
    cpu_runtime_margin_bytes: int = 1 * GIB
    drain_timeout_s: float = 60.0
    ready_timeout_s: float = 300.0
    # After a restart: how long the condition has to show inactive before it counts as failed.
    verify_window_s: float = 120.0
    light_step_reset_prefix_cache: bool = False
    # After the light step: how long to wait for the condition to clear before restarting.
    light_step_wait_s: float = 30.0

    def __post_init__(self) -> None:
        positive = {
            "budget_window_s": self.budget_window_s,
            "recurrence_window_s": self.recurrence_window_s,
            "verify_window_s": self.verify_window_s,
            "ready_timeout_s": self.ready_timeout_s,
        }
        for name, value in positive.items():
            if value <= 0:
                raise ValueError(f"{name} must be positive, not {value}")
        if self.cooldown_s < 0 or self.drain_timeout_s < 0 or self.light_step_wait_s < 0:
            raise ValueError("cooldown_s, drain_timeout_s and light_step_wait_s must be >= 0")
        if self.budget_max_restarts < 0:
            raise ValueError("budget_max_restarts must be >= 0")
        if self.breaker_failures_to_open < 1:
            raise ValueError("breaker_failures_to_open must be >= 1")
        if self.breaker_open_for_s is not None and self.breaker_open_for_s <= 0:
            raise ValueError("breaker_open_for_s must be positive when set")
        if not 0 <= self.preflight_margin_ratio <= 1:
            raise ValueError("preflight_margin_ratio must be within 0..1")
        if self.cpu_runtime_margin_bytes < 0:
            raise ValueError("cpu_runtime_margin_bytes must be >= 0")


def settings_warnings(settings: RemediationSettings) -> tuple[str, ...]:
    """Valid settings that deserve a word to the operator."""
    notes = []
    if settings.light_step_reset_prefix_cache:
        notes.append(
            "the prefix-cache reset step calls vLLM's /reset_prefix_cache, which needs "
            "VLLM_SERVER_DEV_MODE=1: those dev endpoints are unauthenticated, keep the "
            "server's port private"
        )
    if settings.dry_run:
        notes.append("remediation runs dry: decisions are audited, nothing is restarted")
    return tuple(notes)
