"""`remediation.dry_run` applied by a reload: the switch's configuration layer moves at once,
and the rest of the remediation section still waits for a restart."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvpilot.agent.app.reload import Reloader
from kvpilot.agent.config import AgentConfig, NotifierConfig
from kvpilot.agent.mode import LiveMode, Mode, ModeSource
from kvpilot.agent.notify import Notifier
from kvpilot.agent.rules.config import RulesConfig
from kvpilot.agent.state import StateStore


class _Loop:
    def use_notifiers(
        self, configs: tuple[NotifierConfig, ...], notifiers: Mapping[str, Notifier]
    ) -> None:
        pass

    def use_rules(self, rules: RulesConfig) -> None:
        pass


def _config(tmp_path: Path, **remediation: Any) -> AgentConfig:
    return AgentConfig.model_validate(
        {
            "state_dir": str(tmp_path / "state"),
            "runtime": {"kind": "attach", "servers": [{"name": "vllm", "url": "http://x:9"}]},
            "remediation": remediation,
        }
    )


def test_dry_run_is_applied_by_a_reload(tmp_path: Path) -> None:
    running = _config(tmp_path)
    running.state_dir.mkdir(parents=True)
    live = LiveMode(Mode.ARMED)
    files = iter([_config(tmp_path, dry_run=True), _config(tmp_path, dry_run=False, cooldown_s=5)])
    with StateStore.open(running.state_dir) as store:
        reloader = Reloader(
            lambda: next(files), running, _Loop(), lambda c: {}, audit=store, mode=live
        )

        first = asyncio.run(reloader.reload())
        assert first.applied == ("remediation.dry_run",) and first.needs_restart == ()
        assert (live.current().mode, live.current().source) == (Mode.DRY_RUN, ModeSource.CONFIG)

        # A layer above it still wins; the file's word is kept beneath.
        live.set(ModeSource.NAMESPACE, Mode.PAUSED)
        second = asyncio.run(reloader.reload())
        assert second.applied == ("remediation.dry_run",)
        assert second.needs_restart == ("remediation",)  # the cooldown waits for a restart
        assert live.current().mode is Mode.PAUSED
        live.set(ModeSource.NAMESPACE, None)
        assert live.current().mode is Mode.ARMED


def test_the_mode_in_force_is_exported_as_a_state_set() -> None:
    from prometheus_client import generate_latest

    from kvpilot.agent.app.exposition import build_registry, sidecar_families
    from kvpilot.agent.tick.views import SidecarCounters

    counters = SidecarCounters((), None, (), (), (), False, mode=("paused", "deployment"))
    registry = build_registry(lambda: (), sidecar_families(lambda: counters))
    text = generate_latest(registry).decode()
    assert 'kvpilot_mode{mode="paused",source="deployment"} 1.0' in text
    assert 'kvpilot_mode{mode="armed",source="deployment"} 0.0' in text
    assert 'kvpilot_mode{mode="dry-run",source="deployment"} 0.0' in text
