"""`kvpilot tune --dry-run` and the `tuning:` section: what a run would try, from which
settings, and clear errors for settings that cannot work. Nothing is started here."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from kvpilot.agent.app.parts import tuned_server
from kvpilot.agent.cli.main import app
from kvpilot.agent.config import ConfigError, load_config
from kvpilot.agent.tuning.study import build_study, study_suggester
from kvpilot.rig.server import free_port
from tests.agent.sidecar_harness import agent_config, server_spec


def _config(tmp_path: Path, tuning: dict[str, Any] | None = None) -> Path:
    path = agent_config(
        tmp_path,
        spec=server_spec(),
        rules={},
        notifiers=[],
        remediation={},
        listen_port=free_port(),
    )
    if tuning is not None:
        data = yaml.safe_load(path.read_text())
        data["tuning"] = tuning
        path.write_text(yaml.safe_dump(data))
    return path


def _tune(*args: str) -> Any:
    return CliRunner().invoke(app, ["tune", *args], env={"COLUMNS": "200"})


def _planned(output: str) -> list[dict[str, int]]:
    """The numbered lines of a dry run as {knob: value}."""
    rows = []
    for line in output.splitlines():
        if re.match(r"^\d+\. ", line):
            rows.append({k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", line)})
    return rows


def test_dry_run_plans_the_configured_number_of_trials_inside_the_bounds(tmp_path: Path) -> None:
    path = _config(tmp_path, {"trials": 4, "max_num_seqs": 8, "kv_max_bytes": 8 << 20})
    result = _tune("--config", str(path), "--dry-run")
    assert result.exit_code == 0, result.output
    assert "0 past trials told" in result.output
    planned = _planned(result.output)
    assert len(planned) == 4
    for values in planned:
        assert 1 <= values["max_num_seqs"] <= 8
        # The planner's floor: one request of max_model_len (1024 tokens, 32 KiB a block).
        assert 32 * 32 * 1024 <= values["kv_cache_memory_bytes"] <= 8 << 20
    assert "initial point" in result.output


def test_options_override_single_fields_of_the_section(tmp_path: Path) -> None:
    path = _config(tmp_path, {"trials": 4, "max_num_seqs": 8})
    result = _tune("--config", str(path), "--dry-run", "--trials", "2", "--max-seqs", "2")
    assert result.exit_code == 0, result.output
    planned = _planned(result.output)
    assert len(planned) == 2 and all(v["max_num_seqs"] <= 2 for v in planned)


def test_the_study_changes_with_the_workload_and_not_with_the_trial_count(tmp_path: Path) -> None:
    path = _config(tmp_path)

    def study(*args: str) -> str:
        result = _tune("--config", str(path), "--dry-run", *args)
        assert result.exit_code == 0, result.output
        return re.search(r"study (\w+):", result.output).group(1)  # type: ignore[union-attr]

    assert study() == study("--trials", "7")
    assert study() != study("--prompt-len", "100")


def test_a_canary_cpu_list_that_is_not_numbers_is_refused(tmp_path: Path) -> None:
    result = _tune("--config", str(_config(tmp_path)), "--dry-run", "--canary-cpus", "one")
    assert result.exit_code == 2
    assert "not a list of CPU numbers: 'one'" in result.output


def test_a_schedule_must_be_a_crontab_line(tmp_path: Path) -> None:
    path = _config(tmp_path, {"schedule": "every night"})
    with pytest.raises(ConfigError, match=r"tuning\.schedule.*not a crontab line"):
        load_config(path)
    nightly = load_config(_config(tmp_path, {"schedule": "0 3 * * *"}))
    assert nightly.tuning.schedule == "0 3 * * *"


def test_a_schedule_needs_the_local_runtime(tmp_path: Path) -> None:
    path = tmp_path / "k.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "runtime": {"kind": "process", "port": 8000},
                "tuning": {"schedule": "0 3 * * *"},
            }
        )
    )
    with pytest.raises(ConfigError, match=r"tuning\.schedule needs the local runtime"):
        load_config(path)


def test_the_lower_ends_narrow_the_search(tmp_path: Path) -> None:
    tuning = {
        "trials": 5,
        "kv_min_bytes": 8 << 20,
        "kv_max_bytes": 16 << 20,
        "min_num_seqs": 12,
        "max_num_seqs": 16,
    }
    result = _tune("--config", str(_config(tmp_path, tuning)), "--dry-run")
    assert result.exit_code == 0, result.output
    planned = _planned(result.output)
    assert len(planned) == 5
    for values in planned:
        assert 8 << 20 <= values["kv_cache_memory_bytes"] <= 16 << 20
        assert 12 <= values["max_num_seqs"] <= 16


def test_ranges_that_are_empty_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="min_num_seqs must be below max_num_seqs"):
        load_config(_config(tmp_path, {"min_num_seqs": 8, "max_num_seqs": 8}))
    # Below one request of max_model_len (1 MiB here) nothing can start: said before a trial.
    result = _tune("--config", str(_config(tmp_path)), "--dry-run", "--kv-max-bytes", "65536")
    assert result.exit_code == 2
    assert "leaves no room above the planner's minimum" in result.output


def test_the_windows_flag_overrides_the_yaml_and_the_run_says_how_many(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvpilot.agent.cli import tune_cmd

    studied: list[int] = []
    real_build_study = tune_cmd.build_study

    def recording_build_study(cfg: Any, tuning: Any, *args: Any, **kwargs: Any) -> Any:
        studied.append(tuning.windows)  # what make_session turns into RolloutSettings.windows
        return real_build_study(cfg, tuning, *args, **kwargs)

    monkeypatch.setattr(tune_cmd, "build_study", recording_build_study)
    path = _config(tmp_path, {"trials": 2, "windows": 3})
    from_yaml = _tune("--config", str(path), "--dry-run")
    assert from_yaml.exit_code == 0, from_yaml.output
    assert "each trial: 3 replayed windows a side, judged together (tuning.windows)" in (
        from_yaml.output
    )
    flagged = _tune("--config", str(path), "--dry-run", "--windows", "7")
    assert flagged.exit_code == 0, flagged.output
    assert "each trial: 7 replayed windows a side, judged together (--windows)" in flagged.output
    assert studied == [3, 7]


def test_the_windows_flag_refuses_fewer_than_one_and_more_than_the_model_allows(
    tmp_path: Path,
) -> None:
    path = str(_config(tmp_path))
    for bad in ("0", "-2", "257"):
        result = _tune("--config", path, "--dry-run", "--windows", bad)
        assert result.exit_code == 2, result.output
        assert f"a trial observes 1 to 256 windows a side, not {bad}" in result.output
        assert "Traceback" not in result.output


def test_the_windows_flag_is_in_the_help() -> None:
    result = _tune("--help")
    assert result.exit_code == 0
    assert "--windows" in result.output
    assert "Replayed windows a side per trial, 1 to 256 [64]" in " ".join(result.output.split())


def test_dry_run_plans_with_the_suggester_the_configuration_names(tmp_path: Path) -> None:
    tuning = {"trials": 3, "max_num_seqs": 8, "kv_max_bytes": 8 << 20, "suggester": "grid"}
    path = _config(tmp_path, tuning)
    result = _tune("--config", str(path), "--dry-run")
    assert result.exit_code == 0, result.output
    config = load_config(path)
    suggester = study_suggester(build_study(tuned_server(config), config.tuning, gpu=None))
    expected = [dict(suggester.ask().values) for _ in range(3)]
    assert _planned(result.output) == expected
