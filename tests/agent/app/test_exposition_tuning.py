"""The tuner's families on the agent's /metrics: from trial records, promtool-clean."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from prometheus_client import generate_latest

from kvpilot.agent.app.exposition import build_registry, tuning_families
from kvpilot.dashboards import tuning_metrics
from kvpilot.tuner.trials import trial_from_dict

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "tuning" / "trials.jsonl"


def _text() -> str:
    trials = [trial_from_dict(json.loads(line)) for line in FIXTURE.read_text().splitlines()]
    source = tuning_metrics.FlagSource.CONFIGURED
    live = [tuning_metrics.LiveFlags("vllm", "--kv-cache-memory-bytes 2097152", source)]
    families = tuning_metrics.tuning_families(trials, live)
    registry = build_registry(lambda: (), tuning_families(families))
    return generate_latest(registry).decode()


def test_trials_best_and_live_flags_are_exported() -> None:
    text = _text()
    assert "kvpilot_tuning_best_goodput_tokens_per_second 1805.0" in text
    assert 'kvpilot_live_flags_info{flags="--kv-cache-memory-bytes 2097152",server="vllm",' in text
    assert text.count("kvpilot_tuning_trial_goodput_tokens_per_second{") == 12
    assert 'kvpilot_tuning_trials_total{state="' in text


def test_promtool_finds_no_problem(tmp_path: Path) -> None:
    result = subprocess.run(
        ["promtool", "check", "metrics"],
        input=_text(),
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
