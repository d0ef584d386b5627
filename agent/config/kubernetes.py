"""The pod runtime's `kubernetes:` section: the Deployment the sidecar runs in and how to
change it (canary Deployments, promotion by patching, the tuning Lease)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from kvpilot.agent.config.base import check_http_url
from kvpilot.agent.strict_model import StrictModel

# A DNS-1123 label (namespaces) and subdomain (Deployment and container names).
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$"


class KubernetesConfig(StrictModel):
    """Where the stable Deployment is and how kvpilot may change it."""

    namespace: str | None = Field(
        None,
        pattern=DNS_LABEL,
        description="The Deployment's namespace. Unset: the pod's own (the POD_NAMESPACE or "
        "KVPILOT_POD_NAMESPACE variable, else the service account's namespace file).",
    )
    deployment: str | None = Field(
        None,
        pattern=DNS_SUBDOMAIN,
        description="The stable Deployment (the pod's own). Unset: found from the pod's "
        "ownerReferences (pod, ReplicaSet, Deployment), so one ConfigMap serves every "
        "Deployment of a namespace.",
    )
    container: str = Field("vllm", pattern=DNS_LABEL, description="Its vLLM container.")
    sidecar_container: str | None = Field(
        "kvpilot",
        pattern=DNS_LABEL,
        description="kvpilot's own container, left out of canary pods; null: none to remove.",
    )
    promote: Literal["apply", "recommend", "auto"] = Field(
        "auto",
        description="apply: patch the Deployment's args; recommend: only write the patch (a "
        "file and an Event); auto: recommend when GitOps (Argo CD, Flux) owns the Deployment.",
    )
    restart: Literal["signal", "rollout"] = Field(
        "signal",
        description="How a remediation restarts vLLM: signal its process in the shared PID "
        "namespace, or patch restartedAt as `kubectl rollout restart` does.",
    )
    api_url: str | None = Field(
        None,
        description="The API server's URL, without credentials (e.g. `kubectl proxy`'s "
        "http://127.0.0.1:8001). Unset: the in-cluster configuration of the pod's service "
        "account.",
    )
    handover: Literal["state_dir", "configmap"] = Field(
        "state_dir",
        description="Where a promotion that replaces the promoting pod is handed to the next: "
        "state_dir (one replica, its state on a PersistentVolumeClaim) or configmap (several "
        "replicas: the Lease holder writes `<deployment>-kvpilot-handover`; the tuning Role "
        "grants its delete, the base Role its get, create and update).",
    )
    restarting_at_once: int = Field(
        1,
        ge=1,
        le=100,
        description="The Deployment's restart budget: how many of its replicas may restart "
        "at once (a Lease, `<deployment>-kvpilot-restarts`, holds the turns); the rest wait.",
    )
    canaries_at_once: int = Field(
        1,
        ge=1,
        le=100,
        description="How many tuning canaries the namespace runs at once, across its "
        "Deployments (a Lease, `kvpilot-canaries`, holds the turns); a scheduled run that "
        "finds them all held is skipped, saying so in the audit and an Event.",
    )
    promotion_surge: int | str | None = Field(
        None,
        description="How a promotion rolls out over several replicas. Unset: one at a time "
        "(maxSurge 0, maxUnavailable 1: no extra GPU); else this surge, none unavailable "
        "(1, or a percentage such as '25%'). The Deployment's own strategy is put back after.",
    )
    lease_duration_s: int = Field(
        60, ge=5, le=3600, description="The tuning Lease's duration; renewed every third."
    )

    @field_validator("promotion_surge")
    @classmethod
    def _a_surge(cls, value: int | str | None) -> int | str | None:
        if isinstance(value, str) and not re.fullmatch(r"[1-9][0-9]?%|100%", value):
            raise ValueError(f"a surge is a number of pods or a percentage 1%-100%, not {value!r}")
        if isinstance(value, int) and value < 1:
            raise ValueError("a stated surge is at least 1 pod (unset: one at a time)")
        return value

    @field_validator("api_url")
    @classmethod
    def _http(cls, url: str | None) -> str | None:
        return None if url is None else check_http_url(url).rstrip("/")
