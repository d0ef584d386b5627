"""The Deployment's annotations, read once for its settings annotations
(`kvpilot.agent.app.deployment_settings`): at start-up and at each reload, never at steady
state (the fleet's API budget is the switch's and the view's). Blocking: call in a thread."""

from __future__ import annotations

from typing import Any

from kvpilot.agent.runtimes.kubernetes.api import call, client_module, deadline

_READ_DEADLINE_S = (3.0, 4.0)  # a start-up or a reload waits this long at most


def deployment_annotations(api_client: Any, namespace: str, deployment: str) -> dict[str, str]:
    """The Deployment's annotations (one GET); RuntimeFailure when it cannot be read."""
    with deadline(_READ_DEADLINE_S):
        found = call(
            client_module().AppsV1Api(api_client).read_namespaced_deployment,
            deployment,
            namespace,
            verb="get",
            resource="deployments.apps",
            what=f"Deployment {namespace}/{deployment}",
        )
    return {str(key): str(value) for key, value in (found.metadata.annotations or {}).items()}
