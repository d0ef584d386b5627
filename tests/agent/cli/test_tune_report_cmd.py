"""`kvpilot tune report` draws the study's planner region and marks the stable flags, the
promoted ones when they stand; without a study it says why instead."""

from __future__ import annotations

import re
from pathlib import Path

from typer.testing import CliRunner

from kvpilot.agent.app.parts import tuned_server
from kvpilot.agent.cli.main import app
from kvpilot.agent.cli.tune_report import stable_values
from kvpilot.agent.config import load_config
from kvpilot.agent.config.tuning import TuningConfig
from kvpilot.agent.state.db import Database
from kvpilot.agent.state.store import StateStore
from kvpilot.agent.state.trials import SqliteTrialStore
from kvpilot.agent.tuning.promoted import PROMOTED_FACT, yaml_hash
from kvpilot.agent.tuning.study import build_study
from kvpilot.rig.server import free_port
from tests.agent.sidecar_harness import agent_config, server_spec
from tests.tuner.report.history import history


def _config(tmp_path: Path) -> Path:
    return agent_config(
        tmp_path,
        spec=server_spec(kv_cache_memory_bytes=32 << 20),
        rules={},
        notifiers=[],
        remediation={},
        listen_port=free_port(),
    )


def _knob_map(path: Path, tmp_path: Path) -> str:
    out = tmp_path / "report.html"
    done = CliRunner().invoke(app, ["tune", "report", "--config", str(path), "--output", str(out)])
    assert done.exit_code == 0, done.output
    knobs = re.search(r"<svg [^>]*id='plot-knobs'.*?</svg>", out.read_text("utf-8"), flags=re.S)
    assert knobs is not None
    return knobs.group(0)


def test_the_report_command_shades_the_planner_region_and_marks_the_stable(tmp_path: Path) -> None:
    path = _config(tmp_path)
    db = Database.open(load_config(path).state_dir)
    try:
        store = SqliteTrialStore(db)
        for trial in history():
            store.add(trial)
    finally:
        db.close()
    knobs = _knob_map(path, tmp_path)
    # The test model needs 33 blocks of 32 KiB for one request: the planner refuses less.
    assert "planner: kv_cache_memory_bytes " in knobs and "&lt; 1081344 (one request)" in knobs
    # The configured flags set the KV budget only: a line at 32 MiB, no guessed point.
    assert "stable kv_cache_memory_bytes=3.35544e+07; max_num_seqs: vLLM&#x27;s default" in knobs
    # Promoted flags (under this YAML) are the stable now: a diamond at their values.
    db = Database.open(load_config(path).state_dir)
    try:
        argv = [*load_config(path).runtime.instances[0].argv, "--max-num-seqs", "12"]
        argv[argv.index("--kv-cache-memory-bytes") + 1] = str(16 << 20)
        fact = {"argv": argv, "yaml_sha256": yaml_hash(path), "reason": "trial 2 passed"}
        StateStore(db).set_fact(PROMOTED_FACT, fact, 1.0)
    finally:
        db.close()
    knobs = _knob_map(path, tmp_path)
    assert "<polygon class='stable'" in knobs
    assert "stable kv_cache_memory_bytes=1.67772e+07 max_num_seqs=12" in knobs


def test_the_stable_values_come_from_its_flags(tmp_path: Path) -> None:
    space = build_study(
        tuned_server(load_config(_config(tmp_path))), TuningConfig(), gpu=None
    ).space
    argv = ["vllm", "serve", "m", "--kv-cache-memory-bytes", "64M", "--max-num-seqs", "12"]
    assert stable_values(space, argv) == {"kv_cache_memory_bytes": 64 << 20, "max_num_seqs": 12}
    assert stable_values(space, ["vllm", "serve", "m"]) == {}
