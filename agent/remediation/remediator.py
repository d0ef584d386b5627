"""The remediator: turns firing alerts into ladders and runs them under the guards.

One remediation at a time per instance (an asyncio lock). Every state transition is
written to the journal before the step it announces starts, so a crash leaves a record of
how far it got; `reconcile` at the next start fails those records and makes sure an
incident whose server may already have been restarted is not restarted again.

The tick drives it: `observe(transitions, conditions)` plans a remediation for each alert
that starts firing, settles the watches of running remediations, and keeps the breaker's
books (an alert that fires again within `recurrence_window_s` of a restart counts as a
failed restart). Pages and advice it produces wait in `take_events()` for the agent to
enqueue. Time: the injected monotonic `clock` for guards and watches, `wall_clock` for
records.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from kvpilot.agent.alerts import AlertTransition, new_incident_id
from kvpilot.agent.config.models import RemediationConfig
from kvpilot.agent.model import AlertEvent, Condition, Instance, Labels
from kvpilot.agent.remediation.decision import Decision
from kvpilot.agent.remediation.events import circuit_open_event, resolved, tuning_recommended_event
from kvpilot.agent.remediation.facts import AlertFacts
from kvpilot.agent.remediation.guards import (
    BreakerChange,
    BreakerState,
    CircuitBreaker,
    Cooldown,
    GuardDecision,
    RestartBudget,
)
from kvpilot.agent.remediation.journal import (
    INTERRUPTED_AFTER_RESTART_BEGAN,
    NOT_RESTARTED,
    RESTART_FAILED,
    RESTART_STATES,
    VERIFY_FAILED,
    RemediationJournal,
    restart_began,
    unfinished,
)
from kvpilot.agent.remediation.ladder import (
    BetterConfig,
    Plan,
    manual_plan,
    no_better_config,
    plan_for,
)
from kvpilot.agent.remediation.prefix_cache import LightStep
from kvpilot.agent.remediation.preflight import MemoryCheck
from kvpilot.agent.remediation.watch import DEFAULT_WINDOWS, ConditionWatch, WatchWindows

if TYPE_CHECKING:
    from kvpilot.agent.state.store import Actor, RemediationState

log = logging.getLogger(__name__)

BREAKER_FACT = "remediation.breaker.{instance}"
VETO_FACT = "remediation.vetoes"

# The journal state a remediation's record ends in, by its decision.
FINAL_STATE: dict[Decision, RemediationState] = {
    Decision.SUCCEEDED: "succeeded",
    Decision.FAILED: "failed",
    Decision.SKIPPED: "skipped",
    Decision.VETOED: "vetoed",
    Decision.DRY_RUN: "skipped",  # nothing was done
}


class RestartTarget(Protocol):
    """What the remediator needs of a runtime."""

    def instances(self) -> tuple[Instance, ...]: ...

    async def restart(
        self,
        name: str,
        *,
        drain_timeout_s: float,
        ready_timeout_s: float,
        argv: Sequence[str] | None = None,
    ) -> Instance: ...


class Preflight(Protocol):
    def check(self, instance: Instance) -> MemoryCheck: ...


@dataclass(frozen=True, slots=True)
class Trigger:
    """A request to remediate one instance: from a firing alert, or from the API."""

    instance: str
    rule: str
    fingerprint: str | None
    incident_id: str | None
    labels: Labels = ()
    facts: AlertFacts = field(default_factory=AlertFacts)  # what the ladder decides on
    actor: Actor = "rule"
    requested_by: str | None = None
    force: bool = False


@dataclass(frozen=True, slots=True)
class Outcome:
    """How one remediation ended."""

    instance: str
    incident_id: str | None
    decision: Decision
    reason: str
    remediation_id: int | None
    steps: tuple[str, ...] = ()
    old_pid: int | None = None
    new_pid: int | None = None


@dataclass(frozen=True, slots=True)
class ActiveRemediation:
    """A remediation not finished yet, for the status API and the tuner."""

    remediation_id: int
    instance: str
    incident_id: str | None
    action: str
    state: RemediationState
    since_wall_s: float


@dataclass(frozen=True, slots=True)
class BreakerView:
    instance: str
    state: BreakerState
    failures: int


@dataclass(frozen=True, slots=True)
class RemediationStatus:
    """Everything `GET /api/v1/status` shows of remediation."""

    dry_run: bool
    active: tuple[ActiveRemediation, ...]
    breakers: tuple[BreakerView, ...]
    vetoed_instances: tuple[str, ...]
    vetoed_incidents: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Reconciled:
    """One record a previous run left unfinished, and what reconcile made of it."""

    remediation_id: int
    instance: str
    incident_id: str | None
    previous_state: str
    restart_may_have_happened: bool
    reason: str


@dataclass(slots=True)
class _Recurrence:
    instance: str
    restarted_at_s: float
    remediation_id: int


class _Stop(Exception):
    """Ends a remediation early with an outcome already recorded."""

    def __init__(self, outcome: Outcome) -> None:
        super().__init__(outcome.reason)
        self.outcome = outcome


class Remediator:
    """Plans and runs remediations; see the module docstring for the contract."""

    def __init__(
        self,
        runtime: RestartTarget,
        journal: RemediationJournal,
        config: RemediationConfig,
        *,
        runtime_drain_timeout_s: float = 0.0,
        windows: WatchWindows = DEFAULT_WINDOWS,
        preflight: Preflight | None = None,
        light_step: LightStep | None = None,
        better_config: BetterConfig = no_better_config,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        new_id: Callable[[], str] = new_incident_id,
    ) -> None:
        self._runtime = runtime
        self._journal = journal
        self.config = config
        # 0 in the section: the runtime's own SIGTERM drain window before it kills the server.
        self._drain_timeout_s = config.drain_timeout_s or runtime_drain_timeout_s
        self._windows = windows
        self._preflight = preflight
        self._light_step = light_step
        self._better_config = better_config
        self._clock = clock
        self._wall_clock = wall_clock
        self._new_id = new_id
        self.cooldown = Cooldown(config.cooldown_s)
        self.budget = RestartBudget(config.budget.max_restarts, config.budget.window_s)
        self.breaker = CircuitBreaker(
            config.circuit_breaker.failures_to_open, config.circuit_breaker.open_for_s
        )
        self._watch = ConditionWatch()
        self._locks: dict[str, asyncio.Lock] = {}
        self._active: dict[int, ActiveRemediation] = {}
        self._old_pids: dict[int, int | None] = {}
        self._tasks: set[asyncio.Task[Outcome]] = set()
        self._recurrence: dict[str, _Recurrence] = {}
        self._pages: dict[str, AlertEvent] = {}  # open circuit pages by instance
        self._advice: dict[str, AlertEvent] = {}  # tuning advice by source fingerprint
        self._events: list[AlertEvent] = []
        self._vetoed_instances: set[str] = set()
        self._vetoed_incidents: set[str] = set()
        if light_step is not None and config.light_step_reset_prefix_cache:
            log.warning(
                "remediation: the prefix-cache reset step uses vLLM's dev endpoints "
                "(VLLM_SERVER_DEV_MODE=1), which are unauthenticated: keep the port private"
            )

    # -- views -------------------------------------------------------------------------

    def in_progress(self) -> bool:
        """Whether any remediation is planned or running (the tuner waits while one is)."""
        return bool(self._active)

    def status(self) -> RemediationStatus:
        now_s = self._clock()
        names = {i.name for i in self._runtime.instances()} | set(self._pages)
        return RemediationStatus(
            dry_run=self.config.dry_run,
            active=tuple(self._active.values()),
            breakers=tuple(
                BreakerView(n, self.breaker.state(n, now_s), self.breaker.failures(n))
                for n in sorted(names)
            ),
            vetoed_instances=tuple(sorted(self._vetoed_instances)),
            vetoed_incidents=tuple(sorted(self._vetoed_incidents)),
        )

    def take_events(self) -> list[AlertEvent]:
        """Pages and advice produced since the last call, for the agent to enqueue."""
        events, self._events = self._events, []
        return events

    # -- the tick ----------------------------------------------------------------------

    def observe(
        self,
        transitions: Iterable[AlertTransition],
        conditions: Iterable[Condition],
        *,
        now_s: float | None = None,
    ) -> list[asyncio.Task[Outcome]]:
        """One tick: settle watches, keep the breaker's books, start remediations."""
        now_s = self._clock() if now_s is None else now_s
        conditions = list(conditions)
        transitions = list(transitions)
        by_fp = {c.fingerprint: c for c in conditions}
        resolved_fps = [t.fingerprint for t in transitions if t.to_state == "resolved"]
        self._watch.settle(conditions, now_s, resolved_fps)
        for fp in resolved_fps:
            advice = self._advice.pop(fp, None)
            if advice is not None:
                self._events.append(resolved(advice, self._wall_clock()))
        started = []
        for t in transitions:
            if t.to_state != "firing" or t.repeat or t.from_state == "firing":
                continue
            instance = dict(t.labels).get("instance")
            if instance is None:
                continue
            self._note_recurrence(t.fingerprint, now_s)
            condition = by_fp.get(t.fingerprint)
            annotations = (
                condition.annotations
                if condition is not None
                else (t.event.annotations if t.event else ())
            )
            facts = AlertFacts.from_annotations(annotations)
            trigger = Trigger(instance, t.rule, t.fingerprint, t.incident_id, t.labels, facts)
            started.append(self.submit(trigger))
        self._expire_recurrences(now_s)
        return started

    def submit(self, trigger: Trigger, plan: Plan | None = None) -> asyncio.Task[Outcome]:
        """Run `remediate` in the background; the task is kept until it ends."""
        task = asyncio.get_running_loop().create_task(self.remediate(trigger, plan))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def wait_idle(self) -> None:
        """Until every background remediation has ended."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def aclose(self) -> None:
        """Cancel running remediations (each records itself as interrupted)."""
        for task in list(self._tasks):
            task.cancel()
        await self.wait_idle()

    def _note_recurrence(self, fingerprint: str, now_s: float) -> None:
        recurrence = self._recurrence.pop(fingerprint, None)
        if recurrence is None:
            return
        elapsed = now_s - recurrence.restarted_at_s
        if elapsed > self.config.circuit_breaker.hold_s:
            self._breaker_success(recurrence.instance, now_s)
            return
        reason = f"the alert fired again {elapsed:.0f} s after the restart"
        self._audit_raw(
            "agent", "circuit_breaker", recurrence.instance, "failure counted", reason,
            None, recurrence.remediation_id,
        )  # fmt: skip
        self._breaker_failure(recurrence.instance, now_s, reason)

    def _expire_recurrences(self, now_s: float) -> None:
        for fp, recurrence in list(self._recurrence.items()):
            if now_s - recurrence.restarted_at_s > self.config.circuit_breaker.hold_s:
                del self._recurrence[fp]
                self._breaker_success(recurrence.instance, now_s)

    # -- the API's calls ---------------------------------------------------------------

    async def trigger(
        self, instance: str, *, requested_by: str, force: bool = False, reason: str = ""
    ) -> Outcome:
        """An operator's restart now; under the guards unless `force` (canaries: never)."""
        text = reason or f"manual restart requested by {requested_by}"
        trigger = Trigger(
            instance=instance,
            rule="manual",
            fingerprint=None,
            incident_id=f"manual-{self._new_id()}",
            actor="api",
            requested_by=requested_by,
            force=force,
        )
        return await self.remediate(trigger, manual_plan(text))

    def veto(
        self,
        *,
        requested_by: str,
        reason: str,
        instance: str | None = None,
        incident_id: str | None = None,
    ) -> None:
        """Skip pending and future remediations of an incident or an instance."""
        if (instance is None) == (incident_id is None):
            raise ValueError("veto exactly one of instance or incident_id")
        if instance is not None:
            self._vetoed_instances.add(instance)
        if incident_id is not None:
            self._vetoed_incidents.add(incident_id)
        self._save_vetoes()
        self._audit_raw(
            "api", "veto", instance or "*", "vetoed", reason, incident_id, None,
            {"requested_by": requested_by},
        )  # fmt: skip

    def lift_veto(
        self,
        *,
        requested_by: str,
        reason: str,
        instance: str | None = None,
        incident_id: str | None = None,
    ) -> bool:
        """End a veto; False when there was none."""
        found = False
        if instance is not None and instance in self._vetoed_instances:
            self._vetoed_instances.discard(instance)
            found = True
        if incident_id is not None and incident_id in self._vetoed_incidents:
            self._vetoed_incidents.discard(incident_id)
            found = True
        if found:
            self._save_vetoes()
            self._audit_raw(
                "api", "veto", instance or "*", "veto lifted", reason, incident_id, None,
                {"requested_by": requested_by},
            )  # fmt: skip
        return found

    def reset_breaker(self, instance: str, *, requested_by: str, reason: str) -> bool:
        """Close the instance's circuit breaker (the page resolves); False if it was closed."""
        now_s = self._clock()
        change = self.breaker.reset(instance, reason)
        self._save_breaker(instance, now_s)
        self._audit_raw(
            "api", "circuit_breaker", instance, "reset" if change else "reset (was closed)",
            reason, None, None, {"requested_by": requested_by},
        )  # fmt: skip
        if change is not None:
            self._on_breaker_change(change)
        return change is not None

    # -- start-up ----------------------------------------------------------------------

    def reconcile(self) -> list[Reconciled]:
        """After a restart of kvpilot: fail unfinished records, restore guards and vetoes."""
        now_s, now_wall_s = self._clock(), self._wall_clock()
        out = []
        for record in unfinished(self._journal):
            began = record.state in RESTART_STATES
            if began:
                reason = (
                    f"{INTERRUPTED_AFTER_RESTART_BEGAN}kvpilot stopped while {record.state}; "
                    "the server may have been restarted, so this incident is not restarted again"
                )
            else:
                reason = f"{NOT_RESTARTED}kvpilot stopped while {record.state}"
            self._journal.update_remediation(
                record.id, state="failed", reason=reason, now_wall_s=now_wall_s
            )
            self._audit_raw(
                "agent", record.action, record.instance, Decision.INTERRUPTED, reason,
                record.incident_id, record.id, {"previous_state": record.state},
            )  # fmt: skip
            out.append(
                Reconciled(
                    record.id, record.instance, record.incident_id, record.state, began, reason
                )
            )
        self._restore(now_s, now_wall_s)
        return out

    def _restore(self, now_s: float, now_wall_s: float) -> None:
        horizon = max(self.config.budget.window_s, self.config.cooldown_s)
        history = self._journal.remediations(since_wall_s=now_wall_s - horizon, limit=10_000)
        names = {i.name for i in self._runtime.instances()}
        for record in history:
            names.add(record.instance)
            if restart_began(record):
                stamp_s = now_s - (now_wall_s - record.started_wall_s)
                self.budget.seed(record.instance, [stamp_s], now_s)
                self.cooldown.record(record.instance, stamp_s)
        for name in names:
            fact = self._journal.get_fact(BREAKER_FACT.format(instance=name))
            if isinstance(fact, dict):
                self.breaker.restore(name, fact, now_s, now_wall_s)
                page = fact.get("page")
                if isinstance(page, dict) and self.breaker.state(name, now_s) != "closed":
                    self._pages[name] = _page_from_fact(name, page)
        vetoes = self._journal.get_fact(VETO_FACT)
        if isinstance(vetoes, dict):
            self._vetoed_instances = set(vetoes.get("instances") or ())
            self._vetoed_incidents = set(vetoes.get("incidents") or ())

    # -- one remediation ---------------------------------------------------------------

    async def remediate(self, trigger: Trigger, plan: Plan | None = None) -> Outcome:
        """Plan, guard and run one remediation to its end; never raises for its failures."""
        instance = self._find(trigger.instance)
        if instance is None:
            return self._finish_new(trigger, Decision.SKIPPED, "unknown instance")
        if instance.role == "canary":
            return self._finish_new(
                trigger, Decision.SKIPPED, "skipped: canary (the tuner's judge acts on canaries)"
            )
        if plan is None:
            plan = plan_for(
                trigger.rule,
                trigger.facts,
                trigger.instance,
                light_step_enabled=self._light_enabled(),
                better_config=self._better_config,
            )
        if not plan.steps:
            self._audit(trigger, None, plan.action, Decision.ALERT_ONLY, plan.reason)
            return Outcome(
                trigger.instance, trigger.incident_id, Decision.ALERT_ONLY, plan.reason, None
            )
        if plan.steps == ("recommend_tuning",):
            return self._recommend(trigger, plan)
        if trigger.incident_id is not None and self._incident_restarted(trigger.incident_id):
            reason = f"skipped: incident {trigger.incident_id} was already restarted once"
            return self._finish_new(trigger, Decision.SKIPPED, reason, plan)
        if self._vetoed(trigger):
            return self._finish_new(trigger, Decision.VETOED, self._veto_reason(trigger), plan)
        rid = self._journal.start_remediation(
            instance=trigger.instance,
            action=_action(plan),
            state="planned",
            reason=plan.reason,
            started_wall_s=self._wall_clock(),
            incident_id=trigger.incident_id,
            fingerprint=trigger.fingerprint,
            old_pid=instance.main_pid,
        )
        self._set_active(rid, trigger, plan, "planned")
        self._old_pids[rid] = instance.main_pid
        self._audit(
            trigger, rid, _action(plan), Decision.PLANNED, plan.reason, {"steps": plan.steps}
        )
        state: RemediationState = "planned"
        try:
            async with self._locks.setdefault(trigger.instance, asyncio.Lock()):
                return await self._run(trigger, plan, rid)
        except _Stop as stop:
            return stop.outcome
        except asyncio.CancelledError:
            state = self._active[rid].state if rid in self._active else state
            prefix = INTERRUPTED_AFTER_RESTART_BEGAN if state in RESTART_STATES else NOT_RESTARTED
            reason = f"{prefix}kvpilot shutting down during {state}"
            self._end(rid, trigger, plan, Decision.FAILED, reason)
            raise
        except Exception as exc:  # a bug must not leave the record open or kill the tick
            log.exception("remediation %s of %s failed unexpectedly", rid, trigger.instance)
            state = self._active[rid].state if rid in self._active else state
            prefix = INTERRUPTED_AFTER_RESTART_BEGAN if state in RESTART_STATES else NOT_RESTARTED
            reason = f"{prefix}internal error during {state}: {type(exc).__name__}: {exc}"
            return self._end(rid, trigger, plan, Decision.FAILED, reason)
        finally:
            self._active.pop(rid, None)

    async def _run(self, trigger: Trigger, plan: Plan, rid: int) -> Outcome:
        instance = self._find(trigger.instance)
        if instance is None:
            return self._end(rid, trigger, plan, Decision.SKIPPED, "skipped: instance gone")
        self._check_veto(rid, trigger, plan)
        now_s = self._clock()
        if plan.restarts:
            self._guards(rid, trigger, plan, now_s)
            self._preflight_check(rid, trigger, plan, instance)
        if self.config.dry_run:
            reason = f"dry-run: would {' then '.join(plan.steps)} ({plan.reason})"
            return self._end(rid, trigger, plan, Decision.DRY_RUN, reason)
        if "reset_prefix_cache" in plan.steps:
            cleared = await self._light(rid, trigger, plan, instance, now_s)
            if cleared is not None:
                return cleared
            self._check_veto(rid, trigger, plan)
        return await self._restart(rid, trigger, plan, instance)

    def _guards(self, rid: int, trigger: Trigger, plan: Plan, now_s: float) -> None:
        decisions: list[GuardDecision] = [
            self.cooldown.check(trigger.instance, now_s),
            self.budget.check(trigger.instance, now_s),
            self.breaker.check(trigger.instance, now_s),
        ]
        for d in decisions:
            verdict = (
                "allowed" if d.allowed else ("overridden by force" if trigger.force else "blocked")
            )
            self._audit(trigger, rid, d.guard, verdict, d.reason)
        blocked = [d for d in decisions if not d.allowed]
        if blocked and not trigger.force:
            reason = f"skipped: {blocked[0].reason}"
            raise _Stop(self._end(rid, trigger, plan, Decision.SKIPPED, reason))

    def _preflight_check(self, rid: int, trigger: Trigger, plan: Plan, instance: Instance) -> None:
        if not self.config.preflight.enabled or self._preflight is None:
            return
        try:
            check = self._preflight.check(instance)
        except OSError as exc:
            check = MemoryCheck(None, None, f"pre-flight check failed: {exc}")
        unknown_blocks = self.config.preflight.unknown_blocks_restart
        blocks = check.ok is False or (check.ok is None and unknown_blocks)
        if check.ok is True:
            verdict = "allowed"
        elif not blocks:
            verdict = "allowed (unknown does not block)"
        else:
            verdict = "overridden by force" if trigger.force else "blocked"
        details = {
            "device": check.device,
            "available_bytes": check.available_bytes,
            "required_bytes": check.required_bytes,
        }
        self._audit(trigger, rid, "preflight", verdict, check.reason, details)
        if blocks and not trigger.force:
            unknown = " (unknown blocks the restart)" if check.ok is None else ""
            reason = f"skipped: pre-flight: {check.reason}{unknown}"
            raise _Stop(self._end(rid, trigger, plan, Decision.SKIPPED, reason))

    async def _light(
        self, rid: int, trigger: Trigger, plan: Plan, instance: Instance, now_s: float
    ) -> Outcome | None:
        assert self._light_step is not None  # the plan has the step only when enabled
        self.cooldown.record(trigger.instance, now_s)
        result = await self._light_step.reset_prefix_cache(instance)
        self._audit(
            trigger, rid, "reset_prefix_cache", "done" if result.ok else "failed", result.reason
        )
        if not result.ok or trigger.fingerprint is None:
            return None
        watched = await self._watch.wait(
            trigger.fingerprint, self._clock() + self._windows.after_light_step_s
        )
        if watched.verdict != "cleared":
            self._audit(
                trigger, rid, "reset_prefix_cache", "escalate", f"still {watched.verdict}: "
                f"{watched.reason}; going on to the restart",
            )  # fmt: skip
            return None
        reason = "the light step cleared the condition"
        return self._end(rid, trigger, plan, Decision.SUCCEEDED, reason)

    async def _restart(self, rid: int, trigger: Trigger, plan: Plan, instance: Instance) -> Outcome:
        now_s = self._clock()
        self.cooldown.record(trigger.instance, now_s)
        self.budget.record(trigger.instance, now_s)
        self.breaker.note_attempt(trigger.instance, now_s)
        self._save_breaker(trigger.instance, now_s)
        drain = (
            f"SIGTERM; vLLM drains in-flight requests for up to "
            f"{self._drain_timeout_s:g} s, then the runtime starts it again"
        )
        self._step(rid, trigger, "draining", drain)
        self._step(rid, trigger, "restarting", f"{_action(plan)} through the runtime")
        try:
            new = await self._runtime.restart(
                trigger.instance,
                drain_timeout_s=self._drain_timeout_s,
                ready_timeout_s=self.config.verify_timeout_s,
                argv=plan.argv,
            )
        except Exception as exc:  # any runtime failure is this remediation's failure
            log.warning("restart of %s failed: %s", trigger.instance, exc)
            reason = f"{RESTART_FAILED}{type(exc).__name__}: {exc}"
            outcome = self._end(
                rid, trigger, plan, Decision.FAILED, reason, audited_as=Decision.ESCALATED
            )
            self._breaker_failure(trigger.instance, self._clock(), reason)
            return outcome
        new_pid = new.main_pid
        self._step(
            rid, trigger, "verifying",
            f"new PID {new_pid}, healthy, probe answered; watching the condition",
            new_pid=new_pid,
        )  # fmt: skip
        restarted_at_s = self._clock()
        if trigger.fingerprint is None:
            return self._end(
                rid, trigger, plan, Decision.SUCCEEDED, "restarted: healthy and a probe answered",
                new_pid=new_pid,
            )  # fmt: skip
        watched = await self._watch.wait(
            trigger.fingerprint, restarted_at_s + self._windows.after_restart_s
        )
        if watched.verdict != "cleared":
            reason = (
                f"{VERIFY_FAILED}condition {watched.verdict} "
                f"{self._windows.after_restart_s:g} s after the restart: {watched.reason}"
            )
            outcome = self._end(
                rid, trigger, plan, Decision.FAILED, reason, new_pid=new_pid,
                audited_as=Decision.ESCALATED,
            )  # fmt: skip
            self._breaker_failure(trigger.instance, self._clock(), reason)
            return outcome
        self._recurrence[trigger.fingerprint] = _Recurrence(trigger.instance, restarted_at_s, rid)
        return self._end(
            rid, trigger, plan, Decision.SUCCEEDED,
            f"condition cleared {watched.at_s - restarted_at_s:.0f} s after the restart",
            new_pid=new_pid,
        )  # fmt: skip

    # -- helpers -----------------------------------------------------------------------

    def _find(self, name: str) -> Instance | None:
        return next((i for i in self._runtime.instances() if i.name == name), None)

    def _light_enabled(self) -> bool:
        return self.config.light_step_reset_prefix_cache and self._light_step is not None

    def _incident_restarted(self, incident_id: str) -> bool:
        return any(restart_began(r) for r in self._journal.remediations(incident_id=incident_id))

    def _vetoed(self, trigger: Trigger) -> bool:
        return trigger.instance in self._vetoed_instances or (
            trigger.incident_id is not None and trigger.incident_id in self._vetoed_incidents
        )

    def _veto_reason(self, trigger: Trigger) -> str:
        if trigger.instance in self._vetoed_instances:
            return f"vetoed: instance {trigger.instance} is vetoed"
        return f"vetoed: incident {trigger.incident_id} is vetoed"

    def _check_veto(self, rid: int, trigger: Trigger, plan: Plan) -> None:
        if self._vetoed(trigger):
            raise _Stop(self._end(rid, trigger, plan, Decision.VETOED, self._veto_reason(trigger)))

    def _recommend(self, trigger: Trigger, plan: Plan) -> Outcome:
        wall_s = self._wall_clock()
        self._audit(trigger, None, "recommend_tuning", Decision.RECOMMENDED, plan.reason)
        event = tuning_recommended_event(
            trigger.instance, trigger.rule, plan.reason, trigger.labels,
            incident_id=trigger.incident_id or self._new_id(), wall_s=wall_s,
        )  # fmt: skip
        self._events.append(event)
        if trigger.fingerprint is not None:
            self._advice[trigger.fingerprint] = event
        return Outcome(
            trigger.instance,
            trigger.incident_id,
            Decision.RECOMMENDED,
            plan.reason,
            None,
            plan.steps,
        )

    def _set_active(self, rid: int, trigger: Trigger, plan: Plan, state: RemediationState) -> None:
        self._active[rid] = ActiveRemediation(
            rid, trigger.instance, trigger.incident_id, _action(plan), state, self._wall_clock()
        )

    def _step(
        self, rid: int, trigger: Trigger, state: RemediationState, reason: str, *,
        new_pid: int | None = None,
    ) -> None:  # fmt: skip
        """Write the transition first; only then is the step taken."""
        self._journal.update_remediation(
            rid, state=state, reason=reason, now_wall_s=self._wall_clock(), new_pid=new_pid
        )
        active = self._active.get(rid)
        if active is not None:
            self._active[rid] = ActiveRemediation(
                rid, active.instance, active.incident_id, active.action, state, self._wall_clock()
            )
        self._audit(trigger, rid, state, state, reason)

    def _end(
        self, rid: int, trigger: Trigger, plan: Plan, decision: Decision, reason: str, *,
        new_pid: int | None = None, audited_as: Decision | None = None,
    ) -> Outcome:  # fmt: skip
        self._journal.update_remediation(
            rid, state=FINAL_STATE[decision], reason=reason, now_wall_s=self._wall_clock(),
            new_pid=new_pid,
        )  # fmt: skip
        self._audit(trigger, rid, _action(plan), audited_as or decision, reason)
        self._active.pop(rid, None)
        old_pid = self._old_pids.pop(rid, None)
        return Outcome(
            trigger.instance, trigger.incident_id, decision, reason, rid, plan.steps,
            old_pid, new_pid,
        )  # fmt: skip

    def _finish_new(
        self, trigger: Trigger, decision: Decision, reason: str, plan: Plan | None = None
    ) -> Outcome:
        """A remediation decided before it started: one finished record and its audit."""
        action = _action(plan) if plan else "remediate"
        rid = self._journal.start_remediation(
            instance=trigger.instance, action=action, state=FINAL_STATE[decision],
            reason=reason, started_wall_s=self._wall_clock(), incident_id=trigger.incident_id,
            fingerprint=trigger.fingerprint,
        )  # fmt: skip
        self._audit(trigger, rid, action, decision, reason)
        steps = plan.steps if plan else ()
        return Outcome(trigger.instance, trigger.incident_id, decision, reason, rid, steps)

    def _breaker_failure(self, instance: str, now_s: float, reason: str) -> None:
        change = self.breaker.record_failure(instance, now_s, reason)
        self._save_breaker(instance, now_s)
        if change is not None:
            self._on_breaker_change(change)

    def _breaker_success(self, instance: str, now_s: float) -> None:
        change = self.breaker.record_success(instance, now_s)
        self._save_breaker(instance, now_s)
        if change is not None:
            self._on_breaker_change(change)

    def _on_breaker_change(self, change: BreakerChange) -> None:
        wall_s = self._wall_clock()
        if change.to_state == "open":
            found = self._find(change.instance)
            page = circuit_open_event(
                change.instance, found.role if found else "stable", change.failures,
                change.reason, incident_id=self._new_id(), wall_s=wall_s,
            )  # fmt: skip
            self._pages[change.instance] = page
            self._events.append(page)
            self._audit_raw(
                "agent", "circuit_breaker", change.instance, "opened: paged", change.reason,
                page.incident_id, None, {"failures": change.failures},
            )  # fmt: skip
        else:
            page = self._pages.pop(change.instance, None)
            if page is not None:
                self._events.append(resolved(page, wall_s))
            self._audit_raw(
                "agent", "circuit_breaker", change.instance, "closed", change.reason,
                None if page is None else page.incident_id, None,
            )  # fmt: skip
        self._save_breaker(change.instance, self._clock())

    def _save_breaker(self, instance: str, now_s: float) -> None:
        wall_s = self._wall_clock()
        fact = self.breaker.to_fact(instance, now_s, wall_s)
        page = self._pages.get(instance)
        if page is not None:
            fact["page"] = {
                "incident_id": page.incident_id,
                "starts_at_wall_s": page.starts_at_wall_s,
                "role": dict(page.labels).get("role", "stable"),
                "failures": self.breaker.failures(instance),
            }
        self._journal.set_fact(BREAKER_FACT.format(instance=instance), fact, wall_s)

    def _save_vetoes(self) -> None:
        self._journal.set_fact(
            VETO_FACT,
            {
                "instances": sorted(self._vetoed_instances),
                "incidents": sorted(self._vetoed_incidents),
            },
            self._wall_clock(),
        )

    def _audit(
        self, trigger: Trigger, rid: int | None, action: str, decision: Decision | str,
        reason: str, details: dict[str, Any] | None = None,
    ) -> None:  # fmt: skip
        extra: dict[str, Any] = {"rule": trigger.rule, **(details or {})}
        if trigger.fingerprint is not None:
            extra["fingerprint"] = trigger.fingerprint
        if trigger.requested_by is not None:
            extra["requested_by"] = trigger.requested_by
        if trigger.force:
            extra["force"] = True
        self._audit_raw(
            trigger.actor, action, trigger.instance, decision, reason, trigger.incident_id,
            rid, extra,
        )  # fmt: skip

    def _audit_raw(
        self, actor: Actor, action: str, target: str, decision: Decision | str, reason: str,
        incident_id: str | None, rid: int | None, details: dict[str, Any] | None = None,
    ) -> None:  # fmt: skip
        self._journal.record_audit(
            wall_s=self._wall_clock(), actor=actor, action=action, target=target,
            decision=decision, reason=reason, incident_id=incident_id, remediation_id=rid,
            details=details,
        )  # fmt: skip
        log.info(
            "remediation %s %s on %s: %s",
            action,
            decision,
            target,
            reason,
            extra={"incident_id": incident_id, "action_id": rid},
        )


def _action(plan: Plan) -> str:
    return "promote" if "promote" in plan.steps else "restart"


def _page_from_fact(instance: str, page: dict[str, Any]) -> AlertEvent:
    return circuit_open_event(
        instance,
        str(page.get("role") or "stable"),
        int(page.get("failures") or 0),
        "restored after a restart of kvpilot",
        incident_id=str(page["incident_id"]),
        wall_s=float(page["starts_at_wall_s"]),
    )
