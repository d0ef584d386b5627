"""Tuning for a fleet: schedules staggered per Deployment, promotions that roll out one
replica at a time (the Deployment's own strategy put back after), and Helm-managed
Deployments given a recommendation instead of a patch. Against the fake API server (it
validates every Deployment against the apps/v1 schema) and a stand-in vLLM."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from apscheduler.triggers.cron import CronTrigger

from kvpilot.agent.config.kubernetes import KubernetesConfig
from kvpilot.agent.runtimes.kubernetes.runtime import (
    RECOMMENDATION_ANNOTATION,
    PromotionNotApplied,
)
from kvpilot.agent.tuning.schedule import ScheduledTuning, StaggeredCron
from kvpilot.agent.tuning.stagger import stagger_offset_s
from tests.agent.k8s.conftest import NAMESPACE, base_deployment, make_runtime
from tests.agent.k8s.test_k8s_runtime import candidate
from tests.fakes.k8s_apiserver import FakeKubernetesApi

# production-stack's names: <release>-<model>-deployment-vllm
FLEET = tuple(f"vllm-model{i}-deployment-vllm" for i in range(5))
PRODUCTION_STACK_STRATEGY = {
    "type": "RollingUpdate",
    "rollingUpdate": {"maxSurge": "100%", "maxUnavailable": 0},
}


# -- staggered schedules ---------------------------------------------------------------


def test_each_deployment_has_its_own_place_in_the_window_the_same_on_every_pod() -> None:
    offsets = [stagger_offset_s(name, 3600) for name in FLEET]
    assert all(0 <= o < 3600 for o in offsets)
    assert len(set(offsets)) == len(FLEET)  # five Deployments, five different minutes
    assert offsets == [stagger_offset_s(name, 3600) for name in FLEET]  # another replica
    assert stagger_offset_s(FLEET[0], 0) == 0  # a window of 0: everyone on the schedule


async def _noop() -> str:
    return "ran"


def test_a_firing_comes_its_offset_after_the_crontab_time_every_day() -> None:
    offset_s = stagger_offset_s(FLEET[1], 3600)
    tuning = ScheduledTuning(
        "0 3 * * *",
        _noop,
        remediation_in_progress=lambda: False,
        audit=lambda d, r: None,
        offset_s=offset_s,
    )
    first = datetime(2026, 5, 1, 3, 0, tzinfo=UTC) + timedelta(seconds=offset_s)

    # At 03:00 itself this Deployment has not fired yet: its turn is later in the window.
    assert tuning.next_fire_time(datetime(2026, 5, 1, 3, 0, tzinfo=UTC)) == first
    assert tuning.next_fire_time(datetime(2026, 4, 30, 12, 0, tzinfo=UTC)) == first
    # Past its turn, the next is tomorrow's, at the same offset.
    later = first + timedelta(seconds=1)
    assert tuning.next_fire_time(later) == first + timedelta(days=1)
    trigger = StaggeredCron(CronTrigger.from_crontab("0 3 * * *", timezone=UTC), offset_s)
    assert trigger.get_next_fire_time(first, first) == first + timedelta(days=1)


# -- one replica at a time ---------------------------------------------------------------


def _fleet_deployment(port: int, replicas: int, **meta: Any) -> dict[str, Any]:
    body = base_deployment(port, meta.get("labels"))
    body["spec"]["replicas"] = replicas
    body["spec"]["strategy"] = dict(PRODUCTION_STACK_STRATEGY)
    if "annotations" in meta:
        body["metadata"].setdefault("annotations", {}).update(meta["annotations"])
    return body


def _strategy_patches(fake: FakeKubernetesApi) -> list[dict[str, Any]]:
    return [
        r.body["spec"]["strategy"]
        for r in fake.writes("PATCH")
        if "strategy" in r.body.get("spec", {})
    ]


def test_a_promotion_rolls_out_one_replica_at_a_time_then_the_strategy_is_put_back(
    fake: FakeKubernetesApi, standin: Any, tmp_path: Any
) -> None:
    fake.add_deployment(_fleet_deployment(standin.port, replicas=3))
    runtime = make_runtime(fake, standin.port, tmp_path, promote="apply")
    argv = candidate(standin.port)

    asyncio.run(runtime.promote(argv, ready_timeout_s=10))

    promoting, restoring = fake.writes("PATCH")
    # One write: the new flags and the one-at-a-time strategy together (one rollout).
    assert promoting.body["spec"]["template"]["spec"]["containers"] == [
        {"name": "vllm", "args": argv}
    ]
    assert promoting.body["spec"]["strategy"]["rollingUpdate"] == {
        "maxSurge": 0,
        "maxUnavailable": 1,
    }
    assert restoring.body == {
        "spec": {"strategy": {"rollingUpdate": {"maxSurge": "100%", "maxUnavailable": 0}}}
    }
    after = fake.deployment(NAMESPACE, "vllm")
    assert after["spec"]["strategy"] == PRODUCTION_STACK_STRATEGY
    assert after["spec"]["template"]["spec"]["containers"][0]["args"] == argv


def test_a_stated_surge_is_the_promotions(
    fake: FakeKubernetesApi, standin: Any, tmp_path: Any
) -> None:
    fake.add_deployment(_fleet_deployment(standin.port, replicas=4))
    runtime = make_runtime(fake, standin.port, tmp_path, promote="apply", promotion_surge="25%")

    asyncio.run(runtime.promote(candidate(standin.port), ready_timeout_s=10))

    assert _strategy_patches(fake)[0]["rollingUpdate"] == {"maxSurge": "25%", "maxUnavailable": 0}
    assert fake.deployment(NAMESPACE, "vllm")["spec"]["strategy"] == PRODUCTION_STACK_STRATEGY


@pytest.mark.parametrize(
    ("replicas", "strategy"),
    [(1, PRODUCTION_STACK_STRATEGY), (3, {"type": "Recreate"})],
    ids=["one replica: no outage for its sake", "Recreate: no rolling update to shape"],
)
def test_the_strategy_is_left_alone_where_there_is_nothing_to_shape(
    fake: FakeKubernetesApi, standin: Any, tmp_path: Any, replicas: int, strategy: dict[str, Any]
) -> None:
    body = _fleet_deployment(standin.port, replicas=replicas)
    body["spec"]["strategy"] = strategy
    fake.add_deployment(body)
    runtime = make_runtime(fake, standin.port, tmp_path, promote="apply")

    asyncio.run(runtime.promote(candidate(standin.port), ready_timeout_s=10))

    assert len(fake.writes("PATCH")) == 1
    assert _strategy_patches(fake) == []


def test_a_surge_setting_is_a_pod_count_or_a_percentage() -> None:
    assert KubernetesConfig(promotion_surge="25%").promotion_surge == "25%"
    assert KubernetesConfig(promotion_surge=2).promotion_surge == 2
    for bad in ("0%", "150%", "lots", 0):
        with pytest.raises(ValueError, match="surge"):
            KubernetesConfig(promotion_surge=bad)


# -- Helm ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "meta",
    [
        {"labels": {"app.kubernetes.io/managed-by": "Helm"}},
        {"labels": {"app.kubernetes.io/managed-by": "HELM"}},
        {"annotations": {"meta.helm.sh/release-name": "vllm"}},
    ],
    ids=["managed-by Helm", "managed-by HELM", "release annotation"],
)
def test_a_helm_managed_deployment_gets_a_recommendation_not_a_patch(
    fake: FakeKubernetesApi, standin: Any, tmp_path: Any, meta: dict[str, Any]
) -> None:
    fake.add_deployment(_fleet_deployment(standin.port, replicas=2, **meta))
    runtime = make_runtime(fake, standin.port, tmp_path)  # promote: auto
    before = fake.deployment(NAMESPACE, "vllm")["spec"]

    with pytest.raises(PromotionNotApplied, match="Helm release") as caught:
        asyncio.run(
            runtime.restart(
                "vllm", drain_timeout_s=5, ready_timeout_s=10, argv=candidate(standin.port)
            )
        )

    after = fake.deployment(NAMESPACE, "vllm")
    assert after["spec"] == before  # no flags, no strategy: `helm upgrade` has nothing to undo
    note = after["metadata"]["annotations"][RECOMMENDATION_ANNOTATION]
    assert str(caught.value.recommendation.path) in note
    events = [r for r in fake.writes("POST") if r.path.endswith("/events")]
    assert events and "Helm release" in events[0].body["message"]


def test_promote_apply_patches_a_helm_managed_deployment_as_told(
    fake: FakeKubernetesApi, standin: Any, tmp_path: Any
) -> None:
    meta = {"labels": {"app.kubernetes.io/managed-by": "Helm"}}
    fake.add_deployment(_fleet_deployment(standin.port, replicas=2, **meta))
    runtime = make_runtime(fake, standin.port, tmp_path, promote="apply")
    argv = candidate(standin.port)

    asyncio.run(runtime.promote(argv, ready_timeout_s=10))

    assert (
        fake.deployment(NAMESPACE, "vllm")["spec"]["template"]["spec"]["containers"][0]["args"]
        == argv
    )
