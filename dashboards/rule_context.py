"""What every generated rule is sized and annotated by: the scrape interval, and where the
runbooks are."""

from __future__ import annotations

import importlib.metadata
from collections.abc import Mapping
from dataclasses import dataclass

# The shipped ServiceMonitor's interval (deploy/base/servicemonitor.yaml; a test keeps them equal).
SCRAPE_INTERVAL_S = 15.0
# A range holds at least this many scrapes: rate() over two samples jumps with one late scrape,
# and Prometheus 3's left-open ranges hold one sample fewer than 2's.
MIN_SCRAPES_PER_WINDOW = 4
# An alert's condition holds over at least this many scrapes before it fires.
MIN_SCRAPES_PER_FOR = 2


@dataclass(frozen=True, slots=True)
class Timing:
    """Windows and `for` durations sized to the scrape interval of the series they read."""

    scrape_interval_s: float = SCRAPE_INTERVAL_S

    def __post_init__(self) -> None:
        if not self.scrape_interval_s > 0:
            raise ValueError(f"scrape interval {self.scrape_interval_s} s: must be above 0")

    def window_s(self, wanted_s: float) -> float:
        """`wanted_s`, or four scrapes when that is longer."""
        return max(wanted_s, MIN_SCRAPES_PER_WINDOW * self.scrape_interval_s)

    def for_s(self, wanted_s: float) -> float:
        """`wanted_s`, or two scrapes when that is longer (never `0s`)."""
        return max(wanted_s, MIN_SCRAPES_PER_FOR * self.scrape_interval_s)


# The repository, and its runbooks' folder in it.
SOURCE_URL = "https://github.com/kvpilot/kvpilot"
RUNBOOK_PATH = "docs/runbooks/"
# This version's tag (a release step: docs/release.md), installed metadata being pyproject's.
VERSION_TAG = f"v{importlib.metadata.version('kvpilot')}"
# Where `runbook_url` points by default: the runbooks of this version, absolute, so that a
# link in Slack or PagerDuty opens; `kvpilot rules --runbook-url-base` names another copy.
RUNBOOK_URL_BASE = f"{SOURCE_URL}/blob/{VERSION_TAG}/{RUNBOOK_PATH}"


# Where an alert is, in its summary: `namespace/pod` where the target has them (Kubernetes,
# where `instance` is a pod's address), else `instance`.
WHERE = (
    "{{ if $labels.pod }}{{ $labels.namespace }}/{{ $labels.pod }}"
    "{{ else }}{{ $labels.instance }}{{ end }}"
)


def duration(seconds: float) -> str:
    """A Prometheus duration (whole seconds; 0 is `0s`)."""
    return f"{round(seconds)}s"


def number(value: float) -> str:
    """A threshold as PromQL reads it, without rounding it away."""
    return format(value, ".12g")


@dataclass(frozen=True, slots=True)
class AlertContext:
    """How every alert is timed and annotated: descriptions by name, runbooks by name."""

    timing: Timing
    descriptions: Mapping[str, str]
    runbook_url_base: str

    def annotations(
        self, name: str, summary: str, description: str = "", variant: str | None = None
    ) -> dict[str, str]:
        """summary, description (the agent's runbook text for `name/variant` or `name`, where
        it has one) and runbook_url."""
        own = self.descriptions.get(f"{name}/{variant}") if variant else None
        text = own or self.descriptions.get(name) or description
        return {
            "summary": summary,
            "description": text,
            "runbook_url": f"{self.runbook_url_base}{name}.md",
        }
