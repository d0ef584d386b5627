"""The Deployment's settings annotations (`kvpilot.dev/tuning.schedule` ...) laid over the
shared configuration (`kvpilot.agent.config.per_deployment`), at start-up and at each reload.

A refused set of annotations (an unknown path, one that is not per-Deployment, a value the
models refuse) never stops the sidecar: it is logged once and written as a Warning Event on
the pod and the Deployment, and the shared configuration stands, whole. A read that fails
keeps the annotations last read (none at start-up: the shared configuration), as the switch
keeps its last word: the API server being away is no order to change settings.
"""

from __future__ import annotations

import logging
from typing import Any

from kvpilot.agent.config import AgentConfig
from kvpilot.agent.config.per_deployment import PREFIX, layer_settings
from kvpilot.agent.runtimes.base import RuntimeFailure
from kvpilot.agent.runtimes.kubernetes.deployment_annotations import deployment_annotations
from kvpilot.agent.runtimes.kubernetes.fleet.decision_events import (
    SETTINGS_REFUSED,
    DecisionEvents,
)

log = logging.getLogger(__name__)


class DeploymentSettings:
    """Lays one Deployment's settings over the shared configuration. Blocking: call in a
    thread. `from_deployment` is what the configuration in force took from the annotations."""

    def __init__(
        self,
        api_client: Any,
        *,
        namespace: str,
        deployment: str,
        events: DecisionEvents | None = None,
    ) -> None:
        self._api_client = api_client
        self.namespace = namespace
        self.deployment = deployment
        self._events = events  # None: a pod whose name is unknown writes no Event
        self._annotations: dict[str, str] = {}  # as last read
        self._refused: tuple[str, ...] = ()  # said once, until they change
        self.from_deployment: dict[str, str] = {}

    @property
    def _where(self) -> str:
        return f"Deployment {self.namespace}/{self.deployment}"

    def layer(self, shared: AgentConfig) -> AgentConfig:
        """`shared` with the Deployment's settings, or `shared` where they are refused."""
        try:
            found = deployment_annotations(self._api_client, self.namespace, self.deployment)
            self._annotations = {k: v for k, v in found.items() if k.startswith(PREFIX)}
        except RuntimeFailure as exc:
            kept = "the annotations read before" if self._annotations else "none"
            log.warning(
                "per-Deployment settings: cannot read %s (%s); laying %s over the shared "
                "configuration",
                self._where,
                exc,
                kept,
            )
        layered = layer_settings(shared, self._annotations)
        if layered.problems:
            self._refuse(layered.problems)
            self.from_deployment = {}
            return shared
        self._refused = ()
        self.from_deployment = layered.from_deployment
        if layered.settings:
            said = ", ".join(f"{path}={text!r}" for path, text in self.from_deployment.items())
            log.info("per-Deployment settings from %s's annotations: %s", self._where, said)
        return layered.config

    def _refuse(self, problems: tuple[str, ...]) -> None:
        if problems == self._refused:
            return
        self._refused = problems
        said = "; ".join(problems)
        log.error(
            "per-Deployment settings refused, the shared configuration stands: %s's "
            "annotations: %s",
            self._where,
            said,
        )
        if self._events is not None:
            self._events.record(
                SETTINGS_REFUSED,
                f"settings annotations refused, the shared configuration stands: {said}",
            )
