"""How a promotion rolls out across a Deployment's replicas: one at a time by default.

production-stack's chart gives vLLM Deployments `maxSurge: 100%, maxUnavailable: 0`: a
promotion would start a new pod beside every old one and ask for twice the GPUs at once,
which a GPU node pool rarely has. So the promotion's patch also sets `maxSurge: 0,
maxUnavailable: 1` (one replica down at a time, no extra GPU) unless a surge is stated
(`kubernetes.promotion_surge`: then that surge, none unavailable). The Deployment's own
strategy is put back once the rollout ends, done or failed: a strategy change starts no
rollout, and the platform team's next `kubectl rollout` should run as they declared it.

Left alone: a `Recreate` Deployment (it has no rolling update to shape) and one replica
(a single pod cannot go down without an outage; its surge is one pod, as the canary's).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvpilot.agent.runtimes.kubernetes.objects import Obj

ONE_AT_A_TIME: Obj = {"maxSurge": 0, "maxUnavailable": 1}


def _rolling(deployment: Mapping[str, Any]) -> tuple[bool, Obj]:
    """(a rolling update?, its rollingUpdate as the Deployment holds it)."""
    strategy = (deployment.get("spec") or {}).get("strategy") or {}
    rolling = strategy.get("type", "RollingUpdate") == "RollingUpdate"
    return rolling, dict(strategy.get("rollingUpdate") or {})


def promotion_strategy(deployment: Mapping[str, Any], surge: int | str | None) -> Obj | None:
    """The `spec.strategy` a promotion patches in, or None to leave the Deployment's."""
    rolling, _ = _rolling(deployment)
    replicas = int((deployment.get("spec") or {}).get("replicas", 1) or 0)
    if not rolling or replicas <= 1:
        return None
    shape = ONE_AT_A_TIME if surge is None else {"maxSurge": surge, "maxUnavailable": 0}
    return {"type": "RollingUpdate", "rollingUpdate": dict(shape)}


def strategy_restore(deployment: Mapping[str, Any]) -> Obj:
    """The strategic-merge patch that puts the Deployment's strategy back as it was read
    (a field it did not set is deleted, and the API server defaults it again)."""
    _, rolling_update = _rolling(deployment)
    back = {key: rolling_update.get(key) for key in ONE_AT_A_TIME}
    return {"spec": {"strategy": {"rollingUpdate": back}}}


def describe(strategy: Mapping[str, Any] | None) -> str:
    if strategy is None:
        return "the Deployment's own strategy"
    shape = strategy["rollingUpdate"]
    return f"maxSurge {shape['maxSurge']}, maxUnavailable {shape['maxUnavailable']}"
