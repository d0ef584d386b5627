"""A 403 names the refused verb, the resource and the Role that grants it (the fake API
server's 403 injection answers as RBAC does; no real API server runs here)."""

from __future__ import annotations

import asyncio

import pytest
from kubernetes.client import ApiException

from kvpilot.agent.runtimes.kubernetes.api import ROLE_GRANTS, Forbidden, api_error
from kvpilot.agent.runtimes.kubernetes.lease import DeploymentLease
from tests.agent.k8s.conftest import NAMESPACE, base_deployment, make_runtime
from tests.agent.k8s.test_k8s_runtime import candidate


def test_a_refused_canary_names_the_tuning_overlay(fake, standin, tmp_path) -> None:
    fake.add_deployment(base_deployment(standin.port))
    fake.forbid("create", "deployments")
    runtime = make_runtime(fake, standin.port, tmp_path)

    with pytest.raises(Forbidden) as caught:
        asyncio.run(runtime.start_canary(candidate(standin.port), ready_timeout_s=10))

    message = str(caught.value)
    assert "may not 'create' deployments.apps" in message
    assert "the Role 'kvpilot-tuning' grants it: apply deploy/overlays/tuning" in message
    assert "cannot create resource" in message  # the API server's own words follow


def test_a_refused_read_names_the_base_role(fake, standin, tmp_path) -> None:
    fake.add_deployment(base_deployment(standin.port))
    fake.forbid("list", "pods")
    runtime = make_runtime(fake, standin.port, tmp_path)

    with pytest.raises(Forbidden, match="may not 'list' pods") as caught:
        runtime.instances()

    assert "the Role 'kvpilot' grants it: apply deploy/base" in str(caught.value)


def test_a_refused_lease_names_the_base_role(fake) -> None:
    fake.forbid("create", "leases")  # a fleet's restart slots need leases too: the base's
    lease = DeploymentLease(
        fake.api_client(), namespace=NAMESPACE, deployment="vllm", identity="pod-a"
    )
    with pytest.raises(Forbidden, match="'kvpilot' grants it"):
        lease.acquire()


def test_a_verb_no_role_grants_says_so() -> None:
    refused = api_error(
        ApiException(status=403, reason="Forbidden"),
        verb="update",
        resource="deployments.apps",
        what="Deployment serving/vllm",
    )
    assert isinstance(refused, Forbidden)
    assert "no Role of kvpilot's grants it: add the verb 'update' on 'deployments.apps'" in str(
        refused
    )


def test_the_table_names_the_three_roles_and_the_base_writes_only_a_fleets_turns() -> None:
    roles = {role: where for role, where in ROLE_GRANTS.values()}
    assert roles == {
        "kvpilot": "deploy/base",
        "kvpilot-tuning": "deploy/overlays/tuning",
        "kvpilot-tuning-gateway": "deploy/overlays/tuning-gateway",
    }
    base_writes = {
        (verb, resource)
        for (verb, resource), (role, _) in ROLE_GRANTS.items()
        if role == "kvpilot" and verb not in ("get", "list")
    }
    # The restart slots' Lease, the decisions' Events, the kept guards' ConfigMap; no
    # Deployment, no pod.
    assert base_writes == {
        ("create", "leases.coordination.k8s.io"),
        ("update", "leases.coordination.k8s.io"),
        ("create", "events"),
        ("create", "configmaps"),
        ("update", "configmaps"),
    }
