"""The study a re-tune stands on: the fingerprint holds the vLLM version, the ladder's
lookup and `kvpilot tune --dry-run` build the study of the version tuning ran on."""

from __future__ import annotations

from pathlib import Path

from kvpilot.agent.app.parts import server_of, tuned_server
from kvpilot.agent.state import StateStore
from kvpilot.agent.tuning.ground import Ground, GroundStore


def test_the_fingerprint_holds_the_version_and_keeps_old_studies() -> None:
    from kvpilot.tuner.problem.fingerprint import fingerprint
    from kvpilot.tuner.problem.objective import Slo

    slo = Slo(ttft_p95_s=1.0, inter_token_p95_s=0.1)
    old = fingerprint("m", ["vllm", "serve", "m"], "w", slo)
    assert fingerprint("m", ["vllm", "serve", "m"], "w", slo, vllm_version=None) == old
    v1 = fingerprint("m", ["vllm", "serve", "m"], "w", slo, vllm_version="0.9.1")
    v2 = fingerprint("m", ["vllm", "serve", "m"], "w", slo, vllm_version="0.10.0")
    assert len({old, v1, v2}) == 3


def test_the_ladders_study_carries_the_version_tuning_ran_on(tmp_path: Path) -> None:
    """A run records its trials under the fingerprint with the server's version; the
    ladder's lookup of validated trials must build that same study, or it finds none."""
    from kvpilot.agent.config import load_config
    from kvpilot.agent.tuning.best import config_studies
    from kvpilot.agent.tuning.study import Study, build_study
    from kvpilot.rig.server import free_port
    from tests.agent.sidecar_harness import agent_config, server_spec

    path = agent_config(
        tmp_path,
        spec=server_spec(),
        rules={},
        notifiers=[],
        remediation={},
        listen_port=free_port(),
    )
    config = load_config(path)
    argv = tuple(config.runtime.instances[0].argv)
    versions = {"vllm": "0.10.0"}
    ran = build_study(tuned_server(config), config.tuning, None, vllm_version="0.10.0")
    unversioned = build_study(tuned_server(config), config.tuning, None)
    assert ran.fingerprint != unversioned.fingerprint
    studies = config_studies(config.tuning, server_of(config), lambda name: versions.get(name))
    looked_up = studies("vllm", argv)
    assert isinstance(looked_up, Study) and looked_up.fingerprint == ran.fingerprint
    versions["vllm"] = "0.11.0"  # upgraded: another study, not the cached one
    upgraded = studies("vllm", argv)
    assert isinstance(upgraded, Study) and upgraded.fingerprint != ran.fingerprint


def test_a_dry_run_tells_the_trials_of_the_last_runs_vllm_version(tmp_path: Path) -> None:
    """Trials recorded on vLLM 0.10.0 are the study's history for `kvpilot tune --dry-run`,
    which reads the version the last run stood on (no server needs to run for it)."""
    from typer.testing import CliRunner

    from kvpilot.agent.cli.main import app
    from kvpilot.agent.config import load_config
    from kvpilot.agent.state.trials import SqliteTrialStore
    from kvpilot.agent.tuning.study import build_study
    from kvpilot.rig.server import free_port
    from kvpilot.tuner.problem.objective import TrialOutcome, TrialResult
    from kvpilot.tuner.trials import Trial, TrialState
    from tests.agent.sidecar_harness import agent_config, server_spec

    path = agent_config(
        tmp_path,
        spec=server_spec(),
        rules={},
        notifiers=[],
        remediation={},
        listen_port=free_port(),
    )
    config = load_config(path)
    study = build_study(tuned_server(config), config.tuning, None, vllm_version="0.10.0")
    config.state_dir.mkdir(parents=True)
    with StateStore.open(config.state_dir) as store:
        values = (("kv_cache_memory_bytes", 32 << 20), ("max_num_seqs", 8))
        trial = Trial(
            "t1",
            study.fingerprint,
            1,
            values,
            TrialState.COMPLETE,
            1.0,
            2.0,
            result=TrialResult(TrialOutcome.FEASIBLE, 150.0, 32 << 20, None),
        )
        SqliteTrialStore(store.db).add(trial)

    def told() -> str:
        result = CliRunner().invoke(app, ["tune", "--config", str(path), "--dry-run"])
        assert result.exit_code == 0, result.output
        return result.output

    assert "0 past trials told" in told()  # no run recorded: the study without a version
    with StateStore.open(config.state_dir) as store:
        GroundStore(store.db).save("vllm", Ground("0.10.0", None, None), 3.0)
    out = told()
    assert f"study {study.fingerprint}: 1 past trials told" in out, out
