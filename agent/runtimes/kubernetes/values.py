"""What the Kubernetes runtime is pointed at, and what a promotion did: plain values."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

from kvpilot.agent.model import Instance
from kvpilot.agent.runtimes.base import FlagsNotApplied
from kvpilot.agent.runtimes.kubernetes import objects

PromoteMode = Literal["apply", "recommend", "auto"]
RestartMode = Literal["signal", "rollout"]


@dataclass(frozen=True, slots=True)
class KubernetesTarget:
    """The stable Deployment and how to reach and change it."""

    namespace: str
    deployment: str
    container: str = "vllm"
    sidecar_container: str | None = "kvpilot"  # removed from the canary's pod
    port: int = 8000
    kvpool_port: int | None = 9500
    # The sidecar shares the stable pod, so it reaches vLLM on loopback; None: the pod IP.
    stable_url: str | None = "http://127.0.0.1:8000"
    api_key: str | None = None
    promote: PromoteMode = "auto"  # auto: recommend-only when GitOps owns the Deployment
    restart: RestartMode = "signal"
    state_dir: Path | None = None  # where recommend-only writes its patches
    name: str | None = None  # the stable instance's name; the Deployment's by default
    # A promotion's rolling update: None, one replica at a time; else this surge (1, "25%").
    promotion_surge: int | str | None = None

    @property
    def stable_name(self) -> str:
        return self.name or self.deployment

    @property
    def canary_name(self) -> str:
        return objects.canary_name(self.deployment)


@dataclass(frozen=True, slots=True)
class Recommendation:
    """A promotion written down instead of applied, and where."""

    deployment: str
    namespace: str
    patch: str  # a strategic-merge patch, JSON
    path: Path | None
    reason: str
    kubectl: str
    wall_s: float = 0.0  # when it was written
    event: str | None = None  # the Event that announces it, or why there is none


@runtime_checkable
class RecommendsFlags(Protocol):
    """A runtime that may write a promotion down instead of applying it."""

    def recommendations(self) -> tuple[Recommendation, ...]:
        """The latest, oldest first."""
        ...


@dataclass(frozen=True, slots=True)
class Promotion:
    """What a promotion did: applied (instance ready) or only recommended."""

    applied: bool
    instance: Instance | None
    recommendation: Recommendation | None


class PromotionNotApplied(FlagsNotApplied):
    """Recommend-only mode: the patch was written, not applied; `recommendation` says where."""

    def __init__(self, recommendation: Recommendation) -> None:
        where = recommendation.path or "the result (no state directory configured)"
        super().__init__(
            f"recommend-only: the patch for Deployment {recommendation.namespace}/"
            f"{recommendation.deployment} was written to {where}, not applied "
            f"({recommendation.reason}); apply it with: {recommendation.kubectl}"
        )
        self.recommendation = recommendation
