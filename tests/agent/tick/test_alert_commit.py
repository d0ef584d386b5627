"""The tick's commit step keeps a repeat mark per notifier and firing alert, and no more."""

from __future__ import annotations

from pathlib import Path

from kvpilot.agent.app.parts import tick_settings
from kvpilot.agent.config import AgentConfig
from kvpilot.agent.model import Condition, labels_of
from kvpilot.agent.state import StateStore
from kvpilot.agent.state.write_failures import WriteFailures
from kvpilot.agent.tick.alert_commit import AlertCommit


def _condition(instance: str, active: bool) -> Condition:
    return Condition(
        rule="test_rule",  # for_s 0 (the default): fires at once
        labels=labels_of(
            {"alertname": "VllmKvCacheSaturated", "instance": instance, "severity": "warning"}
        ),
        active=active,
        value=1.0 if active else 0.0,
        summary=f"saturated on {instance}",
    )


def test_the_repeat_marks_of_alerts_that_resolved_are_forgotten(tmp_path: Path) -> None:
    """Engines whose names change (pods replaced) fire and resolve; their marks must go."""
    config = AgentConfig.model_validate(
        {
            "state_dir": str(tmp_path),
            "runtime": {
                "kind": "local",
                "instances": [{"name": "vllm", "argv": ["vllm", "serve"]}],
            },
            "notifiers": [
                {"name": "a", "kind": "webhook", "url": "http://127.0.0.1:9/a"},
                {"name": "b", "kind": "webhook", "url": "http://127.0.0.1:9/b"},
            ],
        }
    )
    wall = 1_700_000_000.0
    with StateStore.open(tmp_path) as store:
        commit = AlertCommit(
            tick_settings(config), store, wall_clock=lambda: wall, write_failures=WriteFailures()
        )
        for generation in range(50):
            instance = f"vllm-{generation}"
            fired = commit.advance([_condition(instance, True)], [], generation * 2.0, wall)
            assert [t.to_state for t in fired] == ["firing"]
            resolved = commit.advance([_condition(instance, False)], [], generation * 2.0 + 1, wall)
            assert [t.to_state for t in resolved] == ["resolved"]
        # One alert still firing keeps its two marks (one per notifier), the rest are gone.
        commit.advance([_condition("vllm-live", True)], [], 200.0, wall)
        assert commit.repeat_marks() == 2


def test_a_wall_clock_step_back_does_not_hold_the_alertmanager_re_push(tmp_path: Path) -> None:
    """Alertmanager resolves an alert whose re-push is late: the decision counts on the
    monotonic clock, so a wall clock stepped back an hour between two pushes holds nothing."""
    config = AgentConfig.model_validate(
        {
            "state_dir": str(tmp_path),
            "runtime": {
                "kind": "local",
                "instances": [{"name": "vllm", "argv": ["vllm", "serve"]}],
            },
            "notifiers": [
                {
                    "name": "am",
                    "kind": "alertmanager",
                    "url": "http://127.0.0.1:9",
                    "repeat_interval_s": 60.0,
                }
            ],
        }
    )
    wall = 1_700_000_000.0
    with StateStore.open(tmp_path) as store:
        commit = AlertCommit(
            tick_settings(config), store, wall_clock=lambda: wall, write_failures=WriteFailures()
        )
        fired = commit.advance([_condition("vllm", True)], [], 100.0, wall)
        assert [t.to_state for t in fired] == ["firing"]
        first = store.outbox.pending_of("am")
        store.outbox.mark_delivered([item.id for item in first], wall)
        # 61 s later on the monotonic clock; the wall clock reads an hour earlier.
        stepped_wall = wall + 61.0 - 3600.0
        repeated = commit.advance([_condition("vllm", True)], [], 161.0, stepped_wall)
        assert [t.repeat for t in repeated] == [True]
        pushed = store.outbox.pending_of("am")
        assert [item.event.status for item in pushed] == ["firing"]
        assert pushed[0].event.incident_id == first[0].event.incident_id
