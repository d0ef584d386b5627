"""Held canaries through the control API: the real `api_routes` and `HeldTrials` over a real
SQLite state store, the release run by a real `TuningSession` against the in-memory runtime
test double (no vLLM starts); the CLI client against the same app."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import SecretStr
from rich.console import Console

from kvpilot.agent.app.api import api_routes
from kvpilot.agent.app.parts import build_runtime, control_ports
from kvpilot.agent.cli.tune_cmd import roll_back_held
from kvpilot.agent.state import StateStore
from kvpilot.agent.state.trials import SqliteRolloutJournal, SqliteTrialStore
from kvpilot.agent.tuning.held import HeldTrials, ReleaseRefused
from kvpilot.tuner.rollout.canary import (
    Phase,
    Release,
    RolloutSettings,
    Strategy,
    TrialRollout,
)
from kvpilot.tuner.session import TuningSession
from kvpilot.tuner.suggest import GridSuggester
from kvpilot.tuner.trials import new_trial
from tests.agent.quiet_sidecar import attach_config, quiet_sidecar
from tests.tuner.rollout.test_canary import RIG, SLO, STABLE, InMemoryTunerRuntime, ScriptedObserver
from tests.tuner.rollout.test_held_release import HOLD
from tests.tuner.test_session import SPACE

TOKEN = "held-token-7f3c"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class HeldRig:
    """One held trial in a real state database, and a tuner whose session releases it."""

    def __init__(self, store: StateStore) -> None:
        self.journal, self.trials = SqliteRolloutJournal(store.db), SqliteTrialStore(store.db)
        self.runtime = InMemoryTunerRuntime(self.journal)  # type: ignore[arg-type]
        self.observer = ScriptedObserver(self.runtime)
        self.clock = itertools.count(1000.0)
        self.settings = RolloutSettings(slo=SLO, **{**RIG, **HOLD})  # type: ignore[arg-type]
        self.name = "vllm"
        self.start_wait_s = 0.0

    def wall(self) -> float:
        return float(next(self.clock))

    async def hold(self, trial_id: str = "t1") -> None:
        trial = new_trial(trial_id, "study", 1, {"kv_cache_memory_bytes": 1}, 0.0)
        self.trials.add(trial)
        rollout = TrialRollout(
            self.runtime,
            self.observer,
            self.trials,
            self.journal,
            self.settings,
            wall_clock=self.wall,
        )
        assert (await rollout.run(trial, STABLE, Strategy.PARALLEL)).held

    # --- the Tuner protocol, as HeldTrials uses it ---
    async def study(self) -> None:
        return None

    @contextlib.asynccontextmanager
    async def lease(self, *, wait_s: float = 0.0) -> AsyncIterator[None]:
        yield

    def session(self, study: object, **_: Any) -> TuningSession:
        return TuningSession(
            space=SPACE,
            suggester=GridSuggester(SPACE),
            store=self.trials,
            journal=self.journal,
            runtime=self.runtime,
            observer=self.observer,
            fingerprint="study",
            settings=self.settings,
            strategy=Strategy.PARALLEL,
            wall_clock=self.wall,
        )


class Api:
    def __init__(
        self, client: httpx.AsyncClient, rig: HeldRig, held: HeldTrials, store: StateStore
    ):
        self.client, self.rig, self.held, self.store = client, rig, held, store

    async def settled(self, trial_id: str, deadline_s: float = 10.0) -> Phase:
        """The trial's phase once its background release has ended (a final phase)."""
        loop = asyncio.get_running_loop()
        end = loop.time() + deadline_s
        while loop.time() < end:
            record = self.rig.journal.get(trial_id)
            if record is not None and record.phase.final and record.phase is not Phase.HELD:
                return record.phase
            await asyncio.sleep(0.01)
        raise AssertionError(f"trial {trial_id} not released within {deadline_s} s")


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[Api]:
    config = attach_config(tmp_path)
    with StateStore.open(config.state_dir) as store:
        runtime = build_runtime(config)
        sidecar = quiet_sidecar(config, store, runtime)
        rig = HeldRig(store)
        await rig.hold()
        held = HeldTrials(rig, store, hold_timeout_s=3600.0, wall_clock=rig.wall)  # type: ignore[arg-type]
        ports = dataclasses.replace(control_ports(config, sidecar), held=held)
        from starlette.applications import Starlette

        app = Starlette(routes=api_routes(ports, SecretStr(TOKEN)))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://kvpilot") as client:
            yield Api(client, rig, held, store)
        await sidecar.aclose()


async def test_held_trials_are_listed_and_promoted_once_through_the_api(api: Api) -> None:
    listed = (await api.client.get("/api/v1/tuning/held")).json()["held"]
    assert [(h["trial_id"], h["number"]) for h in listed] == [("t1", 1)]
    assert listed[0]["rolled_back_at_wall_s"] == listed[0]["held_since_wall_s"] + 3600.0
    body = {"action": "promote", "reason": "latency fine", "requested_by": "alice"}
    answer = await api.client.post("/api/v1/tuning/held/t1", json=body, headers=AUTH)
    assert answer.status_code == 202, answer.text
    assert await api.settled("t1") is Phase.PROMOTED
    assert api.rig.runtime.canary is None and api.rig.runtime.restores == [False]
    again = await api.client.post("/api/v1/tuning/held/t1", json=body, headers=AUTH)
    assert again.status_code == 200, again.text  # a repeat: answered as it stands
    assert again.json()["release"]["changed"] is False
    assert "released for promotion by alice: latency fine" in again.json()["release"]["reason"]
    other = {**body, "action": "rollback"}
    refused = await api.client.post("/api/v1/tuning/held/t1", json=other, headers=AUTH)
    assert refused.status_code == 409 and "is promoted, not held" in refused.json()["error"]
    assert (await api.client.get("/api/v1/tuning/held")).json()["held"] == []
    decisions = [r.decision for r in api.store.audit_records() if r.action == "tuning-hold"]
    assert decisions[:2] == ["promoted", "promote-requested"]  # newest first


@pytest.mark.parametrize(
    ("path", "body", "status", "says"),
    [
        ("t1", {"action": "merge", "reason": "x"}, 422, "action"),
        ("t1", {"action": "promote", "reason": 5}, 422, "reason"),
        ("t1", {"action": "promote", "reason": ""}, 422, "reason"),
        ("t1", {"action": "promote", "reason": "x" * 501}, 422, "reason"),
        ("t1", {"action": "promote", "reason": "x", "force": True}, 422, "force"),
        ("t1", ["promote"], 422, "invalid"),
        ("nope", {"action": "rollback", "reason": "x"}, 404, "no trial 'nope'"),
        ("n" * 300, {"action": "rollback", "reason": "x"}, 404, "no trial"),
    ],
)
async def test_hostile_releases_get_clear_errors_and_change_nothing(
    api: Api, path: str, body: Any, status: int, says: str
) -> None:
    answer = await api.client.post(f"/api/v1/tuning/held/{path}", json=body, headers=AUTH)
    assert answer.status_code == status, answer.text
    assert says in answer.text and "Traceback" not in answer.text
    record = api.rig.journal.get("t1")
    assert record is not None and record.phase is Phase.HELD and api.rig.runtime.canary == STABLE


async def test_a_release_needs_the_token(api: Api) -> None:
    body = {"action": "rollback", "reason": "x"}
    answer = await api.client.post("/api/v1/tuning/held/t1", json=body)
    assert answer.status_code == 401
    assert api.rig.journal.get("t1").phase is Phase.HELD  # type: ignore[union-attr]


async def test_a_hold_past_its_timeout_is_rolled_back_and_audited_while_held(api: Api) -> None:
    assert await api.held.watch() == []  # not yet: audited as held, with its deadline
    (noted,) = [r for r in api.store.audit_records() if r.decision == "held"]
    assert "kvpilot tuning release t1 --promote|--rollback" in noted.reason
    api.rig.clock = itertools.count(10_000.0)  # past the hour's hold
    (done,) = await api.held.watch()
    assert done.phase is Phase.ROLLED_BACK and api.rig.runtime.canary is None
    assert "no review within the hold's 3600 s" in (done.reason or "")


async def test_a_release_is_refused_while_the_schedules_guard_is_taken(api: Api) -> None:
    guard = asyncio.Lock()  # the schedule's: its recovery, runs and sweeps
    held = HeldTrials(
        api.rig,  # type: ignore[arg-type]
        api.store,
        hold_timeout_s=3600.0,
        guard=guard,
        wall_clock=api.rig.wall,
    )
    async with guard:
        with pytest.raises(ReleaseRefused) as refused:
            held.check("t1", Release.PROMOTE)
        assert refused.value.status == 409
        with pytest.raises(ReleaseRefused):
            await held.release("t1", Release.ROLLBACK, by="bob", reason="not now")
    assert api.rig.journal.get("t1").phase is Phase.HELD  # type: ignore[union-attr]
    done = await held.release("t1", Release.ROLLBACK, by="bob", reason="after the run")
    assert done.phase is Phase.ROLLED_BACK and not guard.locked()


async def test_kvpilot_tune_rolls_back_its_hold_as_it_stops_its_canary(api: Api) -> None:
    console = Console(record=True, width=200)
    await roll_back_held(api.rig, None, api.store.db, console)  # type: ignore[arg-type]
    record = api.rig.journal.get("t1")
    assert record is not None and record.phase is Phase.ROLLED_BACK
    assert "by kvpilot tune" in (record.reason or "")
    assert "trial t1 was held" in console.export_text()
    assert api.rig.runtime.canary is None
