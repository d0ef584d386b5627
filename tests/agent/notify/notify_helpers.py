"""Events and a hand-driven wall clock for the notifier and delivery tests."""

from __future__ import annotations

from typing import Literal

from kvpilot.agent.model import AlertEvent, fingerprint, labels_of

START_WALL_S = 1_760_000_000.25


def make_event(
    alertname: str = "VllmKvFragmentationHigh",
    *,
    instance: str = "vllm-0",
    status: Literal["firing", "resolved"] = "firing",
    starts_at_wall_s: float = START_WALL_S,
    ends_at_wall_s: float | None = None,
    summary: str = "fragmentation 0.41 > 0.30 for 60 s",
    incident_id: str = "inc-1",
    extra_labels: dict[str, str] | None = None,
) -> AlertEvent:
    labels = labels_of(
        {
            "alertname": alertname,
            "instance": instance,
            "model_name": "tiny-llama",
            "engine": "0",
            "source": "kv_blocks",
            "severity": "warning",
            **(extra_labels or {}),
        }
    )
    if status == "resolved" and ends_at_wall_s is None:
        ends_at_wall_s = starts_at_wall_s + 95.0
    return AlertEvent(
        fingerprint=fingerprint(labels),
        incident_id=incident_id,
        status=status,
        labels=labels,
        annotations=labels_of({"summary": summary, "runbook_url": "https://example.org/rb"}),
        starts_at_wall_s=starts_at_wall_s,
        ends_at_wall_s=ends_at_wall_s,
        generator_url="http://127.0.0.1:9400/api/v1/alerts",
    )


class FakeClock:
    """Wall time that moves only when a test says so."""

    def __init__(self, start_wall_s: float = START_WALL_S) -> None:
        self.now_wall_s = start_wall_s

    def __call__(self) -> float:
        return self.now_wall_s

    def advance(self, seconds: float) -> None:
        self.now_wall_s += seconds
