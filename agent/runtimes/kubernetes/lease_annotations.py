"""A Lease's annotations changed by read-modify-write: read the Lease, change what the caller
decides, write it back carrying the resourceVersion read (or create it where there was none).
A writer that raced another gets a Conflict and reads again. Blocking: run it in a thread.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvpilot.agent.runtimes.kubernetes.api import Conflict, NotFound, call, client_module

RESOURCE = "leases.coordination.k8s.io"


@dataclass(frozen=True, slots=True)
class AnnotationChange:
    """Annotations to set (a None value: remove), and the spec to write with them: None keeps
    the spec read (a Lease that is created needs one)."""

    annotations: Mapping[str, str | None] = field(default_factory=dict)
    spec: Any | None = None


def _applied(kept: Mapping[str, str] | None, changes: Mapping[str, str | None]) -> dict[str, str]:
    out = dict(kept or {})
    out.update({k: v for k, v in changes.items() if v is not None})
    for gone in (k for k, v in changes.items() if v is None):
        out.pop(gone, None)
    return out


class LeaseAnnotations:
    """Read and write one Lease, `namespace/name`, by resourceVersion."""

    def __init__(self, api_client: Any, *, namespace: str, name: str) -> None:
        self._api = client_module().CoordinationV1Api(api_client)
        self.namespace = namespace
        self.name = name

    def what(self) -> str:
        return f"Lease {self.namespace}/{self.name}"

    def read(self) -> Any | None:
        """The Lease as the API server has it now; None when there is none."""
        try:
            return call(
                self._api.read_namespaced_lease,
                self.name,
                self.namespace,
                verb="get",
                resource=RESOURCE,
                what=self.what(),
            )
        except NotFound:
            return None

    def write(self, read: Any | None, change: AnnotationChange) -> bool:
        """`read` (what `read()` returned) with `change` applied: replaced with its
        resourceVersion, or created where none was read; False on a Conflict (another writer
        came first, or created it meanwhile)."""
        k8s = client_module()
        if read is None:
            read = k8s.V1Lease(
                api_version="coordination.k8s.io/v1",
                kind="Lease",
                metadata=k8s.V1ObjectMeta(name=self.name, namespace=self.namespace),
            )
        read.metadata.annotations = _applied(read.metadata.annotations, change.annotations)
        if change.spec is not None:
            read.spec = change.spec
        try:
            if read.metadata.resource_version:
                call(
                    self._api.replace_namespaced_lease,
                    self.name,
                    self.namespace,
                    read,
                    verb="update",
                    resource=RESOURCE,
                    what=self.what(),
                )
            else:
                call(
                    self._api.create_namespaced_lease,
                    self.namespace,
                    read,
                    verb="create",
                    resource=RESOURCE,
                    what=self.what(),
                )
        except Conflict:
            return False
        return True

    def edit(self, decide: Callable[[Any | None], AnnotationChange | None], *, tries: int) -> bool:
        """Read, `decide` the change from what was read (None: nothing to write), write; a
        Conflict reads again, `tries` times in all. True once written."""
        for _ in range(tries):
            read = self.read()
            change = decide(read)
            if change is None:
                return False
            if self.write(read, change):
                return True
        return False
