"""Configured or promoted flags, decided once: what `kvpilot run` starts, what `kvpilot tune`
starts, and how the live-flags metric labels what runs all follow `live_argv`."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import yaml

from kvpilot.agent.app.compose import promoted_argv
from kvpilot.agent.app.parts import tuned_server
from kvpilot.agent.config import AgentConfig, load_config
from kvpilot.agent.runtimes.local import LocalRuntime
from kvpilot.agent.state import StateStore
from kvpilot.agent.tuning.local.factory import local_adapter, stable_runtime
from kvpilot.agent.tuning.promoted import (
    LiveArgv,
    Why,
    live_argv,
    running_flags_source,
    yaml_hash,
)

CONFIGURED = ("vllm", "serve", "/m", "--max-num-seqs", "4")
PROMOTED = ("vllm", "serve", "/m", "--max-num-seqs", "16")
FACT = {"argv": list(PROMOTED), "yaml_sha256": "sha-1", "reason": "trial 3"}


@pytest.mark.parametrize(
    ("promoted", "sha", "expected"),
    [
        (None, "sha-1", LiveArgv(CONFIGURED, Why.CONFIGURED)),
        (FACT, "sha-1", LiveArgv(PROMOTED, Why.PROMOTED, "trial 3")),
        (FACT, "sha-2", LiveArgv(CONFIGURED, Why.YAML_CHANGED)),
        (FACT, None, LiveArgv(CONFIGURED, Why.CONFIGURED)),  # no YAML: the configuration's
    ],
)
def test_live_argv(promoted: dict | None, sha: str | None, expected: LiveArgv) -> None:
    assert live_argv(CONFIGURED, promoted, sha) == expected


def test_how_the_decision_reads() -> None:
    assert live_argv(CONFIGURED, FACT, "sha-1").describe() == "promoted (trial 3)"
    changed = live_argv(CONFIGURED, FACT, "sha-2")
    assert changed.describe() == "configured (its argv changed since the last promotion)"
    assert (changed.source, changed.source_of(CONFIGURED)) == ("configured", "configured")
    # Flags the tuner put on the server since (a sequential trial) are not the configured ones.
    assert changed.source_of(PROMOTED) == "promoted"


def _config(tmp_path: Path) -> tuple[Path, AgentConfig]:
    instances = [
        {"name": "a", "argv": list(CONFIGURED)},
        {"name": "b", "argv": [*CONFIGURED, "--port", "8001"]},  # a second stable instance
    ]
    data = {
        "state_dir": str(tmp_path / "state"),
        "runtime": {"kind": "local", "instances": instances},
    }
    path = tmp_path / "kvpilot.yaml"
    path.write_text(yaml.safe_dump(data))
    return path, load_config(path)


def test_run_tune_and_the_metric_agree(tmp_path: Path) -> None:
    path, config = _config(tmp_path)
    b_argv = tuple(config.runtime.instances[1].argv)
    with StateStore.open(config.state_dir) as store:
        # `kvpilot run` starts: nothing promoted yet.
        assert promoted_argv(config, store, yaml_hash(path)) == {"a": CONFIGURED}
        assert running_flags_source(config.runtime, store, "a", CONFIGURED) == "configured"

        # The tuner promotes through the adapter, which records the promotion.
        async def restart(argv: tuple[str, ...], reason: str, restore: bool) -> None:
            return None

        runtime = LocalRuntime([], config.state_dir / "logs")
        adapter = local_adapter(
            tuned_server(config),
            runtime,
            store.db,
            tuning=config.tuning,
            log_dir=config.state_dir / "logs",
            config_sha256=yaml_hash(path),
            restart_stable=restart,
        )
        asyncio.run(adapter.set_stable(PROMOTED, reason="trial 3", ready_timeout_s=1.0))
        assert running_flags_source(config.runtime, store, "a", PROMOTED) == "promoted"
        # The promotion is the tuned instance's: the other stable instance is as configured.
        assert running_flags_source(config.runtime, store, "b", b_argv) == "configured"

        # The next `kvpilot run` and `kvpilot tune` both start the promoted flags.
        assert promoted_argv(config, store, yaml_hash(path)) == {"a": PROMOTED}
        _, live = stable_runtime(
            tuned_server(config), config.state_dir / "logs", store.db, yaml_hash(path)
        )
        assert (live.argv, live.describe()) == (PROMOTED, "promoted (trial 3)")

        # A comment added to the YAML changes no flag: the promotion holds.
        path.write_text(path.read_text() + "# edited\n")
        assert promoted_argv(config, store, yaml_hash(path)) == {"a": PROMOTED}
        # The configured argv is edited: both go back to it, and the metric says so.
        path.write_text(path.read_text().replace("/m", "/other-model"))
        config = load_config(path)
        edited = ("vllm", "serve", "/other-model", "--max-num-seqs", "4")
        assert promoted_argv(config, store, yaml_hash(path)) == {"a": edited}
        _, live = stable_runtime(
            tuned_server(config), config.state_dir / "logs", store.db, yaml_hash(path)
        )
        assert live.why is Why.YAML_CHANGED and live.argv == edited
        assert running_flags_source(config.runtime, store, "a", edited) == "configured"


def test_a_server_kvpilot_does_not_start_runs_its_own_flags(tmp_path: Path) -> None:
    config = AgentConfig.model_validate(
        {
            "state_dir": str(tmp_path / "state"),
            "runtime": {"kind": "process", "port": 8000},
        }
    )
    with StateStore.open(config.state_dir) as store:
        store.set_fact("tuning.promoted", FACT, 0.0)
        assert promoted_argv(config, store, "sha-1") == {}
        assert running_flags_source(config.runtime, store, "vllm", PROMOTED) == "configured"


KEYED = ("vllm", "serve", "/m", "--api-key", "sk-promoted-1", "--max-num-seqs", "4")
KEYED_PROMOTED = (*KEYED[:-1], "16")


def test_a_promotion_is_stored_masked_and_runs_with_the_configured_key(tmp_path: Path) -> None:
    instances = [{"name": "a", "argv": list(KEYED)}]
    data = {
        "state_dir": str(tmp_path / "state"),
        "runtime": {"kind": "local", "instances": instances},
    }
    path = tmp_path / "kvpilot.yaml"
    path.write_text(yaml.safe_dump(data))
    config = load_config(path)
    restarted: list[tuple[str, ...]] = []

    async def restart(argv: tuple[str, ...], reason: str, restore: bool) -> None:
        restarted.append(argv)

    with StateStore.open(config.state_dir) as store:
        runtime = LocalRuntime([], config.state_dir / "logs")
        adapter = local_adapter(
            tuned_server(config),
            runtime,
            store.db,
            tuning=config.tuning,
            log_dir=config.state_dir / "logs",
            config_sha256=yaml_hash(path),
            restart_stable=restart,
        )
        asyncio.run(adapter.set_stable(KEYED_PROMOTED, reason="trial 3", ready_timeout_s=1.0))
        stored = store.get_fact("tuning.promoted")["argv"]
        assert "sk-promoted-1" not in stored and stored[4] == "***"
        # What runs next has the key the YAML gives it.
        assert promoted_argv(config, store, yaml_hash(path)) == {"a": KEYED_PROMOTED}
        # An argv read back from the journal (masked) is restarted with the real key.
        masked = (*KEYED_PROMOTED[:4], "***", *KEYED_PROMOTED[5:])
        asyncio.run(adapter.set_stable(masked, reason="recovery", ready_timeout_s=1.0))
        assert restarted == [KEYED_PROMOTED, KEYED_PROMOTED]


def test_a_masked_promotion_without_its_key_in_the_yaml_runs_the_configuration() -> None:
    fact = {"argv": ["vllm", "serve", "/m", "--api-key", "***"], "yaml_sha256": "sha-1"}
    assert live_argv(CONFIGURED, fact, "sha-1") == LiveArgv(CONFIGURED, Why.CONFIGURED)
