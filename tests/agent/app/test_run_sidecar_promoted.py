"""Which flags `kvpilot run` starts the stable server with: the tuner's promoted ones while
the configured argv they were promoted under is unchanged (as loaded), else the configured
ones."""

from __future__ import annotations

from pathlib import Path

import yaml

from kvpilot.agent.app.compose import promoted_argv
from kvpilot.agent.app.parts import build_runtime
from kvpilot.agent.config import load_config
from kvpilot.agent.state import StateStore
from kvpilot.agent.tuning.promoted import PROMOTED_FACT, yaml_hash
from kvpilot.rig.server import free_port
from tests.agent.sidecar_harness import agent_config, server_spec


def _setup(tmp_path: Path):
    path = agent_config(
        tmp_path,
        spec=server_spec(),
        rules={},
        notifiers=[],
        remediation={},
        listen_port=free_port(),
    )
    config = load_config(path)
    configured = tuple(config.runtime.instances[0].argv)
    promoted = (*configured, "--max-num-seqs", "8")
    return path, config, configured, promoted


def _started_with(config, store, sha) -> tuple[str, ...]:
    (instance,) = build_runtime(config, promoted_argv(config, store, sha)).instances()
    return tuple(instance.argv)


def test_promoted_flags_hold_while_the_yaml_is_unchanged(tmp_path: Path) -> None:
    path, config, configured, promoted = _setup(tmp_path)
    with StateStore.open(config.state_dir) as store:
        assert _started_with(config, store, yaml_hash(path)) == configured  # nothing promoted
        fact = {"argv": list(promoted), "yaml_sha256": yaml_hash(path), "reason": "trial 3"}
        store.set_fact(PROMOTED_FACT, fact, 0.0)
        assert _started_with(config, store, yaml_hash(path)) == promoted
        # A comment edited in the YAML leaves the configured argv as loaded: the promotion
        # holds. Without the configuration's hash the configured flags run.
        path.write_text(path.read_text() + "\n# edited\n")
        assert _started_with(config, store, yaml_hash(path)) == promoted
        assert _started_with(config, store, None) == configured
        # A changed configured argv wins over the promotion.
        data = yaml.safe_load(path.read_text())
        data["runtime"]["instances"][0]["argv"].append("--enforce-eager")
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        changed = load_config(path)
        assert _started_with(changed, store, yaml_hash(path)) == (*configured, "--enforce-eager")
