"""The official Kubernetes client, imported lazily, and its errors as `RuntimeFailure`s."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar
from pathlib import Path
from typing import Any, TypeVar

from kvpilot.agent.runtimes.base import RuntimeFailure
from kvpilot.agent.runtimes.kubernetes.faults import FAULTS

T = TypeVar("T")
INSTALL_HINT = "the Kubernetes runtime needs the official client: pip install 'kvpilot[kubernetes]'"
SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
# Every request's deadline, (connect, read) in seconds: without one the client's socket
# waits for ever on an API server that accepts a connection and never answers.
REQUEST_TIMEOUT_S: tuple[float, float] = (5.0, 10.0)
# A shorter one, within `deadline(...)`: reads made on the event loop itself (the OOM guard's).
_DEADLINE: ContextVar[tuple[float, float] | None] = ContextVar("kvpilot_k8s_deadline", default=None)


@contextlib.contextmanager
def deadline(timeout_s: tuple[float, float]) -> Iterator[None]:
    """Calls made within this block (in this thread) wait at most `timeout_s` each."""
    token = _DEADLINE.set(timeout_s)
    try:
        yield
    finally:
        _DEADLINE.reset(token)


# Which of kvpilot's Roles grants each (verb, resource) the agent's calls use, and where the
# Role is written, so that a 403 names the one to apply. The Roles grant exactly these
# (tests/dashboards/test_rbac.py): reads in the base, the tuner's writes, its Lease and its
# Events in the tuning overlay, the Gateway API split's Services and HTTPRoutes in its own.
_BASE = ("kvpilot", "deploy/base")
_TUNING = ("kvpilot-tuning", "deploy/overlays/tuning")
_GATEWAY = ("kvpilot-tuning-gateway", "deploy/overlays/tuning-gateway")
ROLE_GRANTS: dict[tuple[str, str], tuple[str, str]] = {
    ("get", "deployments.apps"): _BASE,
    ("list", "pods"): _BASE,
    # A fleet: the pod's own Deployment through its ReplicaSet, and the PDBs over its pods.
    ("get", "pods"): _BASE,
    ("get", "replicasets.apps"): _BASE,
    ("list", "poddisruptionbudgets.policy"): _BASE,
    ("get", "endpoints"): _BASE,  # a Service share: the canary's endpoints
    ("get", "services"): _BASE,  # a Service share reads its Service; the Gateway way too
    # A fleet's restart budget is remediation's: its Lease, its Events and its kept guards'
    # ConfigMap are the base's (the tuner's Lease, Events and handover share them).
    **{(verb, "leases.coordination.k8s.io"): _BASE for verb in ("get", "create", "update")},
    ("create", "events"): _BASE,
    **{(verb, "configmaps"): _BASE for verb in ("get", "create", "update")},
    **{(verb, "deployments.apps"): _TUNING for verb in ("create", "patch", "delete")},
    ("patch", "pods"): _TUNING,  # a Service share: a canary pod's label taken off
    ("delete", "configmaps"): _TUNING,  # kubernetes.handover: configmap, the handover done
    **{(verb, "services"): _GATEWAY for verb in ("create", "delete")},
    **{(verb, "httproutes.gateway.networking.k8s.io"): _GATEWAY for verb in ("get", "patch")},
}


def missing_grant(verb: str, resource: str) -> str:
    """What to do about a refused verb: the Role that grants it, or that none does."""
    grant = ROLE_GRANTS.get((verb, resource))
    if grant is None:
        return f"no Role of kvpilot's grants it: add the verb '{verb}' on '{resource}' to one"
    role, where = grant
    return f"the Role '{role}' grants it: apply {where} (its RoleBinding binds it to kvpilot)"


class KubernetesApiError(RuntimeFailure):
    """The API server refused or failed a request; `status` is its HTTP status (0: no answer)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class Forbidden(KubernetesApiError):
    """RBAC denied a verb; the message names the verb, the resource and the Role to extend."""


class NotFound(KubernetesApiError):
    """The object does not exist."""


class Conflict(KubernetesApiError):
    """The object changed since it was read (resourceVersion), or it already exists."""


class InfrastructureFailure(RuntimeFailure):
    """The cluster, not the candidate, failed a trial: its pod cannot be scheduled, its image
    pulled, or the API server refused or failed a write. Not a verdict on the flags."""


class UnexpectedAnswer(KubernetesApiError):
    """The API server (or a proxy in front of it) answered with something that is not the
    object asked for: an HTML page with 200, an empty body."""


def _unexpected(found: object) -> str | None:
    """Why `found` is not an API object, or None. An HTML body reaches the caller as a str
    (a custom object), or as a model whose every field is empty: it has no metadata."""
    if isinstance(found, str | bytes):
        return f"a body that is not JSON ({str(found)[:60]!r})"
    if isinstance(found, dict) and not found:
        return "an empty object"
    kind = type(found).__name__
    has_metadata = "metadata" in (getattr(found, "attribute_map", None) or {})
    if has_metadata and kind != "V1Status" and getattr(found, "metadata", None) is None:
        return f"a {kind} without metadata (the body was not one)"
    return None


def client_module() -> Any:
    """`kubernetes.client`, or a RuntimeFailure that says how to install it."""
    try:
        from kubernetes import client
    except ImportError as exc:
        raise RuntimeFailure(INSTALL_HINT) from exc
    return client


def _server_message(body: object) -> str:
    if isinstance(body, bytes):
        body = body.decode(errors="replace")
    if not isinstance(body, str) or not body:
        return ""
    try:
        return str(json.loads(body).get("message") or body)
    except (ValueError, AttributeError):
        return body


def api_error(exc: Exception, *, verb: str, resource: str, what: str) -> KubernetesApiError:
    """A client exception as a failure naming the verb and resource (`deployments.apps`)."""
    status = int(getattr(exc, "status", 0) or 0)
    detail = _server_message(getattr(exc, "body", None)) or str(exc)
    if status == 403:
        return Forbidden(
            f"forbidden: the service account may not '{verb}' {resource} ({what}); "
            f"{missing_grant(verb, resource)} (server: {detail})",
            status,
        )
    if status == 404:
        return NotFound(f"{what} not found ({verb} {resource}): {detail}", status)
    if status == 409:
        return Conflict(f"conflict on {what} ({verb} {resource}): {detail}", status)
    if status == 0:
        return KubernetesApiError(f"the API server did not answer {verb} {what}: {exc}", 0)
    return KubernetesApiError(
        f"the API server answered HTTP {status} to {verb} {resource} ({what}): {detail}", status
    )


def call(fn: Callable[..., T], *args: Any, verb: str, resource: str, what: str, **kw: Any) -> T:
    """Call one client method within REQUEST_TIMEOUT_S; its ApiException, connection error,
    timeout or an answer that is not an API object becomes a failure."""
    client = client_module()
    import urllib3  # the client's transport, installed with it

    kw.setdefault("_request_timeout", _DEADLINE.get() or REQUEST_TIMEOUT_S)
    try:
        found = fn(*args, **kw)
    except (client.ApiException, urllib3.exceptions.HTTPError, OSError) as exc:
        failed = api_error(exc, verb=verb, resource=resource, what=what)
        raise _recorded(failed, verb, what) from exc
    except (ValueError, TypeError, AttributeError) as exc:  # the client could not read it
        failure = UnexpectedAnswer(
            f"the API server's answer to {verb} {what} is not an API object: {exc}", 200
        )
        raise _recorded(failure, verb, what) from exc
    problem = _unexpected(found)
    if problem is not None:
        failure = UnexpectedAnswer(f"the API server answered {verb} {what} with {problem}", 200)
        raise _recorded(failure, verb, what)
    return found


def _recorded(failure: KubernetesApiError, verb: str, what: str) -> KubernetesApiError:
    """The failure, kept in the fault log first (a 404 is an answer, not a fault)."""
    if not isinstance(failure, NotFound):
        FAULTS.add(verb, what, failure.status, type(failure).__name__, str(failure))
    return failure


def pod_namespace(environ: Mapping[str, str], service_account: Path = SERVICE_ACCOUNT) -> str:
    """The namespace of the pod kvpilot runs in: the downward API's variable, else the
    service account's namespace file; RuntimeFailure saying how to set it when neither."""
    for name in ("POD_NAMESPACE", "KVPILOT_POD_NAMESPACE"):
        if environ.get(name):
            return environ[name]
    try:
        namespace = (service_account / "namespace").read_text().strip()
    except OSError:
        namespace = ""
    if namespace:
        return namespace
    raise RuntimeFailure(
        "the pod runtime cannot tell its namespace: set runtime.kubernetes.namespace, or "
        "POD_NAMESPACE from the downward API (fieldRef metadata.namespace); "
        f"{service_account / 'namespace'} is not there either"
    )


def pod_name(environ: Mapping[str, str]) -> str | None:
    """This pod's name (the Lease holder's identity), from the downward API or the hostname."""
    for name in ("POD_NAME", "KVPILOT_POD_NAME", "HOSTNAME"):
        if environ.get(name):
            return environ[name]
    return None


def make_api_client(api_url: str | None) -> Any:
    """A client of the API server at `api_url` (no credentials: a test's server, `kubectl
    proxy`), or, when None, of the pod's own cluster with its service account's token."""
    client = client_module()
    configuration = client.Configuration()
    configuration.retries = 1  # one retry of a reset connection: a deadline of two timeouts
    if api_url is not None:
        configuration.host = api_url
        return client.ApiClient(configuration)
    from kubernetes import config as kube_config

    try:
        kube_config.load_incluster_config(client_configuration=configuration)
    except kube_config.ConfigException as exc:
        raise RuntimeFailure(
            f"no in-cluster Kubernetes configuration ({exc}): run kvpilot in a pod with a "
            "service account, or set runtime.kubernetes.api_url"
        ) from exc
    return client.ApiClient(configuration)
