"""A handover ConfigMap is resumed only when the Lease holder that wrote it vouches for it,
once, and only where its flags differ from the live Deployment's in the tuned flags alone.
Against the fake API server with ConfigMaps (a fake: no API server runs here)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator

import pytest

from kvpilot.agent.runtimes.kubernetes.handover_configmap import HandoverConfigMap
from kvpilot.agent.state.trials import SqliteRolloutJournal, record_to_dict
from kvpilot.agent.tuning.handover import HandoverJournal
from kvpilot.tuner.rollout.canary import Phase
from tests.agent.k8s.conftest import NAMESPACE
from tests.agent.k8s.test_k8s_tuning import stable_args
from tests.agent.k8s.test_pod_handover import handed_over_record
from tests.agent.k8s.test_pod_handover_configmap import MAP, hand_over_from_pod_a, pod_tuner
from tests.fakes.k8s_configmaps import FakeApiWithConfigMaps

LEASE = (NAMESPACE, "vllm-kvpilot-tuner")
VOUCH = "kvpilot.dev/handover-sha256"  # the Lease annotation that vouches


@pytest.fixture
def fake() -> Iterator[FakeApiWithConfigMaps]:
    with FakeApiWithConfigMaps() as api:
        yield api


EVIL = ("python3", "-m", "vllm.entrypoints.openai.api_server", "--model=evil/model")


def take_over(fake, standin, tmp_path, pod: str):
    tuner, db = pod_tuner(fake, tmp_path / pod, standin.port, pod)

    async def run():
        study = await tuner.study()
        async with tuner.lease():
            return await tuner.recover(study)

    done = asyncio.run(run())
    db.close()
    return tuner, done


def hand_over(fake, standin, tmp_path, change) -> list[str]:
    """Pod A hands over trial t1 (promoting) with `change` made to its record; live args."""
    seeded, _, journal, _, new = handed_over_record(
        fake, standin, tmp_path / "a", phase=Phase.PROMOTING
    )
    record = change(journal.get("t1"))
    seeded.close()
    tuner_a, db_a = pod_tuner(fake, tmp_path / "a" / "state", standin.port, "pod-a")
    tuner_a.journal = HandoverJournal(SqliteRolloutJournal(db_a))
    tuner_a.journal.save(record)
    tuner_a.hand_over()
    db_a.close()
    return new


def test_a_handover_nobody_vouches_for_is_not_resumed(fake, standin, tmp_path) -> None:
    seeded, _, journal, _, new = handed_over_record(
        fake, standin, tmp_path / "a", phase=Phase.PROMOTING
    )
    forged = dataclasses.replace(  # not live: recovery would restore its "stable" flags
        journal.get("t1"),
        candidate_argv=(*EVIL, "--max-num-seqs=16"),
        stable_argv=(*EVIL, "--trust-remote-code"),
    )
    seeded.close()
    # Someone who may write ConfigMaps, not the Lease, writes a handover.
    HandoverConfigMap(fake.api_client(), namespace=NAMESPACE, deployment="vllm").put(
        record_to_dict(forged), None
    )

    tuner, done = take_over(fake, standin, tmp_path, "pod-b")

    assert done.resumed == () and done.recovered == ()
    assert fake.writes("PATCH") == [] and stable_args(fake) == new  # the Deployment untouched
    (why,) = tuner.refused_handovers
    assert "no Lease holder vouches for it" in why


def test_a_handover_is_resumed_once_and_not_when_replayed(fake, standin, tmp_path) -> None:
    new = hand_over_from_pod_a(fake, standin, tmp_path)
    kept = dict(fake.config_maps[MAP]["data"])
    assert VOUCH in fake.leases[LEASE]["metadata"]["annotations"]  # pod A vouched for it

    _, first = take_over(fake, standin, tmp_path, "pod-b")
    assert [r.now for r in first.resumed] == [Phase.PROMOTED]
    assert VOUCH not in (fake.leases[LEASE]["metadata"].get("annotations") or {})  # consumed
    fake.config_maps[MAP] = {  # weeks later the same record shows up again
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": MAP[1], "namespace": NAMESPACE, "resourceVersion": "1"},
        "data": kept,
    }

    tuner, again = take_over(fake, standin, tmp_path, "pod-c")

    assert again.resumed == () and again.recovered == ()
    assert fake.writes("PATCH") == [] and stable_args(fake) == new
    assert "no Lease holder vouches" in tuner.refused_handovers[0]


def test_a_vouched_handover_changing_untuned_flags_is_not_resumed(fake, standin, tmp_path) -> None:
    new = hand_over(
        fake,
        standin,
        tmp_path,
        lambda r: dataclasses.replace(r, stable_argv=(*r.stable_argv, "--trust-remote-code")),
    )

    tuner, done = take_over(fake, standin, tmp_path, "pod-b")

    assert done.resumed == () and done.recovered == ()
    assert fake.writes("PATCH") == [] and stable_args(fake) == new
    (why,) = tuner.refused_handovers
    assert "stable flags differ" in why and "--trust-remote-code" in why
