"""The pod runtime: the Kubernetes runtime as the sidecar in vLLM's pod runs it.

The sidecar reads its instances on every tick. The Kubernetes runtime reads them from the API
server (the stable Deployment, its pods, the canary); when the API server does not answer or
refuses, collecting, alerting and restarting vLLM by signal must go on: the stable instance
then comes from the process runtime alone (the pod's own vLLM, found in /proc), and the
failure is logged once per outage. Every change (a canary, a promotion) still goes through
the API, and fails there; so does every read the tuner makes (`strict_reads`): its
decisions are never made on the process's view.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator
from contextvars import ContextVar

from kvpilot.agent.model import Instance
from kvpilot.agent.runtimes.base import RuntimeFailure
from kvpilot.agent.runtimes.k8s_handover import HandoverConfigMap
from kvpilot.agent.runtimes.kubernetes import KubernetesRuntime

log = logging.getLogger(__name__)

_STRICT: ContextVar[bool] = ContextVar("kvpilot_pod_strict_reads", default=False)


@contextlib.contextmanager
def strict_reads() -> Iterator[None]:
    """Within this block (and the tasks and threads started in it) the pod runtime's reads
    fail when the API server does: the tuner's reads."""
    token = _STRICT.set(True)
    try:
        yield
    finally:
        _STRICT.reset(token)


class PodRuntime(KubernetesRuntime):
    """A KubernetesRuntime whose instances fall back to the pod's own vLLM process while the
    API server fails; `api_failures_total` counts the reads that fell back."""

    api_failures_total = 0
    _failing: str | None = None
    # Set where kubernetes.handover is `configmap` (several replicas).
    handover_map: HandoverConfigMap | None = None

    def instances(self) -> tuple[Instance, ...]:
        try:
            found = super().instances()
        except RuntimeFailure as exc:
            if _STRICT.get():
                raise
            self.api_failures_total += 1
            if self._failing is None:
                log.warning("the API server failed (%s): the stable instance is read from "
                            "the pod's processes until it answers", exc)  # fmt: skip
            self._failing = str(exc)
            local = self._local_stable()
            if local is None:
                raise
            return (local,)
        if self._failing is not None:
            log.info("the API server answers again")
            self._failing = None
        return found

    def _local_stable(self) -> Instance | None:
        if self._process is None:
            return None
        local = next(iter(self._process.instances()), None)
        if local is None:
            return None
        return dataclasses.replace(local, name=self.target.stable_name, role="stable")
