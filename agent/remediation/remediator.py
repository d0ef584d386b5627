"""The remediator: turns firing alerts into ladders and runs them under the guards.

The façade over the remediation package; each part has its module:

* `triage`: what a trigger becomes (declined, alert only, advice, or a plan) before any step;
* `progress`: the journal record of each remediation, written before each step, and the
  per-instance lock and the background task it runs in;
* `checks` and `execute`: the veto, the guards and the pre-flight, then the light step and
  the restart with its verification;
* `breaker_book`: failed restarts and recurrences counted, the page; `vetoes`; `events`
  (`Notices`): pages and advice waiting in `take_events()` for the agent to enqueue;
* `reconcile`: after a restart of kvpilot, unfinished records fail and the guards return;
* `status`: what the API shows.

The tick drives it: `observe(transitions, conditions)` settles the watches of running
remediations, keeps the breaker's books and starts a remediation for each alert that starts
firing. Time: the injected monotonic `clock` for guards and watches, `wall_clock` for records.
`better_config` is the tuner's validated configuration for the ladder's promote step (none by
default); `on_promoted` hears of each promotion the runtime applied (the agent notes it).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import assert_never

from kvpilot.agent.alert_values import AlertTransition
from kvpilot.agent.alerts import new_incident_id
from kvpilot.agent.config import RemediationConfig
from kvpilot.agent.mode import LiveMode, ModeSetting, configured_mode
from kvpilot.agent.model import AlertEvent, AlertFacts, Condition
from kvpilot.agent.remediation.audit import AuditTrail
from kvpilot.agent.remediation.breaker_book import BreakerBook
from kvpilot.agent.remediation.checks import Preflight, RemediationChecks
from kvpilot.agent.remediation.events import Notices, tuning_recommended_event
from kvpilot.agent.remediation.execute import Executor, Promoted, RestartTarget, find_instance
from kvpilot.agent.remediation.guards import CircuitBreaker, Cooldown, RestartBudget
from kvpilot.agent.remediation.journal import RemediationJournal, restart_began
from kvpilot.agent.remediation.ladder import BetterConfig, LadderPlan, manual_plan, no_better_config
from kvpilot.agent.remediation.oom.guard import OomGuard
from kvpilot.agent.remediation.prefix_cache import LightStep
from kvpilot.agent.remediation.progress import InProgress
from kvpilot.agent.remediation.reconcile import Reconciled, fail_unfinished, restore_restarts
from kvpilot.agent.remediation.status import RemediationStatus, remediation_status
from kvpilot.agent.remediation.triage import Advice, AlertOnly, Declined, Proceed, triage
from kvpilot.agent.remediation.trigger import RemediationOutcome, Trigger
from kvpilot.agent.remediation.vetoes import Veto, Vetoes
from kvpilot.agent.remediation.watch import DEFAULT_WINDOWS, ConditionWatch, WatchWindows
from kvpilot.agent.state.decision import Decision

log = logging.getLogger(__name__)


class Remediator:
    """Plans and runs remediations; see the module docstring for the parts."""

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
        on_promoted: Promoted | None = None,
        oom: OomGuard | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        new_id: Callable[[], str] = new_incident_id,
    ) -> None:
        self.config = config
        self._runtime = runtime
        self._journal = journal
        self._light_enabled = config.light_step_reset_prefix_cache and light_step is not None
        self._better_config = better_config
        self.oom = oom  # a server that died of memory: its plan moves the memory knob
        self._clock = clock
        self._wall_clock = wall_clock
        self._new_id = new_id
        self.cooldown = Cooldown(config.cooldown_s)
        self.budget = RestartBudget(config.budget.max_restarts, config.budget.window_s)
        self.breaker = CircuitBreaker(
            config.circuit_breaker.failures_to_open, config.circuit_breaker.open_for_s
        )
        self._watch = ConditionWatch()
        self._audit = AuditTrail(journal, wall_clock)
        self._notices = Notices()
        self._book = BreakerBook(
            self.breaker,
            hold_s=config.circuit_breaker.hold_s,
            journal=journal,
            audit=self._audit,
            notices=self._notices,
            role_of=self._role_of,
            clock=clock,
            wall_clock=wall_clock,
            new_id=new_id,
        )
        self._vetoes = Vetoes(journal, self._audit, wall_clock, clock)
        # The live switch; the configuration file's layer is `remediation.dry_run`.
        self.mode = LiveMode(configured_mode(config.dry_run), on_change=self._mode_changed)
        self._progress = InProgress(journal, self._audit, wall_clock)
        checks = RemediationChecks(
            cooldown=self.cooldown,
            budget=self.budget,
            breaker=self.breaker,
            vetoes=self._vetoes,
            preflight_config=config.preflight,
            preflight=preflight,
            progress=self._progress,
            audit=self._audit,
        )
        self._executor = Executor(
            config=config,
            runtime=runtime,
            checks=checks,
            progress=self._progress,
            audit=self._audit,
            book=self._book,
            cooldown=self.cooldown,
            budget=self.budget,
            watch=self._watch,
            windows=windows,
            light_step=light_step,
            clock=clock,
            mode=self.mode.current,
            # 0 in the section: the runtime's own SIGTERM drain window before it kills.
            drain_timeout_s=config.drain_timeout_s or runtime_drain_timeout_s,
            on_promoted=on_promoted,
        )
        if light_step is not None and config.light_step_reset_prefix_cache:
            log.warning(
                "remediation: the prefix-cache reset step uses vLLM's dev endpoints "
                "(VLLM_SERVER_DEV_MODE=1), which are unauthenticated: keep the port private"
            )

    # -- views -------------------------------------------------------------------------

    @property
    def vetoes(self) -> Vetoes:
        """The operators' vetoes (a fleet keeps them per Deployment through its hooks)."""
        return self._vetoes

    def in_progress(self) -> bool:
        """Whether any remediation is planned or running (the tuner waits while one is)."""
        return self._progress.any()

    def cooling_down(self, instance: str) -> str | None:
        """Why `instance` is within its cooldown after its last action, or None."""
        decision = self.cooldown.check(instance, self._clock())
        return None if decision.allowed else decision.reason

    def status(self) -> RemediationStatus:
        names = {i.name for i in self._runtime.instances()} | self._notices.paged_instances()
        return remediation_status(
            mode=self.mode.current(),
            active=self._progress.active(),
            breaker=self.breaker,
            instances=names,
            vetoes=self._vetoes,
            now_s=self._clock(),
        )

    def take_events(self) -> list[AlertEvent]:
        """Pages and advice produced since the last call, for the agent to enqueue."""
        return [*self._notices.take(), *(self.oom.take_events() if self.oom else ())]

    # -- the tick ----------------------------------------------------------------------

    def observe(
        self,
        transitions: Iterable[AlertTransition],
        conditions: Iterable[Condition],
        *,
        now_s: float | None = None,
    ) -> list[asyncio.Task[RemediationOutcome]]:
        """One tick: settle watches, keep the breaker's books, start remediations."""
        now_s = self._clock() if now_s is None else now_s
        conditions = list(conditions)
        transitions = list(transitions)
        by_fp = {c.fingerprint: c for c in conditions}
        resolved_fps = [t.fingerprint for t in transitions if t.to_state == "resolved"]
        self._watch.settle(conditions, now_s, resolved_fps)
        self._notices.sources_resolved(resolved_fps, self._wall_clock())
        started = []
        for t in transitions:
            if t.to_state != "firing" or t.repeat or t.from_state == "firing":
                continue
            instance = dict(t.labels).get("instance")
            if instance is None:
                continue
            self._book.alert_fired(t.fingerprint, now_s)
            condition = by_fp.get(t.fingerprint)
            # The rule's typed facts; without this tick's condition, nothing to act on.
            facts = condition.facts if condition is not None else AlertFacts()
            trigger = Trigger(instance, t.rule, t.fingerprint, t.incident_id, t.labels, facts)
            started.append(self.submit(trigger))
        self._book.expire(now_s)
        return started

    def submit(
        self, trigger: Trigger, plan: LadderPlan | None = None
    ) -> asyncio.Task[RemediationOutcome]:
        """Run `remediate` in the background; the task is kept until it ends."""
        return self._progress.submit(self.remediate(trigger, plan))

    async def wait_idle(self) -> None:
        """Until every background remediation has ended."""
        await self._progress.wait_idle()

    async def aclose(self) -> None:
        """Cancel running remediations (each records itself as interrupted)."""
        await self._progress.cancel_all()

    # -- the API's calls ---------------------------------------------------------------

    async def trigger(
        self, instance: str, *, requested_by: str, force: bool = False, reason: str = ""
    ) -> RemediationOutcome:
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
        duration_s: float | None = None,
    ) -> Veto:
        """Skip pending and future remediations of an incident or an instance, until lifted
        or for `duration_s`."""
        return self._vetoes.add(
            requested_by=requested_by,
            reason=reason,
            instance=instance,
            incident_id=incident_id,
            duration_s=duration_s,
        )

    def lift_veto(
        self,
        *,
        requested_by: str,
        reason: str,
        instance: str | None = None,
        incident_id: str | None = None,
    ) -> bool:
        """End a veto; False when there was none."""
        return self._vetoes.lift(
            requested_by=requested_by, reason=reason, instance=instance, incident_id=incident_id
        )

    def reset_breaker(self, instance: str, *, requested_by: str, reason: str) -> bool:
        """Close the instance's circuit breaker (the page resolves); False if it was closed."""
        return self._book.reset(instance, requested_by=requested_by, reason=reason)

    # -- start-up ----------------------------------------------------------------------

    def reconcile(self) -> list[Reconciled]:
        """After a restart of kvpilot: fail unfinished records, restore guards and vetoes."""
        now_s, now_wall_s = self._clock(), self._wall_clock()
        out = fail_unfinished(self._journal, self._audit, now_wall_s)
        remembered = restore_restarts(
            self._journal, self.cooldown, self.budget, now_s=now_s, now_wall_s=now_wall_s
        )
        names = {i.name for i in self._runtime.instances()} | remembered
        self._book.restore(names, now_s, now_wall_s)
        self._vetoes.restore()
        return out

    # -- one remediation ---------------------------------------------------------------

    async def remediate(
        self, trigger: Trigger, plan: LadderPlan | None = None
    ) -> RemediationOutcome:
        """Plan, guard and run one remediation to its end; never raises for its failures."""
        found = find_instance(self._runtime, trigger.instance)
        if plan is None and self.oom is not None and found is not None:
            answer = self.oom.plan(trigger, found)
            plan = answer.plan if answer is not None else None
        verdict = triage(
            trigger,
            plan,
            found,
            light_step_enabled=self._light_enabled,
            better_config=self._better_config,
            can_change_flags=self._runtime.can_change_flags,
            incident_restarted=self._incident_restarted,
            veto=self._vetoes.against,
        )
        match verdict:
            case Declined(decision, reason, declined_plan):
                return self._progress.decided(trigger, decision, reason, declined_plan)
            case AlertOnly(plan):
                self._audit.about(trigger, None, plan.action, Decision.ALERT_ONLY, plan.reason)
                return RemediationOutcome(
                    trigger.instance, trigger.incident_id, Decision.ALERT_ONLY, plan.reason, None
                )
            case Advice(plan):
                return self._recommend(trigger, plan)
            case Proceed(plan, instance):
                restarts = self._executor.restarts_of(trigger.instance)
                run = self._progress.open(trigger, plan, instance, restarts_before=restarts)
                outcome = await self._progress.run_to_end(run, self._executor.run)
                if self.oom is not None:
                    self.oom.ended(trigger.instance, outcome.decision)
                return outcome
            case _:
                assert_never(verdict)

    def _recommend(self, trigger: Trigger, plan: LadderPlan) -> RemediationOutcome:
        wall_s = self._wall_clock()
        step = plan.steps[0]
        self._audit.about(trigger, None, step, Decision.RECOMMENDED, plan.reason)
        event = tuning_recommended_event(
            trigger.instance,
            trigger.rule,
            plan.reason,
            trigger.labels,
            incident_id=trigger.incident_id or self._new_id(),
            wall_s=wall_s,
            flags=plan.argv if step == "recommend_config" else None,
        )
        self._notices.advise(event, trigger.fingerprint)
        return RemediationOutcome(
            trigger.instance,
            trigger.incident_id,
            Decision.RECOMMENDED,
            plan.reason,
            None,
            plan.steps,
        )

    def _incident_restarted(self, incident_id: str) -> bool:
        return any(restart_began(r) for r in self._journal.remediations(incident_id=incident_id))

    def _mode_changed(self, before: ModeSetting, after: ModeSetting) -> None:
        reason = f"now {after.describe()}; was {before.describe()}"
        self._audit.record("agent", "mode", "*", "switched", reason)

    def _role_of(self, name: str) -> str:
        found = find_instance(self._runtime, name)
        return found.role if found else "stable"
