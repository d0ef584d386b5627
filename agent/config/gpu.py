"""Where GPU facts come from when NVML cannot give them: dcgm-exporter through Prometheus."""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import Field, field_validator

from kvpilot.agent.strict_model import StrictModel

# The downward API's usual names first, then the sidecar manifest's, then the hostname
# (a pod's hostname is its name unless the pod sets `hostname`).
POD_NAME_VARIABLES = ("POD_NAME", "KVPILOT_POD_NAME", "HOSTNAME")
POD_NAMESPACE_VARIABLES = ("POD_NAMESPACE", "KVPILOT_POD_NAMESPACE")


class GpuConfig(StrictModel):
    """GPU memory from dcgm-exporter, read through a Prometheus that scrapes it.

    Used where NVML is not visible in the sidecar, or lists PIDs the sidecar cannot map to
    the server's: dcgm-exporter labels each GPU with the pod it is allocated to, so the
    device memory of this pod's GPUs is known. It is the device's memory, not the server's
    process's: on a GPU shared by time-slicing it includes the neighbours'."""

    dcgm_prometheus_url: str | None = Field(
        None,
        description="Base URL of a Prometheus that scrapes dcgm-exporter with its Kubernetes "
        "pod mapping on (e.g. http://prometheus-operated.monitoring:9090). Unset: dcgm "
        "is not read.",
    )
    pod: str | None = Field(
        None,
        description="This pod's name, as dcgm-exporter labels its GPUs. Default: POD_NAME, "
        "KVPILOT_POD_NAME or HOSTNAME.",
    )
    namespace: str | None = Field(
        None,
        description="This pod's namespace. Default: POD_NAMESPACE or KVPILOT_POD_NAMESPACE.",
    )

    @field_validator("dcgm_prometheus_url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError(f"expected an http:// or https:// URL, got {value!r}")
        return value

    def pod_identity(self, environ: Mapping[str, str]) -> tuple[str | None, str | None]:
        """(pod, namespace): the configured ones, else the downward API's variables."""
        pod = self.pod or next((environ[v] for v in POD_NAME_VARIABLES if environ.get(v)), None)
        namespace = self.namespace or next(
            (environ[v] for v in POD_NAMESPACE_VARIABLES if environ.get(v)), None
        )
        return pod, namespace
