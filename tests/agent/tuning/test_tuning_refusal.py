"""A tuning run whose settings cannot pass even a canary equal to the stable is refused
before it starts, with the reason: through `run_tuning` (no lease, no recovery, no session),
`kvpilot tune` (exit 1 before any server starts; a dry run warns and plans) and the schedule
(audited as skipped). Nothing is started here: the tuner is a recording double."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from kvpilot.agent.app.parts import tuned_server
from kvpilot.agent.cli.main import app
from kvpilot.agent.config import load_config
from kvpilot.agent.config.tuning import TuningConfig
from kvpilot.agent.mode import Mode, ModeSetting, ModeSource
from kvpilot.agent.state import StateStore
from kvpilot.agent.tuning.entry import (
    Recovery,
    TuningRefused,
    refuse_unreachable,
    run_tuning,
    study_reachability,
)
from kvpilot.agent.tuning.schedule import scheduled_tuning
from kvpilot.agent.tuning.study import Study, build_study
from kvpilot.rig.server import free_port
from kvpilot.tuner.session import TuningBlocked, TuningSession
from tests.agent.sidecar_harness import agent_config, server_spec

# Five windows of 64 requests under the half-point error margin: 320 requests a side.
UNREACHABLE = {"windows": 5}


def _config_path(tmp_path: Path, tuning: dict[str, Any] | None = None) -> Path:
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


def _study(tmp_path: Path, **tuning: Any) -> Study:
    config = load_config(_config_path(tmp_path), warn=False)
    return build_study(tuned_server(config), TuningConfig(**tuning), gpu=None)


class RecordingTuner:
    """A Tuner double that records what a run asked of it; its lease is held elsewhere, so a
    run that gets that far stops there."""

    def __init__(self, study: Study) -> None:
        self._study = study
        self.asked: list[str] = []

    @property
    def name(self) -> str:
        return "stable"

    @property
    def start_wait_s(self) -> float:
        return 0.0

    async def study(self, tuning: TuningConfig | None = None) -> Study:
        return self._study

    @contextlib.asynccontextmanager
    async def _held(self) -> AsyncIterator[None]:
        self.asked.append("lease")
        raise TuningBlocked("the lease is held by another tuner")
        yield  # an async generator, for the context manager

    def lease(self, *, wait_s: float = 0.0) -> contextlib.AbstractAsyncContextManager[None]:
        return self._held()

    async def recover(self, study: Study) -> Recovery:
        self.asked.append("recover")
        return Recovery()

    def session(self, study: Study, *, on_progress: Any = None) -> TuningSession:
        raise AssertionError("no session may start")

    def stable_argv(self) -> tuple[str, ...]:
        return tuple(self._study.configured_argv)

    def hand_over(self) -> None:
        self.asked.append("hand_over")


def test_the_shipped_tuning_defaults_are_reachable(tmp_path: Path) -> None:
    study = _study(tmp_path)
    found = study_reachability(study)
    assert found.passes, found.reason
    refuse_unreachable(study)  # no refusal


def test_run_tuning_refuses_before_the_lease_with_the_reason(tmp_path: Path) -> None:
    tuner = RecordingTuner(_study(tmp_path, **UNREACHABLE))
    with pytest.raises(TuningRefused) as refused:
        asyncio.run(run_tuning(tuner, tuner._study, on_recovered=lambda _: None))
    assert tuner.asked == []  # neither the lease nor the recovery
    reason = str(refused.value)
    assert reason.startswith("tuning refused: cannot pass: an equal canary")
    assert "errors_ratio: with no failures in 320 requests a side" in reason
    assert "tuning.windows 15 or more" in reason


def test_a_reachable_run_goes_on_to_the_lease(tmp_path: Path) -> None:
    tuner = RecordingTuner(_study(tmp_path, windows=5, error_margin_ratio=0.05))
    with pytest.raises(TuningBlocked, match="held by another tuner") as blocked:
        asyncio.run(run_tuning(tuner, tuner._study, on_recovered=lambda _: None))
    assert not isinstance(blocked.value, TuningRefused)
    assert tuner.asked == ["lease"]


def test_a_scheduled_run_that_cannot_pass_is_audited_as_skipped(tmp_path: Path) -> None:
    tuner = RecordingTuner(_study(tmp_path, **UNREACHABLE))

    class Quiet:
        def in_progress(self) -> bool:
            return False

        def cooling_down(self, instance: str) -> str | None:
            return None

    with StateStore.open(tmp_path / "state") as store:
        tuning = scheduled_tuning(
            tuner,
            "0 3 * * *",
            Quiet(),
            store,
            mode=lambda: ModeSetting(Mode.ARMED, ModeSource.CONFIG),
        )

        async def main() -> str:
            tuning._started = True  # the start-up's recovery is not what this test is about
            return await tuning.fire()

        said = asyncio.run(main())
        audits = [(a.decision, a.reason) for a in store.audit_records()]
    assert said.startswith("skipped: tuning refused: cannot pass"), said
    assert audits[0][0] == "skipped"
    assert "tuning.windows 15 or more" in audits[0][1]
    assert "lease" not in tuner.asked


def _tune(*args: str) -> Any:
    return CliRunner().invoke(app, ["tune", *args], env={"COLUMNS": "200"})


def test_kvpilot_tune_exits_with_the_reason_before_any_server_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvpilot.agent.cli import tune_cmd

    def no_state(*_: object, **__: object) -> None:
        raise AssertionError("the run went past the refusal")

    monkeypatch.setattr(tune_cmd, "open_state_or_exit", no_state)  # the step before any start
    path = _config_path(tmp_path, UNREACHABLE)
    result = _tune("--config", str(path))
    assert result.exit_code == 1, result.output
    assert "kvpilot tune: tuning refused: cannot pass" in result.output
    assert "tuning.windows 15 or more" in result.output
    assert "Traceback" not in result.output


def test_a_dry_run_warns_and_still_plans(tmp_path: Path) -> None:
    path = _config_path(tmp_path, {**UNREACHABLE, "trials": 2})
    result = _tune("--config", str(path), "--dry-run")
    assert result.exit_code == 0, result.output
    assert "warning: tuning refused: cannot pass" in result.output
    assert "0 past trials told" in result.output
