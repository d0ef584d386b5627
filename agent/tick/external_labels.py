"""The labels an alert carries when it leaves kvpilot, beyond its own: which replica sent it.

As Prometheus adds its `external_labels` to what it sends, the sidecar adds `namespace` and
`pod` (from the environment the manifests set) and the configured `rules.external_labels`
to every alert it notifies. Inside kvpilot nothing changes: alert states, silences and
remediation keep their labels, and `instance` stays the server's name, which they target.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from kvpilot.agent.model import AlertEvent, labels_of

# Set from the pod's own metadata through the downward API (deploy/base/deployment.yaml).
REPLICA_ENV = (("namespace", "KVPILOT_POD_NAMESPACE"), ("pod", "KVPILOT_POD_NAME"))


def replica_labels(environ: Mapping[str, str]) -> dict[str, str]:
    """`namespace` and `pod` of the pod kvpilot runs in, where the environment names them."""
    return {label: environ[name] for label, name in REPLICA_ENV if environ.get(name)}


def with_external_labels(event: AlertEvent, external: Mapping[str, str]) -> AlertEvent:
    """`event` with `external` labels under its own (an alert's own label wins)."""
    if not external:
        return event
    return dataclasses.replace(event, labels=labels_of({**external, **dict(event.labels)}))


def outgoing(
    event: AlertEvent, configured: Mapping[str, str], environ: Mapping[str, str] = os.environ
) -> AlertEvent:
    """`event` as it leaves: with the replica's labels, under the configured ones."""
    return with_external_labels(event, {**replica_labels(environ), **configured})
