"""An Event for every fleet decision, on the pod and on its Deployment.

`kubectl describe deployment` and `kubectl get events` then show what every replica decided
and why: a restart planned, waiting, done, refused, failed; an operator's veto and its lift.
Written with the Event writer of recommend-only promotions (`recommend.announce`): a refused
Event is logged, never raised. Blocking: call in a thread.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from kvpilot.agent.runtimes.kubernetes.api import client_module
from kvpilot.agent.runtimes.kubernetes.recommend import COMPONENT, MAX_MESSAGE_CHARS, announce
from kvpilot.collectors.secrets import mask_text

RESTART_PLANNED = "KvpilotRestartPlanned"
RESTART_WAITING = "KvpilotRestartWaiting"
RESTART_DONE = "KvpilotRestartDone"
RESTART_FAILED = "KvpilotRestartFailed"
RESTART_REFUSED = "KvpilotRestartRefused"
TUNING_SKIPPED = "KvpilotTuningSkipped"
TRIAL_STARTED = "KvpilotTrialStarted"
TRIAL_ENDED = "KvpilotTrialEnded"
PROMOTED = "KvpilotPromoted"
ROLLED_BACK = "KvpilotRolledBack"
VETOED = "KvpilotVetoed"
VETO_LIFTED = "KvpilotVetoLifted"
SETTINGS_REFUSED = "KvpilotSettingsRefused"  # the Deployment's settings annotations
WARNINGS = frozenset(
    {RESTART_WAITING, RESTART_FAILED, RESTART_REFUSED, ROLLED_BACK, SETTINGS_REFUSED}
)


class DecisionEvents:
    """Writes one decision as two core/v1 Events: on the pod and on the Deployment."""

    def __init__(
        self,
        api_client: Any,
        *,
        namespace: str,
        deployment: str,
        pod: str,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._core = client_module().CoreV1Api(api_client)
        self.namespace = namespace
        self.deployment = deployment
        self.pod = pod
        self._wall_clock = wall_clock
        self._serial = itertools.count()
        self.written: list[str] = []  # what became of each Event, in words

    def record(self, reason: str, message: str) -> None:
        text = mask_text(f"{self.pod}: {message}")
        if len(text) > MAX_MESSAGE_CHARS:
            text = text[: MAX_MESSAGE_CHARS - 1] + "…"
        for kind, api_version, name in (
            ("Pod", "v1", self.pod),
            ("Deployment", "apps/v1", self.deployment),
        ):
            self.written.append(
                announce(self._core, self._body(reason, text, kind, api_version, name))
            )

    def _body(
        self, reason: str, message: str, kind: str, api_version: str, name: str
    ) -> dict[str, Any]:
        wall_s = self._wall_clock()
        stamp = datetime.fromtimestamp(wall_s, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        unique = f"{int(wall_s * 1e9):x}{next(self._serial):x}"
        return {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": f"{name}.{unique}", "namespace": self.namespace},
            "involvedObject": {
                "apiVersion": api_version,
                "kind": kind,
                "name": name,
                "namespace": self.namespace,
            },
            "type": "Warning" if reason in WARNINGS else "Normal",
            "reason": reason,
            "action": reason.removeprefix("Kvpilot"),
            "message": message,
            "source": {"component": COMPONENT},
            "reportingComponent": COMPONENT,
            "reportingInstance": self.pod,
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
            "count": 1,
        }
