"""GPU memory from dcgm-exporter, read through Prometheus, for the GPUs allocated to one pod.

Where the sidecar cannot see the GPU through NVML (the default in a pod), or sees it but not
the host's PIDs, dcgm-exporter, which GPU clusters already run, still knows each GPU's memory
and, through the kubelet's pod-resources API, the pod the GPU is allocated to: it adds
`pod`, `namespace` and `container` labels (`internal/pkg/transformation/kubernetes.go`).
Scraped without `honorLabels`, as a ServiceMonitor does by default, they clash with the
exporter pod's own target labels and arrive as `exported_pod` and `exported_namespace`; both
spellings are asked for.

These figures are the *device's* memory (every process on the GPU), not the server's
process: on a GPU the device plugin gives this pod alone they are the pod's, but nothing
here can tell the pod's processes from a neighbour's on a shared GPU. dcgm-exporter reports
framebuffer memory in MiB; values here are bytes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

from kvpilot.collectors.errors import SourceError
from kvpilot.collectors.json_body import JsonBodyError, loads
from kvpilot.collectors.limits import ScrapeLimits
from kvpilot.collectors.scrape_client import ScrapeClient
from kvpilot.collectors.secrets import mask_url

SOURCE = "dcgm"
MIB = 1 << 20
# dcgm-exporter's default counters (etc/default-counters.csv) and the state each one is.
FIELDS = {
    "DCGM_FI_DEV_FB_USED": "used",
    "DCGM_FI_DEV_FB_FREE": "free",
    "DCGM_FI_DEV_FB_RESERVED": "reserved",
}
# The two spellings of the pod labels: as dcgm-exporter writes them, and as Prometheus
# renames them when they clash with the target's own labels (honor_labels: false).
POD_LABELS = (("pod", "namespace"), ("exported_pod", "exported_namespace"))


@dataclass(frozen=True, slots=True)
class DcgmGpu:
    """One GPU (or MIG instance, `mig_instance` set) allocated to the pod: device memory."""

    gpu: str
    uuid: str
    mig_instance: str
    model_name: str
    hostname: str
    container: str
    used_bytes: int | None
    free_bytes: int | None
    reserved_bytes: int | None

    @property
    def key(self) -> str:
        """The GPU as the NVML rules name a domain: `0`, or `0/mig<instance>`."""
        return f"{self.gpu}/mig{self.mig_instance}" if self.mig_instance else self.gpu

    @property
    def total_bytes(self) -> int | None:
        parts = (self.used_bytes, self.free_bytes, self.reserved_bytes)
        return None if any(p is None for p in parts) else sum(p or 0 for p in parts)


@dataclass(frozen=True, slots=True)
class DcgmSnapshot:
    """The pod's GPUs at one read: `taken_at_s` monotonic, `wall_time_s` for display."""

    taken_at_s: float
    wall_time_s: float
    pod: str
    namespace: str
    gpus: tuple[DcgmGpu, ...]


def _quoted(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def pod_query(pod: str, namespace: str) -> str:
    """PromQL for the pod's framebuffer series, under either spelling of the pod labels."""
    names = "|".join(FIELDS)
    return " or ".join(
        f'{{__name__=~"{names}", {pod_label}={_quoted(pod)}, {ns_label}={_quoted(namespace)}}}'
        for pod_label, ns_label in POD_LABELS
    )


def parse_answer(
    answer: Any, *, pod: str, namespace: str, taken_at_s: float, wall_time_s: float
) -> DcgmSnapshot:
    """The Prometheus API's answer to `pod_query` as a snapshot; ValueError says what is
    wrong with it. A GPU scraped twice (two jobs, both spellings) is counted once."""
    if not isinstance(answer, dict) or answer.get("status") != "success":
        error = answer.get("error") if isinstance(answer, dict) else None
        raise ValueError(f"Prometheus refused the query: {error or 'no success status'}")
    data = answer.get("data")
    if not isinstance(data, dict) or data.get("resultType") != "vector":
        raise ValueError("the answer is not an instant vector")
    gpus: dict[tuple[str, str], dict[str, Any]] = {}
    for item in data.get("result") or ():
        labels, value = _sample(item)
        state = FIELDS.get(labels.get("__name__", ""))
        if state is None:
            continue
        uuid = labels.get("UUID") or labels.get("uuid") or labels.get("gpu", "")
        key = (uuid, labels.get("GPU_I_ID", ""))
        gpu = gpus.setdefault(key, {"labels": labels})
        gpu.setdefault(state, value)
    return DcgmSnapshot(
        taken_at_s=taken_at_s,
        wall_time_s=wall_time_s,
        pod=pod,
        namespace=namespace,
        gpus=tuple(_gpu(uuid, mig, found) for (uuid, mig), found in sorted(gpus.items())),
    )


def _sample(item: Any) -> tuple[Mapping[str, str], int]:
    if not isinstance(item, dict) or not isinstance(item.get("metric"), dict):
        raise ValueError("a result without labels")
    pair = item.get("value")
    if not isinstance(pair, list) or len(pair) != 2 or not isinstance(pair[1], str):
        raise ValueError("a result without a [time, value] pair")
    mib = float(pair[1])
    if not math.isfinite(mib) or mib < 0:
        raise ValueError(f"a framebuffer figure out of range: {pair[1]!r} MiB")
    return item["metric"], round(mib * MIB)


def _gpu(uuid: str, mig: str, found: Mapping[str, Any]) -> DcgmGpu:
    labels = found["labels"]
    return DcgmGpu(
        gpu=labels.get("gpu", ""),
        uuid=uuid,
        mig_instance=mig,
        model_name=labels.get("modelName", ""),
        hostname=labels.get("Hostname") or labels.get("hostname", ""),
        # Renamed labels: `container` is then the exporter's own, `exported_container` ours.
        container=labels.get("exported_container" if "exported_pod" in labels else "container", ""),
        used_bytes=found.get("used"),
        free_bytes=found.get("free"),
        reserved_bytes=found.get("reserved"),
    )


class DcgmSource:
    """Asks Prometheus, once a read, for dcgm-exporter's memory of the pod's GPUs; never
    raises: a failure is a SourceError naming the URL with its secrets masked."""

    name = SOURCE

    def __init__(
        self,
        prometheus_url: str,
        *,
        pod: str | None,
        namespace: str | None,
        client: ScrapeClient,
        limits: ScrapeLimits,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._base = prometheus_url.rstrip("/")
        self._pod = pod
        self._namespace = namespace
        self._client = client
        self._limits = limits
        self._clock = clock
        self._wall_clock = wall_clock

    async def read(self) -> DcgmSnapshot | SourceError:
        if not self._pod or not self._namespace:
            return SourceError(
                SOURCE,
                "error",
                "cannot tell this pod's name and namespace to join dcgm-exporter's series "
                "on: set gpu.pod and gpu.namespace, or POD_NAME and POD_NAMESPACE from the "
                "downward API",
            )
        taken_at_s, wall_time_s = self._clock(), self._wall_clock()
        query = urlencode({"query": pod_query(self._pod, self._namespace)})
        url = f"{self._base}/api/v1/query?{query}"
        body = await self._client.get(url, source=SOURCE, limits=self._limits)
        if isinstance(body, SourceError):
            return body
        shown = mask_url(self._base)
        if body.status_code != 200:
            return SourceError(SOURCE, "http_status", f"{shown}: HTTP {body.status_code}")
        try:
            return parse_answer(
                loads(body.text),
                pod=self._pod,
                namespace=self._namespace,
                taken_at_s=taken_at_s,
                wall_time_s=wall_time_s,
            )
        except (JsonBodyError, ValueError) as e:
            return SourceError(SOURCE, "parse_error", f"{shown}: {e}")
