"""The remediator on the real alert tracker, a recording runtime double and the memory journal."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

from kvpilot.agent.remediation import (
    CIRCUIT_OPEN_ALERT,
    TUNING_RECOMMENDED_ALERT,
    Remediator,
    Trigger,
    WatchWindows,
)
from kvpilot.agent.runtimes.base import NotReady
from kvpilot.agent.state.decision import Decision
from tests.fakes.remediation_journal import MemoryJournal

from .remediation_helpers import (
    FixedPreflight,
    Harness,
    RecordingLightStep,
    condition,
    make_instance,
    remediation_config,
    until,
)

FAST = remediation_config(cooldown_s=0.0, preflight={"enabled": False})
FAST_WATCH = WatchWindows(after_restart_s=60.0)


def run(main: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(main())


def verifying(h: Harness) -> bool:
    return any(a.state == "verifying" for a in h.remediator.status().active)


async def restart_and_clear(h: Harness, rule: str = "fragmentation_allocator", **kw) -> None:
    """One firing, one restart, the condition clears: a successful remediation."""
    (task,) = h.tick(condition(rule, **kw))
    await until(lambda: verifying(h) or task.done(), "verifying")
    assert not task.done(), task.result()
    h.tick(condition(rule, active=False, **kw))
    outcome = await task
    assert outcome.decision == "succeeded", outcome


def test_restart_writes_every_state_before_the_next_step() -> None:
    async def main() -> None:
        h = Harness(FAST, windows=FAST_WATCH)
        seen_during_restart = []
        original = h.runtime.restart

        async def spying_restart(name, **kw):
            record = h.journal.records[1]
            seen_during_restart.append(record.state)
            return await original(name, **kw)

        h.runtime.restart = spying_restart  # type: ignore[method-assign]
        (task,) = h.tick(condition())
        await until(lambda: verifying(h), "verifying")
        assert h.remediator.in_progress()
        h.tick(condition(active=False))
        outcome = await task
        assert outcome.decision == "succeeded"
        assert (outcome.old_pid, outcome.new_pid) == (100, 200)
        assert h.journal.states[1] == [
            "planned",
            "draining",
            "restarting",
            "verifying",
            "succeeded",
        ]
        assert seen_during_restart == ["restarting"]
        record = h.journal.records[1]
        assert record.incident_id == "inc-1" and record.old_pid == 100 and record.new_pid == 200
        assert record.fingerprint == condition().fingerprint
        assert not h.remediator.in_progress()
        assert h.runtime.restarts == [("vllm-0", None, FAST.drain_timeout_s, FAST.verify_timeout_s)]

    run(main)


def test_drain_timeout_0_leaves_the_drain_to_the_runtime_setting() -> None:
    async def main() -> None:
        own = Harness(remediation_config(drain_timeout_s=20.0), runtime_drain_timeout_s=30.0)
        await own.remediator.trigger("vllm-0", requested_by="alice")
        runtimes = Harness(remediation_config(drain_timeout_s=0.0), runtime_drain_timeout_s=30.0)
        await runtimes.remediator.trigger("vllm-0", requested_by="alice")
        assert [r[2] for r in own.runtime.restarts + runtimes.runtime.restarts] == [20.0, 30.0]
        (drain,) = [a for a in runtimes.journal.audit if a.action == "draining"]
        assert "for up to 30 s" in drain.reason

    run(main)


def test_alert_only_rule_is_not_restarted_and_is_audited() -> None:
    async def main() -> None:
        h = Harness(FAST, windows=FAST_WATCH)
        (task,) = h.tick(condition("fragmentation_kv_blocks", action="alert"))
        outcome = await task
        assert outcome.decision == "alert_only"
        assert h.runtime.entered == 0
        assert h.decisions() == [Decision.ALERT_ONLY]

    run(main)


def test_the_action_comes_from_the_rules_typed_fact_not_the_annotation_text() -> None:
    """The `action` annotation is for people: whatever its text says, the remediator acts on
    the action the rule put on its condition."""

    async def main() -> None:
        h = Harness(FAST, windows=FAST_WATCH)
        quiet = condition("fragmentation_kv_blocks", action="alert", action_note="restart")
        (task,) = h.tick(quiet)
        assert (await task).decision == "alert_only"
        assert h.runtime.entered == 0
        h.tick(condition("fragmentation_kv_blocks", active=False))
        await restart_and_clear(h, action="restart", action_note="notify only")
        assert len(h.runtime.restarts) == 1

    run(main)


def test_canary_is_never_remediated() -> None:
    async def main() -> None:
        h = Harness(FAST, windows=FAST_WATCH, instances=[make_instance("canary-0", role="canary")])
        (task,) = h.tick(condition(instance="canary-0", role="canary"))
        outcome = await task
        assert outcome.decision == "skipped" and "canary" in outcome.reason
        assert h.runtime.entered == 0
        assert h.journal.records[1].state == "skipped"
        # Even an operator's forced restart is refused for a canary.
        forced = await h.remediator.trigger("canary-0", requested_by="alice", force=True)
        assert forced.decision == "skipped" and h.runtime.entered == 0

    run(main)


def test_dry_run_decides_and_audits_but_does_nothing() -> None:
    async def main() -> None:
        h = Harness(
            remediation_config(dry_run=True, preflight={"enabled": True}),
            preflight=FixedPreflight(True),
        )
        (task,) = h.tick(condition())
        outcome = await task
        assert outcome.decision is Decision.DRY_RUN
        assert outcome.reason.startswith("dry-run: would restart")
        assert h.runtime.entered == 0
        assert h.journal.records[1].state == "skipped"
        assert Decision.DRY_RUN in h.decisions()
        # The guards and the pre-flight still ran and were audited.
        assert {a.action for a in h.journal.audit} >= {
            "cooldown",
            "budget",
            "circuit_breaker",
            "preflight",
        }

    run(main)


def test_cooldown_blocks_a_second_restart_then_allows_it() -> None:
    async def main() -> None:
        config = remediation_config(
            cooldown_s=300.0,
            preflight={"enabled": False},
            budget={"max_restarts": 10},
            circuit_breaker={"failures_to_open": 10, "hold_s": 5.0},
        )
        h = Harness(config, windows=WatchWindows(after_restart_s=10.0))
        await restart_and_clear(h)
        h.tick(advance_s=10.0)  # recurrence window passes cleanly
        (blocked,) = h.tick(condition())
        outcome = await blocked
        assert outcome.decision == "skipped" and "cooldown" in outcome.reason
        assert len(h.runtime.restarts) == 1
        h.tick(condition(active=False))
        h.clock.advance(300.0)
        (task,) = h.tick(condition())
        await until(lambda: len(h.runtime.restarts) == 2, "second restart")
        h.tick(condition(active=False))
        assert (await task).decision == "succeeded"

    run(main)


def test_budget_exhausted_stops_restarts() -> None:
    async def main() -> None:
        config = remediation_config(
            cooldown_s=0.0,
            preflight={"enabled": False},
            budget={"max_restarts": 2, "window_s": 3600.0},
            circuit_breaker={"failures_to_open": 10, "hold_s": 1.0},
        )
        h = Harness(config, windows=WatchWindows(after_restart_s=10.0))
        for _ in range(2):
            await restart_and_clear(h)
            h.tick(advance_s=5.0)
        (task,) = h.tick(condition())
        outcome = await task
        assert outcome.decision == "skipped" and "budget exhausted: 2 of 2" in outcome.reason
        assert len(h.runtime.restarts) == 2
        # The window slides: an hour later the budget allows one again.
        h.tick(condition(active=False))
        h.clock.advance(3600.0)
        (task,) = h.tick(condition())
        await until(lambda: len(h.runtime.restarts) == 3, "restart after the window")
        h.tick(condition(active=False))
        assert (await task).decision == "succeeded"

    run(main)


def test_preflight_blocks_or_allows_and_unknown_follows_the_setting() -> None:
    async def main() -> None:
        short = Harness(
            remediation_config(cooldown_s=0.0), preflight=FixedPreflight(False, "not enough RAM")
        )
        (task,) = short.tick(condition())
        outcome = await task
        assert outcome.decision == "skipped" and "not enough RAM" in outcome.reason
        assert short.runtime.entered == 0

        lenient = Harness(
            remediation_config(cooldown_s=0.0, preflight={"unknown_blocks_restart": False}),
            windows=WatchWindows(after_restart_s=5.0),
            preflight=FixedPreflight(None, "MemAvailable unreadable"),
        )
        (task,) = lenient.tick(condition())
        await until(lambda: lenient.runtime.restarts != [], "restart despite unknown")
        lenient.tick(condition(active=False))
        assert (await task).decision == "succeeded"
        assert "allowed (unknown does not block)" in lenient.decisions("preflight")

        strict = Harness(
            remediation_config(cooldown_s=0.0, preflight={"unknown_blocks_restart": True}),
            preflight=FixedPreflight(None, "MemAvailable unreadable"),
        )
        (task,) = strict.tick(condition())
        outcome = await task
        assert outcome.decision == "skipped" and "unknown blocks the restart" in outcome.reason
        assert strict.runtime.entered == 0

    run(main)


def test_veto_of_an_instance_skips_pending_and_future_remediations() -> None:
    async def main() -> None:
        h = Harness(FAST, windows=FAST_WATCH)
        await restart_and_clear(h)
        # A remediation waits for the instance's lock behind a running one.
        h.runtime.hold = asyncio.Event()
        running = asyncio.ensure_future(
            h.remediator.trigger("vllm-0", requested_by="bob", force=True)
        )
        await until(lambda: h.runtime.entered == 2, "second restart entered")
        (pending,) = h.tick(condition(), advance_s=100.0)
        await until(lambda: len(h.remediator.status().active) == 2, "pending visible")
        h.remediator.veto(instance="vllm-0", requested_by="carol", reason="maintenance")
        h.runtime.hold.set()
        assert (await running).decision == "succeeded"
        vetoed = await pending
        assert vetoed.decision == "vetoed" and "vllm-0" in vetoed.reason
        assert len(h.runtime.restarts) == 2
        # Future ones too, until the veto is lifted.
        h.tick(condition(active=False))
        (future,) = h.tick(condition())
        assert (await future).decision == "vetoed"
        assert h.remediator.lift_veto(instance="vllm-0", requested_by="carol", reason="done")
        veto_audit = [a for a in h.journal.audit if a.action == "veto"]
        assert [a.decision for a in veto_audit] == ["vetoed", "veto lifted"]
        assert veto_audit[0].details["requested_by"] == "carol"

    run(main)


def _second_incident_during_a_held_restart(h: Harness) -> tuple[asyncio.Task, asyncio.Task]:
    """A restart held in its drain; meanwhile the alert resolves and fires again (a new
    incident, planned on evidence from the drain) and waits for the instance's lock."""
    h.runtime.hold = asyncio.Event()
    (first,) = h.tick(condition())
    h.tick(condition(active=False))
    (second,) = h.tick(condition())
    return first, second


def test_a_remediation_planned_during_a_restart_is_skipped_when_the_restart_cleared_it() -> None:
    async def main() -> None:
        h = Harness(FAST, windows=FAST_WATCH)
        first, second = _second_incident_during_a_held_restart(h)
        await until(lambda: len(h.remediator.status().active) == 2, "both visible")
        h.runtime.hold.set()
        await until(lambda: verifying(h), "first verifying")
        h.tick(condition(active=False))
        assert (await first).decision == "succeeded"
        await until(second.done, "the waiting remediation ended without another restart")
        superseded = second.result()
        assert superseded.decision == "skipped", superseded
        assert "superseded by remediation 1" in superseded.reason
        assert "condition is cleared since" in superseded.reason
        assert len(h.runtime.restarts) == 1
        assert h.journal.states[2] == ["planned", "skipped"]

    run(main)


def test_a_remediation_planned_during_a_restart_goes_on_when_the_condition_stays() -> None:
    async def main() -> None:
        h = Harness(FAST, windows=WatchWindows(after_restart_s=20.0))
        first, second = _second_incident_during_a_held_restart(h)
        h.runtime.hold.set()
        await until(lambda: verifying(h), "first verifying")
        for _ in range(3):
            h.tick(condition(), advance_s=10.0)
        assert (await first).decision == "failed"
        await until(lambda: len(h.runtime.restarts) == 2, "second restart")
        h.tick(condition(active=False))
        assert (await second).decision == "succeeded"

    run(main)


def test_an_operators_restart_queued_behind_a_restart_is_still_carried_out() -> None:
    async def main() -> None:
        h = Harness(FAST, windows=FAST_WATCH)
        h.runtime.hold = asyncio.Event()
        (first,) = h.tick(condition())
        await until(lambda: h.runtime.entered == 1, "first restart entered")
        manual = asyncio.ensure_future(h.remediator.trigger("vllm-0", requested_by="bob"))
        await until(lambda: len(h.remediator.status().active) == 2, "manual waits")
        h.runtime.hold.set()
        await until(lambda: verifying(h), "first verifying")
        h.tick(condition(active=False))
        assert (await first).decision == "succeeded"
        assert (await manual).decision == "succeeded"
        assert len(h.runtime.restarts) == 2

    run(main)


def test_veto_of_an_incident() -> None:
    async def main() -> None:
        h = Harness(FAST, windows=FAST_WATCH)
        h.remediator.veto(incident_id="inc-1", requested_by="dave", reason="known issue")
        (task,) = h.tick(condition())
        outcome = await task
        assert outcome.decision == "vetoed" and outcome.incident_id == "inc-1"
        assert h.runtime.entered == 0

    run(main)


def test_manual_trigger_respects_guards_unless_forced() -> None:
    async def main() -> None:
        h = Harness(remediation_config(cooldown_s=300.0, preflight={"enabled": False}))
        first = await h.remediator.trigger("vllm-0", requested_by="alice")
        assert first.decision == "succeeded" and first.new_pid == 200
        second = await h.remediator.trigger("vllm-0", requested_by="alice")
        assert second.decision == "skipped" and "cooldown" in second.reason
        forced = await h.remediator.trigger("vllm-0", requested_by="alice", force=True)
        assert forced.decision == "succeeded" and forced.new_pid == 300
        assert len(h.runtime.restarts) == 2
        overridden = [a for a in h.journal.audit if a.decision == "overridden by force"]
        assert [a.action for a in overridden] == ["cooldown"]
        assert all(a.actor == "api" and a.details["requested_by"] == "alice" for a in overridden)

    run(main)


def test_restart_that_fails_escalates_and_counts_against_the_breaker() -> None:
    async def main() -> None:
        h = Harness(
            remediation_config(
                cooldown_s=0.0,
                preflight={"enabled": False},
                circuit_breaker={"failures_to_open": 3},
            )
        )
        h.runtime.failures.append(NotReady("vLLM at x not ready within 300 s"))
        (task,) = h.tick(condition())
        outcome = await task
        assert outcome.decision == "failed" and outcome.reason.startswith(
            "restart failed: NotReady"
        )
        assert h.journal.states[1][-1] == "failed"
        assert Decision.ESCALATED in h.decisions()
        assert h.remediator.breaker.failures("vllm-0") == 1
        # Still firing: the same incident is not restarted a second time.
        assert h.tick(condition()) == []

    run(main)


def test_condition_still_active_after_restart_fails_verification() -> None:
    async def main() -> None:
        h = Harness(
            remediation_config(cooldown_s=0.0, preflight={"enabled": False}),
            windows=WatchWindows(after_restart_s=30.0),
        )
        (task,) = h.tick(condition())
        await until(lambda: h.runtime.restarts != [], "restart")
        await until(lambda: verifying(h), "verifying")
        for _ in range(3):
            h.tick(condition(), advance_s=10.0)
        outcome = await task
        assert (
            outcome.decision == "failed"
            and "verification failed: condition active" in outcome.reason
        )
        assert outcome.new_pid == 200
        assert h.remediator.breaker.failures("vllm-0") == 1

    run(main)


def test_circuit_opens_after_k_recurrences_pages_once_and_stops_restarting() -> None:
    async def main() -> None:
        config = remediation_config(
            cooldown_s=0.0,
            preflight={"enabled": False},
            budget={"max_restarts": 100},
            circuit_breaker={"failures_to_open": 2, "hold_s": 600.0},
        )
        h = Harness(config, windows=WatchWindows(after_restart_s=30.0))
        for _ in range(2):
            await restart_and_clear(h)
            h.tick(condition(active=False), advance_s=5.0)
        assert h.remediator.breaker.failures("vllm-0") == 1  # the second firing recurred
        # The third firing within the window is the second recurrence: the breaker opens.
        (task,) = h.tick(condition())
        outcome = await task
        assert outcome.decision == "skipped" and "circuit open" in outcome.reason
        assert len(h.runtime.restarts) == 2
        pages = h.remediator.take_events()
        assert [
            (dict(e.labels)["alertname"], e.status, dict(e.labels)["severity"]) for e in pages
        ] == [(CIRCUIT_OPEN_ALERT, "firing", "critical")]
        # A permanent fault: it keeps firing again; no restart and no second page.
        for _ in range(5):
            h.tick(condition(active=False), advance_s=5.0)
            for t in h.tick(condition(), advance_s=5.0):
                assert (await t).decision == "skipped"
        assert len(h.runtime.restarts) == 2
        assert h.remediator.take_events() == []
        assert h.remediator.status().breakers[0].state == "open"
        # A human resets it: the page resolves, restarts are allowed again.
        assert h.remediator.reset_breaker("vllm-0", requested_by="erin", reason="fixed the node")
        (closed,) = h.remediator.take_events()
        assert closed.status == "resolved" and closed.fingerprint == pages[0].fingerprint
        assert closed.incident_id == pages[0].incident_id
        h.tick(condition(active=False))
        (task,) = h.tick(condition())
        await until(lambda: len(h.runtime.restarts) == 3, "restart after reset")
        h.tick(condition(active=False))
        assert (await task).decision == "succeeded"

    run(main)


def test_light_step_that_clears_the_condition_avoids_the_restart() -> None:
    async def main() -> None:
        light = RecordingLightStep(ok=True)
        config = remediation_config(
            cooldown_s=0.0, preflight={"enabled": False}, light_step_reset_prefix_cache=True
        )
        h = Harness(config, windows=WatchWindows(after_light_step_s=20.0), light_step=light)
        rule = "fragmentation_kv_blocks"
        (task,) = h.tick(condition(rule))
        await until(lambda: light.calls == ["vllm-0"], "light step")
        h.tick(condition(rule, active=False))
        outcome = await task
        assert outcome.decision == "succeeded" and "light step" in outcome.reason
        assert h.runtime.entered == 0
        # Next time it does not help: the restart follows once the wait runs out.
        h.clock.advance(1000.0)
        (task,) = h.tick(condition(rule))
        await until(lambda: len(light.calls) == 2, "light step again")
        for _ in range(3):
            h.tick(condition(rule), advance_s=10.0)
        await until(lambda: h.runtime.restarts != [], "restart after the light step")
        h.tick(condition(rule, active=False))
        assert (await task).decision == "succeeded"
        assert h.journal.records[2].new_pid == 200

    run(main)


def test_preemption_ladder_branches() -> None:
    async def main() -> None:
        rule = "preemption_spike"
        better = ["python", "-m", "vllm.entrypoints.openai.api_server", "--max-num-seqs", "4"]
        promoted = Harness(FAST, windows=FAST_WATCH, better_config=lambda name: better)
        (task,) = promoted.tick(condition(rule, action="ladder", capacity_leak=False))
        await until(lambda: promoted.runtime.restarts != [], "promotion")
        promoted.tick(condition(rule, action="ladder", active=False))
        assert (await task).decision == "succeeded"
        assert promoted.runtime.restarts[0][1] == tuple(better)
        assert promoted.journal.records[1].action == "promote"

        leak = Harness(FAST, windows=FAST_WATCH)
        (task,) = leak.tick(condition(rule, action="ladder", capacity_leak=True))
        await until(lambda: leak.runtime.restarts != [], "same-flags restart")
        leak.tick(condition(rule, action="ladder", active=False))
        assert (await task).decision == "succeeded"
        assert leak.runtime.restarts[0][1] is None

        advice = Harness(FAST, windows=FAST_WATCH)
        (task,) = advice.tick(condition(rule, action="ladder", capacity_leak=False))
        outcome = await task
        assert outcome.decision == "recommended" and advice.runtime.entered == 0
        (event,) = advice.remediator.take_events()
        assert (
            dict(event.labels)["alertname"] == TUNING_RECOMMENDED_ALERT and event.status == "firing"
        )
        assert "recommended" in advice.decisions("recommend_tuning")
        advice.tick(condition(rule, action="ladder", capacity_leak=False, active=False))
        (ended,) = advice.remediator.take_events()
        assert ended.status == "resolved" and ended.fingerprint == event.fingerprint

    run(main)


def test_reconcile_after_a_crash_mid_restart_does_not_restart_the_incident_again() -> None:
    async def main() -> None:
        journal = MemoryJournal()
        first = Harness(FAST, windows=FAST_WATCH, journal=journal)
        first.runtime.hold = asyncio.Event()  # the restart never returns: kvpilot dies in it
        (task,) = first.tick(condition())
        await until(lambda: first.runtime.entered == 1, "restart entered")
        assert journal.records[1].state == "restarting"
        # kvpilot dies here: the record stays as the crashed run left it.
        second = Remediator(
            first.runtime,
            journal,
            FAST,
            windows=FAST_WATCH,
            clock=first.clock,
            wall_clock=first.clock.wall,
        )
        first.runtime.hold = None
        (result,) = second.reconcile()
        assert result.remediation_id == 1 and result.restart_may_have_happened
        assert journal.records[1].state == "failed"
        assert journal.records[1].reason.startswith("interrupted after the restart began")
        assert [a.decision for a in journal.audit if a.actor == "agent"] == ["interrupted"]
        # The incident is still firing after the restart of kvpilot: no second restart.
        trigger = Trigger(
            "vllm-0",
            "fragmentation_allocator",
            condition().fingerprint,
            "inc-1",
            condition().labels,
            condition().facts,
        )
        again = await second.remediate(trigger)
        assert again.decision == "skipped" and "already restarted" in again.reason
        assert len(first.runtime.restarts) == 0
        # The budget remembers the restart that may have happened.
        assert second.budget.used("vllm-0", first.clock.now_s) == 1
        task.cancel()  # the crashed run's coroutine, still parked in this test's loop
        with contextlib.suppress(asyncio.CancelledError):
            await task

    run(main)


def test_reconcile_of_a_planned_record_allows_a_restart_later() -> None:
    async def main() -> None:
        journal = MemoryJournal()
        h = Harness(FAST, windows=FAST_WATCH, journal=journal)
        journal.start_remediation(
            instance="vllm-0",
            action="restart",
            state="planned",
            reason="x",
            started_wall_s=h.clock.wall(),
            incident_id="inc-9",
        )
        (result,) = h.remediator.reconcile()
        assert not result.restart_may_have_happened
        assert journal.records[1].reason.startswith("not restarted")
        trigger = Trigger(
            "vllm-0",
            "fragmentation_allocator",
            condition().fingerprint,
            "inc-9",
            condition().labels,
            condition().facts,
        )
        task = asyncio.ensure_future(h.remediator.remediate(trigger))
        await until(lambda: h.runtime.restarts != [], "restart")
        h.tick(condition(active=False))
        assert (await task).decision == "succeeded"

    run(main)


def test_the_sqlite_store_is_a_journal_and_reconcile_works_across_processes(tmp_path) -> None:
    from kvpilot.agent.state import StateStore

    async def main() -> None:
        store = StateStore.open(tmp_path)
        first = Harness(FAST, windows=FAST_WATCH, journal=store)  # type: ignore[arg-type]
        first.runtime.hold = asyncio.Event()
        (task,) = first.tick(condition())
        await until(lambda: first.runtime.entered == 1, "restart entered")
        # kvpilot dies mid-restart; a new one opens the same state directory.
        reopened = StateStore.open(tmp_path)
        second = Remediator(
            first.runtime,
            reopened,
            FAST,
            windows=FAST_WATCH,
            clock=first.clock,
            wall_clock=first.clock.wall,
        )
        (result,) = second.reconcile()
        assert result.previous_state == "restarting" and result.restart_may_have_happened
        (record,) = reopened.remediations()
        assert record.state == "failed" and record.finished_wall_s is not None
        trigger = Trigger(
            "vllm-0",
            "fragmentation_allocator",
            condition().fingerprint,
            record.incident_id,
            condition().labels,
            condition().facts,
        )
        assert (await second.remediate(trigger)).decision == "skipped"
        audit = reopened.audit_records()
        assert any(a.decision == "interrupted" for a in audit)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        store.close()
        reopened.close()

    run(main)


def test_shutdown_mid_verification_records_the_interruption() -> None:
    async def main() -> None:
        h = Harness(FAST, windows=FAST_WATCH)
        h.tick(condition())
        await until(lambda: verifying(h), "verifying")
        await h.remediator.aclose()
        record = h.journal.records[1]
        assert record.state == "failed" and record.finished_wall_s is not None
        assert record.reason.startswith("interrupted after the restart began")
        assert not h.remediator.in_progress()

    run(main)


def test_an_unexpected_error_fails_the_record_instead_of_leaving_it_open() -> None:
    class BrokenPreflight:
        def check(self, instance):
            raise RuntimeError("bug")

    async def main() -> None:
        h = Harness(remediation_config(cooldown_s=0.0), preflight=BrokenPreflight())  # type: ignore[arg-type]
        (task,) = h.tick(condition())
        outcome = await task
        assert outcome.decision == "failed" and "internal error during planned" in outcome.reason
        assert h.journal.records[1].finished_wall_s is not None
        assert h.runtime.entered == 0

    run(main)


def test_a_tuning_restart_spends_the_budget_not_the_cooldown() -> None:
    """A sequential canary switches the instance in and back: no sign of a sick instance, so
    a condition right after it is remediated at once (the cooldown would skip it)."""
    from kvpilot.agent.tuning.local.factory import remediated_restarter

    async def main() -> None:
        config = remediation_config(
            cooldown_s=300.0, preflight={"enabled": False}, budget={"max_restarts": 10}
        )
        h = Harness(config, windows=WatchWindows(after_restart_s=10.0))
        tune = remediated_restarter(h.remediator, "vllm-0")
        await tune(("vllm", "serve", "--max-num-seqs", "8"), "sequential canary", False)
        assert len(h.runtime.restarts) == 1
        await restart_and_clear(h)
        assert len(h.runtime.restarts) == 2

    run(main)
