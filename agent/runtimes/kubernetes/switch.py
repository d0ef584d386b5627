"""The live switch as Kubernetes holds it: the Deployment's `kvpilot.dev/mode` annotation and
the namespace's ConfigMap `kvpilot-mode` (key `mode`), read every `interval_s`.

A namespaced ConfigMap, not the Namespace's own annotation: reading a Namespace needs a
ClusterRole, which platform teams refuse a sidecar. The Deployment is read every 10 s and the
namespace's ConfigMap every third read (30 s): about 0.13 requests a second per sidecar, under
the fleet's 0.2 with room for its own reads; the Deployment's annotation applies within 10 s,
the namespace's within 30 s (one object that a whole namespace's sidecars read, so the slower
one). An object that is not
there clears its layer; a read that fails keeps what the layer had (the API server being
away is no order to arm or to pause); a value that is not a mode pauses, loudly, until it is
fixed: a typo in a switch is read as the safe side.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kvpilot.agent.mode import (
    MODE_ANNOTATION,
    MODE_CONFIGMAP,
    MODE_KEY,
    LiveMode,
    Mode,
    ModeSource,
    parse_mode,
)
from kvpilot.agent.runtimes.base import RuntimeFailure
from kvpilot.agent.runtimes.kubernetes.api import NotFound, call, client_module, deadline
from kvpilot.agent.runtimes.offloop import in_daemon_thread

log = logging.getLogger(__name__)

SWITCH_INTERVAL_S = 10.0
NAMESPACE_EVERY = 3  # the namespace's ConfigMap on every third read: 30 s
_READ_DEADLINE_S = (3.0, 4.0)  # within one interval, both reads


@dataclass(frozen=True, slots=True)
class Layer:
    """One object's word: a mode, None (not set), or `unreadable` (keep the last word)."""

    mode: Mode | None
    detail: str
    unreadable: bool = False


KEEP = Layer(None, "", unreadable=True)


def _word(text: object, where: str) -> Layer:
    if text is None:
        return Layer(None, where)
    try:
        return Layer(parse_mode(str(text)), where)
    except ValueError as exc:
        log.error("mode switch: %s: %s; paused until it names a mode", where, exc)
        return Layer(Mode.PAUSED, f"{where}: not a mode, paused until fixed")


def read_layers(
    api_client: Any, namespace: str, deployment: str, *, namespace_too: bool = True
) -> tuple[Layer, Layer]:
    """The Deployment's layer and the namespace's (blocking: one or two GETs, in a thread);
    without `namespace_too` the namespace's layer is KEEP, unread."""
    k8s = client_module()
    deployment_layer = _read(
        lambda: call(
            k8s.AppsV1Api(api_client).read_namespaced_deployment,
            deployment,
            namespace,
            verb="get",
            resource="deployments.apps",
            what=f"Deployment {namespace}/{deployment}",
        ),
        lambda found: (found.metadata.annotations or {}).get(MODE_ANNOTATION),
        f"Deployment {namespace}/{deployment} annotation {MODE_ANNOTATION}",
    )
    if not namespace_too:
        return deployment_layer, KEEP
    return (
        deployment_layer,
        _read(
            lambda: call(
                k8s.CoreV1Api(api_client).read_namespaced_config_map,
                MODE_CONFIGMAP,
                namespace,
                verb="get",
                resource="configmaps",
                what=f"ConfigMap {namespace}/{MODE_CONFIGMAP}",
            ),
            lambda found: (found.data or {}).get(MODE_KEY),
            f"ConfigMap {namespace}/{MODE_CONFIGMAP} key {MODE_KEY}",
        ),
    )


def _read(get: Callable[[], Any], value: Callable[[Any], object], where: str) -> Layer:
    try:
        with deadline(_READ_DEADLINE_S):
            found = get()
    except NotFound:
        return Layer(None, where)
    except RuntimeFailure as exc:
        log.warning("mode switch: cannot read %s, keeping its last value: %s", where, exc)
        return KEEP
    return _word(value(found), where)


def apply_layers(live: LiveMode, deployment: Layer, namespace: Layer) -> None:
    """The Kubernetes layers of `live` as read (an unreadable one left as it was)."""
    for source, layer in ((ModeSource.DEPLOYMENT, deployment), (ModeSource.NAMESPACE, namespace)):
        if not layer.unreadable:
            live.set(source, layer.mode, layer.detail)


@dataclass(frozen=True, slots=True)
class SwitchWatch:
    """Reads the switch every `interval_s` until cancelled (a task of the sidecar's): the
    Deployment each time, the namespace's ConfigMap on the first read and every
    `namespace_every`-th after. `read(namespace_too)` is `read_layers` bound to one pod."""

    live: LiveMode
    read: Callable[[bool], tuple[Layer, Layer]]
    interval_s: float = SWITCH_INTERVAL_S
    namespace_every: int = NAMESPACE_EVERY
    _reads: Iterator[int] = field(default_factory=itertools.count, repr=False)

    async def once(self) -> None:
        namespace_too = next(self._reads) % self.namespace_every == 0
        deployment, namespace = await in_daemon_thread(self.read, namespace_too)
        apply_layers(self.live, deployment, namespace)

    async def run(self) -> None:
        while True:
            try:
                await self.once()
            except Exception:  # the switch keeps being read: a dead watch would freeze it
                log.exception("mode switch: reading it failed; trying again")
            await asyncio.sleep(self.interval_s)
