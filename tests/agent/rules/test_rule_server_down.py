"""The server-down rule follows what the runtime says of the process."""

from __future__ import annotations

import pytest

from kvpilot.agent.rules.config import ServerDownConfig
from kvpilot.agent.rules.server_down import ServerDownRule
from tests.agent.rules.rules_helpers import Driver, annotation, engine, label, only


@pytest.mark.parametrize(
    ("state", "active"),
    [("running", False), ("exited", True), ("missing", True), ("unknown", None), (None, None)],
)
def test_down_follows_the_runtime_state(state: str | None, active: bool | None) -> None:
    driver = Driver(ServerDownRule(ServerDownConfig()))
    reason = "exit code -9" if state == "exited" else None
    conditions = driver.tick(
        1.0, engines=[engine(1.0)], instance_state=state, instance_state_reason=reason
    )
    condition = only(conditions)
    assert condition.active is active
    assert label(condition, "alertname") == "VllmServerDown"
    assert label(condition, "severity") == "critical"
    assert annotation(condition, "action") == "restart"
    if state == "exited":
        assert "exit code -9" in condition.summary
    if active is None:
        assert condition.reason
