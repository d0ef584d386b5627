"""Least privilege: the Roles of deploy/ grant exactly the API calls the agent can make.

Every call site is read from the agent's source (k8s_api_calls), so a new call without a
grant fails here, and so does a grant no call uses. Each call belongs to one layer:
reads, and a fleet's restart budget (a Lease, Events, the kept guards' ConfigMap), to the
base Role `kvpilot`; the tuner's writes to `kvpilot-tuning` (deploy/overlays/tuning);
creating and deleting the canary's Service and the HTTPRoute's weights to
`kvpilot-tuning-gateway` (deploy/overlays/tuning-gateway).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import k8s_api_calls
import pytest
from kustomize_builds import (
    FOLDER,
    LAYERS,
    ROLE,
    ROOT,
    SERVICE_ACCOUNT,
    SIDECAR,
    Grant,
    build,
    grants,
    missing_input,
    named,
    of_kind,
    role_file,
)

from kvpilot.agent.runtimes.kubernetes import api, traffic

READ_VERBS = {"get", "list", "watch"}
# Resources (and single verbs) that only one layer's features use; otherwise reads are the
# base's and writes the tuning overlay's. The Gateway API way creates and deletes the
# canary's Service and reads and moves the HTTPRoute's weights (a CRD the base may not have).
LAYER_OF_RESOURCE = {
    ("", "services", "create"): "tuning-gateway",
    ("", "services", "delete"): "tuning-gateway",
    ("gateway.networking.k8s.io", "httproutes", None): "tuning-gateway",
    # A fleet's restart budget is remediation, which the base does: its Lease of restart
    # slots, its Events and the ConfigMap of the guards it keeps (the tuner's one Lease per
    # Deployment, its Events and its handover ConfigMap use the same verbs).
    ("coordination.k8s.io", "leases", None): "base",
    ("", "events", None): "base",
    ("", "configmaps", "delete"): "tuning",  # a promotion handed over (several replicas)
    ("", "configmaps", None): "base",
}
# What the base Role may write: a fleet's restart budget, Events and kept guards, never the
# Deployment, the pods or anything that serves traffic.
BASE_WRITES = {
    ("coordination.k8s.io", "leases", "create"),
    ("coordination.k8s.io", "leases", "update"),
    ("", "events", "create"),
    ("", "configmaps", "create"),
    ("", "configmaps", "update"),
}


def layer_of(group: str, resource: str, verb: str) -> str:
    """The layer whose Role must grant this: by resource, else reads base, writes tuning."""
    for key in ((group, resource, verb), (group, resource, None)):
        if key in LAYER_OF_RESOURCE:
            return LAYER_OF_RESOURCE[key]
    return "base" if verb in READ_VERBS else "tuning"


def _needed() -> dict[str, dict[Grant, list[str]]]:
    """Per layer, each grant the agent's calls need and where they are made."""
    calls, problems = k8s_api_calls.collect()
    assert not problems, "\n".join(problems)
    out: dict[str, dict[Grant, list[str]]] = {layer: {} for layer in LAYERS}
    for call in calls:
        grant = (call.group, call.plural, call.verb)
        out[layer_of(*grant)].setdefault(grant, []).append(call.where)
    return out


def test_every_api_call_is_read_and_declares_what_it_calls() -> None:
    calls, problems = k8s_api_calls.collect()
    assert not problems, "\n".join(problems)
    assert not [m for c in calls if (m := k8s_api_calls.mismatch(c))]
    # The reader sees the runtime's calls, the Lease's included.
    methods = {c.method for c in calls}
    assert {"read_namespaced_deployment", "create_namespaced_lease"} <= methods


@pytest.mark.parametrize("layer", LAYERS)
def test_role_grants_exactly_what_its_layer_calls(layer: str) -> None:
    needed = _needed()[layer]
    granted = grants(role_file(layer))
    path = (SIDECAR if layer == "base" else FOLDER[layer]) / "role.yaml"
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    missing = [f"{g} used at {', '.join(needed[g])}" for g in sorted(set(needed) - granted)]
    unused = sorted(granted - set(needed))
    assert not missing, f"add to {where} (Role {ROLE[layer]}): " + "; ".join(missing)
    assert not unused, f"{where} (Role {ROLE[layer]}) grants what no call uses: {unused}"


def test_base_role_reads_but_for_the_fleets_coordination() -> None:
    writes = {g for g in grants(role_file("base")) if g[2] not in READ_VERBS}
    assert writes <= BASE_WRITES


@pytest.mark.parametrize("layer", LAYERS)
def test_built_layer_binds_its_roles_to_the_sidecar(layer: str) -> None:
    """What kubectl builds: the Roles of this layer and those below, each bound, no more."""
    if reason := missing_input(layer):
        pytest.skip(reason)
    docs = build(layer)
    below = LAYERS[: LAYERS.index(layer) + 1]
    roles = {d["metadata"]["name"] for d in of_kind(docs, "Role")}
    assert roles == {ROLE[name] for name in below}
    for name in below:
        binding = named(docs, "RoleBinding", ROLE[name])
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": ROLE[name],
        }
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": SERVICE_ACCOUNT}]
        assert grants(named(docs, "Role", ROLE[name])) == grants(role_file(name))
    assert not of_kind(docs, "ClusterRole") and not of_kind(docs, "ClusterRoleBinding")


@pytest.mark.parametrize(
    ("split", "layer"),
    [("ServiceShare", "tuning"), ("GatewayWeights", "tuning-gateway")],
)
def test_each_way_of_splitting_traffic_runs_on_its_overlay(split: str, layer: str) -> None:
    """What each split declares it calls is granted by its overlay and those below it."""
    declared = getattr(traffic, split).API_CALLS
    below = LAYERS[: LAYERS.index(layer) + 1]
    granted = set().union(*(grants(role_file(name)) for name in below))
    for verb, name in sorted(declared):
        plural, _, group = name.partition(".")
        assert (group, plural, verb) in granted, f"{split}: '{verb}' {name} not in {below}"
    calls, _ = k8s_api_calls.collect(
        [k8s_api_calls.AGENT / "runtimes" / "kubernetes" / "traffic.py"]
    )
    assert declared <= {(c.verb, c.resource) for c in calls}


def test_a_403_names_the_role_that_grants_the_verb() -> None:
    """The runtime's table for its 403 message: every call the agent makes is in it with the
    Role that grants it, and every entry follows the same layers (a verb no call uses is
    granted by no Role; were a call to use it, its layer's Role is where it would go)."""
    table = getattr(api, "ROLE_GRANTS", None)
    if table is None:
        pytest.skip(
            "the runtime's 403 table (kubernetes/api.py's ROLE_GRANTS) is not in this checkout"
        )
    place = {layer: (ROLE[layer], str(FOLDER[layer].relative_to(ROOT))) for layer in LAYERS}
    for layer, needed in _needed().items():
        for group, resource, verb in needed:
            name = f"{resource}.{group}" if group else resource
            got = table.get((verb, name))
            assert got == place[layer], (
                f"api.ROLE_GRANTS[({verb!r}, {name!r})] is {got}; the Role that grants it: "
                f"{place[layer]}"
            )
    for (verb, name), where in table.items():
        plural, _, group = name.partition(".")
        want = place[layer_of(group, plural, verb)]
        assert where == want, f"api.ROLE_GRANTS[({verb!r}, {name!r})] is {where}, not {want}"


# -- the reader itself ---------------------------------------------------------------------


def _module(tmp_path: Path, source: str) -> Path:
    path = tmp_path / "k8s_new.py"
    path.write_text(textwrap.dedent(source))
    return path


def test_reader_finds_a_new_call_through_constants_and_parameters(tmp_path: Path) -> None:
    path = _module(
        tmp_path,
        """
        import asyncio
        from kvpilot.agent.runtimes.kubernetes.api import call
        from kvpilot.agent.runtimes.kubernetes.lease import RESOURCE

        SERVICES = "services"

        class Traffic:
            def _write(self, body, *, verb):
                return call(self._core.create_namespaced_service, "ns", body,
                            verb=verb, resource=SERVICES, what="a Service")

            def make(self):
                return self._write({}, verb="create")

            async def lease(self):
                await asyncio.to_thread(call, self._api.read_namespaced_lease, "n", "ns",
                                        verb="get", resource=RESOURCE, what="a Lease")
        """,
    )
    calls, problems = k8s_api_calls.collect([path])
    assert problems == []
    assert {(c.verb, c.resource, c.method) for c in calls} == {
        ("create", "services", "create_namespaced_service"),
        ("get", "leases.coordination.k8s.io", "read_namespaced_lease"),
    }
    assert layer_of("", "services", "create") == "tuning-gateway"


def test_reader_refuses_hidden_and_dynamic_calls(tmp_path: Path) -> None:
    path = _module(
        tmp_path,
        """
        from kvpilot.agent.runtimes.kubernetes.api import call

        def hidden(api):
            return api.delete_namespaced_service("name", "ns")

        def dynamic(api, kind):
            return call(api.patch_namespaced_service, "n", "ns", {},
                        verb=VERBS[kind], resource="services", what="x")
        """,
    )
    calls, problems = k8s_api_calls.collect([path])
    assert calls == []
    assert len(problems) == 2
    hidden, dynamic = sorted(problems, key=lambda p: "cannot read" in p)
    assert "k8s_new.py:5: api.delete_namespaced_service is called outside call(" in hidden
    assert "k8s_new.py:9: cannot read 'VERBS[kind]' as a string" in dynamic


def test_reader_catches_a_declared_verb_that_is_not_the_methods(tmp_path: Path) -> None:
    path = _module(
        tmp_path,
        """
        from kvpilot.agent.runtimes.kubernetes.api import call

        def remove(api):
            return call(api.delete_namespaced_deployment, "n", "ns",
                        verb="get", resource="deployments.apps", what="x")
        """,
    )
    (found,), problems = k8s_api_calls.collect([path])
    assert problems == []
    assert "delete_namespaced_deployment is 'delete', declared 'get'" in str(
        k8s_api_calls.mismatch(found)
    )


def test_reader_checks_a_custom_objects_group_and_plural(tmp_path: Path) -> None:
    path = _module(
        tmp_path,
        """
        from kvpilot.agent.runtimes.kubernetes.api import call

        GROUP, VERSION, PLURAL = "gateway.networking.k8s.io", "v1", "httproutes"
        ROUTES = f"{PLURAL}.{GROUP}"

        def read(api):
            return call(api.get_namespaced_custom_object, GROUP, VERSION, "ns", PLURAL, "n",
                        verb="get", resource=ROUTES, what="x")

        def wrong(api):
            return call(api.patch_namespaced_custom_object, GROUP, VERSION, "ns", "grpcroutes",
                        "n", [], verb="patch", resource=ROUTES, what="x")
        """,
    )
    calls, problems = k8s_api_calls.collect([path])
    assert {(c.verb, c.resource) for c in calls} == {
        ("get", "httproutes.gateway.networking.k8s.io"),
        ("patch", "httproutes.gateway.networking.k8s.io"),
    }
    assert problems == [
        f"{path}:12: patch_namespaced_custom_object acts on "
        "['grpcroutes.gateway.networking.k8s.io'], declared "
        "['httproutes.gateway.networking.k8s.io']"
    ]
