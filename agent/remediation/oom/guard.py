"""The OOM guard: a server that died of memory comes back with its memory knob moved.

Asked by the remediator for a plan when `VllmServerDown` fires (and by `kvpilot run` when a
server fails its first start), it reads the exit code, the log tail and the cgroup's
OOM-kill count, classifies the death (`tuner.oom`), and plans the step (`step.py`):

* too big: a promotion of the stepped-down flags, run by the remediator under its guards
  (budget, circuit breaker, cooldown) and recorded as promoted with the reason;
* too small: a step up within what the planner says fits, or reported as such;
* a runtime that cannot change flags (the process runtime): a recommendation naming them;
* a refused step (the planner's pre-flight): alert only, the refusal as the reason.

Each memory death raises `KvpilotServerOOM`, which resolves once the server runs again.
Anything else (no evidence of memory) is left to the ordinary restart.
"""

from __future__ import annotations

import logging
import shlex
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from kvpilot.agent.alerts import new_incident_id
from kvpilot.agent.config.remediation import OomConfig
from kvpilot.agent.model import Action, AlertEvent, Instance, fingerprint, labels_of
from kvpilot.agent.remediation.events import resolved
from kvpilot.agent.remediation.ladder import LadderPlan
from kvpilot.agent.remediation.oom.cgroup import OomKillCount, own_events_file, read_oom_kills
from kvpilot.agent.remediation.oom.step import NoStep, plan_step
from kvpilot.agent.remediation.trigger import Trigger
from kvpilot.agent.runtimes.base import InstanceStatus
from kvpilot.agent.runtimes.probe import START_MARKER
from kvpilot.agent.state.decision import Decision
from kvpilot.collectors.secrets import mask_argv
from kvpilot.tuner.oom import ExitFacts, NotOom, OomVerdict, classify_exit
from kvpilot.tuner.planner.preflight import KnobRange

log = logging.getLogger(__name__)

SERVER_OOM_ALERT = "KvpilotServerOOM"
OOM_RULES = frozenset({"server_down", "startup"})  # the triggers a memory death comes as
_LOG_CHARS = 20_000  # vLLM's tracebacks after the root cause are long
# The planner's range for an instance's argv, or why it cannot give one.
RangeFor = Callable[[str, Sequence[str]], KnobRange | str]


class OomRuntime(Protocol):
    """What the guard reads of a runtime; `log_tail` and `termination_reason` are optional."""

    @property
    def can_change_flags(self) -> bool: ...

    def status(self, name: str) -> InstanceStatus: ...


@dataclass(frozen=True, slots=True)
class OomAnswer:
    """The guard's reading of one death: the verdict, and the plan for the remediator."""

    verdict: OomVerdict
    plan: LadderPlan
    acted: bool  # a step is planned (a promotion or a recommendation), not only an alert


class OomGuard:
    """Classifies memory deaths, plans the step, raises and resolves `KvpilotServerOOM`."""

    def __init__(
        self,
        config: OomConfig,
        runtime: OomRuntime,
        range_for: RangeFor,
        *,
        events_file: Path | None = None,
        wall_clock: Callable[[], float] = time.time,
        new_id: Callable[[], str] = new_incident_id,
    ) -> None:
        self.config = config
        self._runtime = runtime
        self._range_for = range_for
        self._events_file = config.memory_events_path or events_file or own_events_file()
        self._wall_clock = wall_clock
        self._new_id = new_id
        self._baseline: dict[str, int | None] = {}
        self._steps: dict[str, int] = {}
        self._waiting: list[AlertEvent] = []
        # By instance: firing until its step's restart succeeded (`ended`), or, where no
        # restart was planned (advice, a refusal), until it runs again.
        self._open: dict[str, tuple[AlertEvent, bool]] = {}

    # -- evidence ----------------------------------------------------------------------

    def oom_kills(self) -> OomKillCount:
        if self._events_file is None:
            return OomKillCount(None, None, "no cgroup file with an oom_kill count")
        return read_oom_kills(self._events_file)

    def started(self, name: str) -> None:
        """The instance starts now: its OOM kills are counted from here."""
        self._baseline[name] = self.oom_kills().count

    def facts(self, name: str) -> ExitFacts:
        """The exit as the runtime and the cgroup tell it."""
        status = self._runtime.status(name)
        log_tail = getattr(self._runtime, "log_tail", None)
        termination = getattr(self._runtime, "termination_reason", None)
        return ExitFacts(
            exit_code=status.exit_code,
            log_text=_last_start(log_tail(name, _LOG_CHARS)) if callable(log_tail) else None,
            oom_kills_before=self._baseline.get(name),
            oom_kills_after=self.oom_kills().count,
            container_reason=termination(name) if callable(termination) else None,
        )

    # -- the plan ----------------------------------------------------------------------

    def plan(self, trigger: Trigger, instance: Instance) -> OomAnswer | None:
        """The plan for a memory death of `instance`, or None (not one: the ordinary plan)."""
        if not self.config.enabled or trigger.rule not in OOM_RULES or instance.role == "canary":
            return None  # canaries: the tuner's judge reads their failed starts
        verdict = classify_exit(self.facts(trigger.instance))
        self.started(trigger.instance)  # this death is read: a later one counts anew
        if isinstance(verdict, NotOom):
            log.info("instance %s exited, not of memory: %s", trigger.instance, verdict.reason)
            return None
        answer = self._answer(trigger, instance, verdict)
        self._raise(trigger, instance, answer)
        return answer

    def _answer(self, trigger: Trigger, instance: Instance, verdict: OomVerdict) -> OomAnswer:
        rule, name = trigger.rule, trigger.instance
        said = f"{verdict.message}" + (f" [{verdict.log_line}]" if verdict.log_line else "")
        if self._steps.get(name, 0) >= self.config.max_steps:
            why = f"{said}; {self.config.max_steps} steps taken already (remediation.oom.max_steps)"
            return OomAnswer(verdict, LadderPlan(rule, "oom", (), why), acted=False)
        argv = instance.argv
        if argv is None:
            why = f"{said}; the server's flags are not known, so no step can be planned"
            return OomAnswer(verdict, LadderPlan(rule, "oom", (), why), acted=False)
        knob_range = self._range_for(name, argv)
        if isinstance(knob_range, str):
            why = f"{said}; the planner cannot bound the knob: {knob_range}"
            return OomAnswer(verdict, LadderPlan(rule, "oom", (), why), acted=False)
        step = plan_step(argv, verdict, self.config, knob_range)
        if isinstance(step, NoStep):
            return OomAnswer(verdict, LadderPlan(rule, "oom", (), f"{said}; {step.reason}"), False)
        if trigger.facts.action == Action.ALERT and rule != "startup":
            why = f"{step.reason}; {rule}'s action is alert: suggested, not applied"
            return OomAnswer(verdict, LadderPlan(rule, "oom", (), why, step.argv), acted=False)
        self._steps[name] = self._steps.get(name, 0) + 1
        if not self._runtime.can_change_flags:
            why = f"{step.reason}; this runtime cannot change the server's flags: restart it so"
            return OomAnswer(
                verdict, LadderPlan(rule, "oom", ("recommend_config",), why, step.argv), True
            )
        return OomAnswer(
            verdict, LadderPlan(rule, "oom", ("promote",), step.reason, step.argv), True
        )

    # -- the alert ---------------------------------------------------------------------

    def _raise(self, trigger: Trigger, instance: Instance, answer: OomAnswer) -> None:
        verdict, plan = answer.verdict, answer.plan
        labels = labels_of(
            {
                "alertname": SERVER_OOM_ALERT,
                "instance": trigger.instance,
                "role": instance.role,
                "severity": "critical",
            }
        )
        if "promote" in plan.steps:
            what = "kvpilot restarts it with the memory knob stepped"
        elif plan.steps:
            what = "restart it with the suggested flags"
        else:
            what = "kvpilot does not step the knob"
        summary = f"vLLM on {trigger.instance} died of memory ({verdict.direction}): {what}"
        notes = {
            "summary": summary,
            "description": f"{summary}. {plan.reason}",
            "direction": str(verdict.direction),
            "evidence": str(verdict.source),
        }
        if plan.argv is not None:
            notes["suggested_flags"] = shlex.join(mask_argv(plan.argv))
        event = AlertEvent(
            fingerprint=fingerprint(labels),
            incident_id=trigger.incident_id or self._new_id(),
            status="firing",
            labels=labels,
            annotations=labels_of(notes),
            starts_at_wall_s=self._wall_clock(),
            ends_at_wall_s=None,
            generator_url="",
        )
        self._open[trigger.instance] = (event, "promote" in plan.steps)
        self._waiting.append(event)

    def ended(self, name: str, decision: Decision) -> None:
        """A remediation of `name` ended: a succeeded restart resolves its ServerOOM."""
        if decision is not Decision.SUCCEEDED or name not in self._open:
            return
        event, _ = self._open.pop(name)
        if event in self._waiting:  # not yet taken: resolved on a later take, never before
            self._open[name] = (event, False)
        else:
            self._waiting.append(resolved(event, self._wall_clock()))

    def take_events(self) -> list[AlertEvent]:
        """Alerts since the last call; one without a planned restart resolves once its
        server runs again (after it was taken once, so the firing is never overtaken)."""
        out, self._waiting = self._waiting, []
        for name, (event, restarting) in list(self._open.items()):
            if restarting or event in out:
                continue
            if self._runtime.status(name).state == "running":
                del self._open[name]
                out.append(resolved(event, self._wall_clock()))
        return out


def _last_start(text: str | None) -> str | None:
    """The log of the latest start only: an earlier start's error is not this death's."""
    return None if text is None else text.rsplit(START_MARKER, 1)[-1]
