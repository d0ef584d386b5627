"""Promoted flags win until the server's configured argv changes, as loaded: a comment edited
in the YAML keeps them, and a `KVPILOT_*` override of the argv (the model included) is
obeyed, never hidden behind an older promotion."""

from __future__ import annotations

from pathlib import Path

import yaml

from kvpilot.agent.app.compose import promoted_argv
from kvpilot.agent.config.load import load_config
from kvpilot.agent.state import StateStore
from kvpilot.agent.tuning.promoted import PROMOTED_FACT, configured_hash

CONFIGURED = ["vllm", "serve", "/models/a", "--max-num-seqs", "4"]
PROMOTED = ["vllm", "serve", "/models/a", "--max-num-seqs", "16"]


def _write(path: Path, state: Path, comment: str = "") -> None:
    data = {
        "state_dir": str(state),
        "runtime": {"kind": "local", "instances": [{"name": "a", "argv": CONFIGURED}]},
    }
    path.write_text(comment + yaml.safe_dump(data))


def _live(path: Path, environ: dict[str, str]) -> tuple[str, ...]:
    config = load_config(path, environ)
    with StateStore.open(config.state_dir) as store:
        return promoted_argv(config, store, configured_hash(config.runtime))["a"]


def test_a_comment_edit_keeps_the_promotion_and_an_argv_override_ends_it(tmp_path: Path) -> None:
    path, state = tmp_path / "kvpilot.yaml", tmp_path / "state"
    _write(path, state)
    config = load_config(path, {})
    with StateStore.open(state) as store:
        fact = {
            "argv": PROMOTED,
            "yaml_sha256": configured_hash(config.runtime),
            "reason": "trial 1",
        }
        store.set_fact(PROMOTED_FACT, fact, 0.0)
    assert _live(path, {}) == tuple(PROMOTED)

    _write(path, state, comment="# tuned nightly; ask the platform team\n")
    assert _live(path, {}) == tuple(PROMOTED), "a comment dropped the tuned flags"

    override = {"KVPILOT_RUNTIME__INSTANCES__0__ARGV": '["vllm", "serve", "/models/b"]'}
    assert _live(path, override) == ("vllm", "serve", "/models/b"), "the override was ignored"
    assert _live(path, {}) == tuple(PROMOTED)  # the override gone, the promotion holds again
