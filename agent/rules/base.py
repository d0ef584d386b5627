"""What every rule shares: the context of one evaluation, the protocol, and condition builders.

A rule keeps only what it needs across ticks (the targets it saw, a history the windows do
not hold); the engine owns one instance of each rule for the agent's lifetime.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from kvpilot.agent.model import Action, AlertFacts, Condition, Instance, Labels, labels_of
from kvpilot.agent.readings.derive import EngineFigures
from kvpilot.agent.readings.snapshot import Snapshot
from kvpilot.collectors.errors import SourceError
from kvpilot.collectors.kvpool.client import KvBlockSample
from kvpilot.collectors.secrets import mask_text
from kvpilot.collectors.vllm_metrics import EngineSample
from kvpilot.collectors.window import RollingWindow


@dataclass(frozen=True, slots=True)
class RuleContext:
    """Everything one rule sees at one tick, for one instance; every rule sees the same."""

    snapshot: Snapshot
    vllm_window: RollingWindow[EngineSample]
    kvpool_window: RollingWindow[KvBlockSample]
    figures: tuple[EngineFigures, ...]
    instance: Instance
    # What the runtime says of the instance's process: running, exited, missing, unknown.
    instance_state: str | None = None
    instance_state_reason: str | None = None

    @property
    def now_s(self) -> float:
        """Monotonic time of this tick: the snapshot's stamp."""
        return self.snapshot.taken_at_s


class Rule(Protocol):
    """Turns one tick's context into conditions: active, inactive, or unknown with a reason."""

    name: str

    def evaluate(self, ctx: RuleContext) -> list[Condition]: ...


def source_error_text(error: SourceError) -> str:
    """A reason for conditions a failed source leaves unknown; masked, since it travels to
    the API, every receiver and the state database, and a message may name a URL."""
    return mask_text(f"{error.source} source down ({error.kind}): {error.message}")


class ConditionSettings(Protocol):
    """What every rule's section of the rules config carries for its conditions."""

    @property
    def severity(self) -> str: ...

    @property
    def labels(self) -> Mapping[str, str]: ...

    @property
    def for_s(self) -> float: ...

    @property
    def action(self) -> str: ...


class ConditionMaker:
    """Builds one rule's conditions with its alertname, severity, user labels and runbook,
    and the rule's own `for_s` and `action` as typed fields (the tracker and the remediator
    read those; the `action` annotation is only for people)."""

    def __init__(
        self,
        *,
        rule: str,
        alertname: str,
        severity: str,
        user_labels: Mapping[str, str],
        runbook: str,
        for_s: float,
        action: Action,
    ) -> None:
        self.rule = rule
        self.alertname = alertname
        self.for_s = for_s
        self.action = action
        self._severity = severity
        self._user_labels = dict(user_labels)
        self._runbook = runbook
        # Targets seen per instance, so a source outage makes them unknown, not absent.
        self._known: dict[str, dict[Labels, None]] = {}

    @classmethod
    def of(
        cls, settings: ConditionSettings, *, rule: str, alertname: str, runbook: str
    ) -> ConditionMaker:
        """The maker of a rule whose section gives its severity, labels, `for_s` and action."""
        return cls(
            rule=rule,
            alertname=alertname,
            severity=settings.severity,
            user_labels=settings.labels,
            runbook=runbook,
            for_s=settings.for_s,
            action=Action(settings.action),
        )

    def labels(self, ctx: RuleContext, target: Mapping[str, str]) -> Labels:
        """The alert's labels: user labels first, then kvpilot's own (which win)."""
        return labels_of(
            {
                **self._user_labels,
                **target,
                "alertname": self.alertname,
                "instance": ctx.instance.name,
                "role": ctx.instance.role,
                "severity": self._severity,
            }
        )

    def condition(
        self,
        ctx: RuleContext,
        target: Mapping[str, str],
        *,
        active: bool | None,
        value: float | None,
        summary: str,
        description: str,
        reason: str | None = None,
        extra: Mapping[str, str] | None = None,
        capacity_leak: bool | None = None,
        thrash: bool | None = None,
        admission_refused: bool | None = None,
    ) -> Condition:
        """One condition about one target; its labels are remembered for outages."""
        labels = self.labels(ctx, target)
        self._known.setdefault(ctx.instance.name, {})[labels] = None
        annotations = {
            **(extra or {}),
            "action": self.action.value,
            "summary": summary,
            "description": description,
            "runbook": self._runbook,
        }
        if reason is not None:
            annotations["unknown_reason"] = reason
        return Condition(
            rule=self.rule,
            labels=labels,
            active=active,
            value=value,
            summary=summary,
            reason=reason,
            annotations=labels_of(annotations),
            for_s=self.for_s,
            facts=AlertFacts(self.action, capacity_leak, thrash, admission_refused),
        )

    def was_seen(self, ctx: RuleContext, target: Mapping[str, str]) -> bool:
        """Whether this target had a condition at the last successful read."""
        return self.labels(ctx, target) in self._known.get(ctx.instance.name, {})

    def per_engine(
        self, ctx: RuleContext, judge: Callable[[RuleContext, EngineSample], Condition]
    ) -> list[Condition]:
        """One condition per engine of the vLLM scrape (targets no longer seen forgotten);
        every known target unknown when the scrape failed."""
        scrape = ctx.snapshot.vllm
        if isinstance(scrape, SourceError):
            return self.unknown_all(ctx, source_error_text(scrape))
        out = [judge(ctx, sample) for sample in scrape.engines]
        self.forget_except(ctx, out)
        return out

    def forget_except(self, ctx: RuleContext, seen: list[Condition]) -> None:
        """After a successful read: targets not reported any more are gone."""
        self._known[ctx.instance.name] = {c.labels: None for c in seen}

    def unknown_all(self, ctx: RuleContext, reason: str) -> list[Condition]:
        """Unknown for every target seen before, or one instance-level unknown if none."""
        known = self._known.get(ctx.instance.name)
        summary = f"{self.alertname} unknown on {ctx.instance.name}: {reason}"
        annotations = labels_of(
            {
                "summary": summary,
                "description": summary,
                "runbook": self._runbook,
                "unknown_reason": reason,
            }
        )
        if not known:
            return [
                Condition(
                    rule=self.rule,
                    labels=self.labels(ctx, {}),
                    active=None,
                    value=None,
                    summary=summary,
                    reason=reason,
                    annotations=annotations,
                    for_s=self.for_s,
                    facts=AlertFacts(self.action),
                )
            ]
        return [
            Condition(
                rule=self.rule,
                labels=labels,
                active=None,
                value=None,
                summary=summary,
                reason=reason,
                annotations=annotations,
                for_s=self.for_s,
                facts=AlertFacts(self.action),
            )
            for labels in known
        ]


def fmt_ratio(value: float) -> str:
    return f"{value:.3f}"


def fmt_bytes(value: float) -> str:
    return f"{value / (1024 * 1024):.1f} MiB"
