"""The `tuning:` section's settings under which even an equal canary cannot pass are said
where configuration warnings are (`kvpilot config check`, every load), before the night."""

from __future__ import annotations

from pathlib import Path

from kvpilot.agent.cli.demo.scenario import demo_config
from kvpilot.agent.config import config_warnings, validate_config
from kvpilot.agent.config.tuning import TuningConfig
from kvpilot.agent.config.tuning_reach import tuning_reachability, unreachable_tuning

RUNTIME = {"kind": "process", "port": 8000}


def test_the_shipped_defaults_are_reachable_on_either_strategy_and_live_traffic() -> None:
    # unreachable_tuning skips the defaults: this is what lets it.
    for tuning in (
        TuningConfig(),
        TuningConfig(strategy="sequential"),
        TuningConfig(canary={"traffic": "service"}),
    ):
        found = tuning_reachability(tuning)
        assert found.passes, found.reason
    assert unreachable_tuning(TuningConfig()) is None


def test_five_windows_under_the_half_point_margin_are_warned_of() -> None:
    config = validate_config({"runtime": RUNTIME, "tuning": {"windows": 5}}, warn=False)
    notes = [n for n in config_warnings(config) if n.startswith("tuning:")]
    assert len(notes) == 1
    assert "cannot pass" in notes[0]
    assert "errors_ratio: with no failures in 320 requests a side" in notes[0]
    assert "tuning.error_margin_ratio 0.0084 or more" in notes[0]


def test_a_rig_that_sets_its_own_error_margin_is_not_warned_of() -> None:
    tuning = {"windows": 5, "error_margin_ratio": 0.05}
    config = validate_config({"runtime": RUNTIME, "tuning": tuning}, warn=False)
    assert not [n for n in config_warnings(config) if n.startswith("tuning:")]


def test_the_demos_tuning_is_reachable(tmp_path: Path) -> None:
    raw = demo_config(
        listen_port=1,
        server_port=2,
        kvpool_port=3,
        canary_port=4,
        state_dir=str(tmp_path),
        webhook_url="http://127.0.0.1:5/hook",
        webhook_secret="s" * 32,
        cpus=(0, 1),
    )
    config = validate_config(raw, warn=False)
    found = tuning_reachability(config.tuning)
    assert found.passes, found.reason
    # Its 160 requests a side could not show the default preemption margin (0.01).
    default = config.tuning.model_copy(update={"preemption_margin_per_request": None})
    assert "preemptions_per_request" in tuning_reachability(default).reason
