"""Several replicas: the promoting pod hands the rollout over in a ConfigMap, and the pod
that takes the Lease next, with a state directory of its own, imports it and finishes the
bake. Against the fake API server with ConfigMaps (a fake: no API server runs here);
tuning.bake is off for the resuming pod, so its outcome does not hang on a measured window."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpilot.agent.app import parts
from kvpilot.agent.app.parts import build_pod_runtime
from kvpilot.agent.config import PodRuntimeConfig, validate_config
from kvpilot.agent.runtimes.kubernetes.handover_configmap import handover_name
from kvpilot.agent.state.db import Database
from kvpilot.agent.state.trials import SqliteRolloutJournal, SqliteTrialStore
from kvpilot.agent.tuning.handover import HandoverJournal
from kvpilot.agent.tuning.pod.tuner import PodTuner
from kvpilot.tuner.rollout.canary import Phase
from tests.agent.k8s.conftest import NAMESPACE
from tests.agent.k8s.test_k8s_tuning import stable_args
from tests.agent.k8s.test_pod_handover import handed_over_record
from tests.agent.k8s.test_pod_schedule import TINY
from tests.fakes.k8s_configmaps import FakeApiWithConfigMaps

MAP = (NAMESPACE, handover_name("vllm"))


@pytest.fixture
def fake() -> Iterator[FakeApiWithConfigMaps]:
    with FakeApiWithConfigMaps() as api:
        yield api


def pod_tuner(fake, state: Path, port: int, pod: str) -> tuple[PodTuner, Database]:
    config = validate_config(
        {
            "state_dir": str(state),
            "runtime": {
                "kind": "pod",
                "port": port,
                "model_config": str(TINY),
                "kubernetes": {
                    "namespace": NAMESPACE,
                    "deployment": "vllm",
                    "api_url": fake.host,
                    "promote": "apply",
                    "handover": "configmap",
                },
            },
            "tuning": {"bake": False},
        },
        warn=False,
    )
    assert isinstance(config.runtime, PodRuntimeConfig)
    runtime = build_pod_runtime(config, config.runtime, {"POD_NAME": pod})
    db = Database.open(state)
    return parts.pod_tuner(config.runtime, config.tuning, runtime, db), db


def hand_over_from_pod_a(fake, standin, tmp_path) -> list[str]:
    """Pod A promoted trial t1 and is stopping while it bakes; returns the live args."""
    seeded, _, journal, _, new = handed_over_record(
        fake, standin, tmp_path / "a", phase=Phase.BAKING
    )
    record = journal.get("t1")
    seeded.close()
    tuner_a, db_a = pod_tuner(fake, tmp_path / "a" / "state", standin.port, "pod-a")
    tuner_a.journal = HandoverJournal(SqliteRolloutJournal(db_a))
    tuner_a.journal.save(record)  # the session's last record: baking
    tuner_a.hand_over()
    db_a.close()
    return new


def test_the_next_lease_holder_imports_the_handover_and_finishes_it(
    fake, standin, tmp_path
) -> None:
    new = hand_over_from_pod_a(fake, standin, tmp_path)
    written = fake.config_maps[MAP]["data"]
    assert json.loads(written["rollout.json"])["phase"] == "baking"
    assert json.loads(written["trial.json"])["trial_id"] == "t1"
    tuner_b, db_b = pod_tuner(fake, tmp_path / "b", standin.port, "pod-b")  # its own state

    async def take_over():
        study = await tuner_b.study()
        async with tuner_b.lease():
            return await tuner_b.recover(study)

    done = asyncio.run(take_over())

    (resumed,) = done.resumed
    assert (resumed.trial_id, resumed.was, resumed.now) == ("t1", Phase.BAKING, Phase.PROMOTED)
    assert SqliteRolloutJournal(db_b).get("t1").phase is Phase.PROMOTED
    assert SqliteTrialStore(db_b).get("t1") is not None  # the trial came along
    assert MAP not in fake.config_maps  # finished: nobody resumes it again
    assert stable_args(fake) == new and fake.writes("PATCH") == []
    db_b.close()


def test_a_refused_handover_is_logged_not_raised(fake, standin, tmp_path, caplog) -> None:
    fake.forbid("create", "configmaps")

    hand_over_from_pod_a(fake, standin, tmp_path)

    assert MAP not in fake.config_maps
    assert any(
        "could not be handed over" in r.message and "'kvpilot' grants it" in r.message
        for r in caplog.records
    )
