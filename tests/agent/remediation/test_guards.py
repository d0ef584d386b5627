"""Cooldown, budget and circuit breaker, each allowing and blocking, on a driven clock."""

from __future__ import annotations

import pytest

from kvpilot.agent.config import CircuitBreakerConfig
from kvpilot.agent.remediation import CircuitBreaker, Cooldown, RestartBudget, WatchWindows


def test_cooldown_blocks_until_it_has_passed_per_instance() -> None:
    cooldown = Cooldown(300.0)
    assert cooldown.check("a", 0.0).allowed
    cooldown.record("a", 100.0)
    blocked = cooldown.check("a", 399.0)
    assert not blocked.allowed and "cooldown" in blocked.reason
    assert cooldown.check("b", 399.0).allowed  # per instance
    assert cooldown.check("a", 400.0).allowed


def test_budget_slides() -> None:
    budget = RestartBudget(2, 3600.0)
    budget.record("a", 0.0)
    assert budget.check("a", 10.0).allowed
    budget.record("a", 10.0)
    blocked = budget.check("a", 20.0)
    assert not blocked.allowed and "budget exhausted: 2 of 2" in blocked.reason
    assert budget.check("a", 3600.0).allowed  # the first restart left the window
    assert budget.used("a", 3600.0) == 1


def test_budget_zero_disables_restarts() -> None:
    decision = RestartBudget(0, 60.0).check("a", 0.0)
    assert not decision.allowed and "disabled" in decision.reason


def test_budget_seed_keeps_only_stamps_inside_the_window() -> None:
    budget = RestartBudget(5, 100.0)
    budget.seed("a", [0.0, 950.0, 990.0], now_s=1000.0)
    assert budget.used("a", 1000.0) == 2


def test_breaker_opens_after_k_failures_in_a_row_and_stays_open_until_reset() -> None:
    breaker = CircuitBreaker(2, open_for_s=None)
    assert breaker.record_failure("a", 0.0, "x") is None
    assert breaker.check("a", 1.0).allowed
    change = breaker.record_failure("a", 2.0, "y")
    assert change is not None and change.to_state == "open" and change.failures == 2
    assert not breaker.check("a", 10_000_000.0).allowed  # no timeout: only a human closes it
    closed = breaker.reset("a", "operator")
    assert closed is not None and closed.to_state == "closed"
    assert breaker.check("a", 10_000_001.0).allowed
    assert breaker.reset("a", "again") is None


def test_a_success_between_failures_resets_the_count() -> None:
    breaker = CircuitBreaker(2, open_for_s=None)
    breaker.record_failure("a", 0.0, "x")
    breaker.record_success("a", 1.0)
    assert breaker.record_failure("a", 2.0, "y") is None
    assert breaker.state("a", 3.0) == "closed"


def test_breaker_half_opens_after_its_hold_for_one_trial() -> None:
    breaker = CircuitBreaker(1, open_for_s=600.0)
    assert breaker.record_failure("a", 0.0, "x") is not None
    assert breaker.state("a", 599.0) == "open"
    assert breaker.check("a", 600.0).allowed
    breaker.note_attempt("a", 600.0)
    # The trial is on watch: no second restart meanwhile.
    assert not breaker.check("a", 601.0).allowed
    reopened = breaker.record_failure("a", 700.0, "trial failed")
    assert reopened is not None and reopened.to_state == "open"
    assert breaker.state("a", 800.0) == "open"
    breaker.note_attempt("a", 1300.0)
    closed = breaker.record_success("a", 1400.0)
    assert closed is not None and closed.to_state == "closed"


def test_breaker_state_round_trips_through_wall_time() -> None:
    breaker = CircuitBreaker(1, open_for_s=600.0)
    breaker.record_failure("a", 100.0, "x")
    fact = breaker.to_fact("a", now_s=150.0, now_wall_s=10_050.0)
    assert fact["opened_at_wall_s"] == 10_000.0
    restored = CircuitBreaker(1, open_for_s=600.0)
    # A new process: its monotonic clock has another origin.
    restored.restore("a", fact, now_s=5.0, now_wall_s=10_200.0)
    assert restored.state("a", 5.0) == "open"
    assert restored.state("a", 5.0 + 400.0) == "half_open"
    assert restored.failures("a") == 1


def test_settings_refuse_nonsense() -> None:
    # The guards take the validated `remediation` section; it refuses these itself.
    with pytest.raises(ValueError, match="failures_to_open"):
        CircuitBreakerConfig(failures_to_open=0)
    with pytest.raises(ValueError, match="hold_s"):
        CircuitBreakerConfig(hold_s=0)
    with pytest.raises(ValueError, match="watch windows"):
        WatchWindows(after_restart_s=0)
