"""The live switch as remediation reads it, and vetoes that expire or are lifted."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from kvpilot.agent.mode import LiveMode, Mode, ModeSource, parse_mode
from kvpilot.agent.state.decision import Decision
from tests.fakes.remediation_journal import MemoryJournal

from .remediation_helpers import Harness, condition, remediation_config, until

CONFIG = remediation_config(preflight={"enabled": False}, cooldown_s=0.0)


def run(main: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(main())


def test_layers_apply_in_order_and_each_change_is_heard() -> None:
    heard: list[tuple[Mode, Mode]] = []
    live = LiveMode(Mode.ARMED, on_change=lambda was, now: heard.append((was.mode, now.mode)))
    live.set(ModeSource.API, Mode.DRY_RUN)
    live.set(ModeSource.DEPLOYMENT, Mode.PAUSED)
    live.set(ModeSource.NAMESPACE, Mode.ARMED)  # under the Deployment's: nothing changes
    assert live.current().mode is Mode.PAUSED
    live.set(ModeSource.DEPLOYMENT, None)
    assert (live.current().mode, live.current().source) == (Mode.ARMED, ModeSource.NAMESPACE)
    assert heard == [
        (Mode.ARMED, Mode.DRY_RUN),
        (Mode.DRY_RUN, Mode.PAUSED),
        (Mode.PAUSED, Mode.ARMED),
    ]
    with pytest.raises(ValueError, match="always sets"):
        live.set(ModeSource.CONFIG, None)


def test_a_mode_that_is_not_one_says_which_are() -> None:
    assert parse_mode(" DRY-RUN\n") is Mode.DRY_RUN
    with pytest.raises(ValueError, match="use one of paused, dry-run, armed"):
        parse_mode("armd")


def test_switched_to_dry_run_while_running_decides_and_does_nothing() -> None:
    """The configuration says armed; the switch, moved at run time, wins."""

    async def main() -> None:
        h = Harness(CONFIG)
        h.remediator.mode.set(ModeSource.NAMESPACE, Mode.DRY_RUN, "ConfigMap kvpilot-mode")
        (task,) = h.tick(condition())
        outcome = await task
        assert outcome.decision is Decision.DRY_RUN and h.runtime.entered == 0
        assert "namespace" in outcome.reason
        assert h.remediator.status().dry_run and h.remediator.status().mode == "dry-run"
        mode_audit = [a for a in h.journal.audit if a.action == "mode"]
        assert [a.decision for a in mode_audit] == ["switched"]
        assert mode_audit[0].reason.startswith("now dry-run (set by namespace")

    run(main)


def test_paused_skips_every_remediation_and_armed_again_acts() -> None:
    async def main() -> None:
        h = Harness(CONFIG)
        h.remediator.mode.set(ModeSource.DEPLOYMENT, Mode.PAUSED)
        (task,) = h.tick(condition())
        paused = await task
        assert paused.decision is Decision.SKIPPED and "paused" in paused.reason
        manual = await h.remediator.trigger("vllm-0", requested_by="bob", force=True)
        assert manual.decision is Decision.SKIPPED and h.runtime.entered == 0

        h.remediator.mode.set(ModeSource.DEPLOYMENT, None)
        h.tick(condition(active=False))
        h.tick(condition())
        await until(lambda: h.runtime.entered == 1, "the restart, once armed again")
        await h.remediator.aclose()

    run(main)


def test_a_veto_with_a_duration_ends_on_its_own() -> None:
    async def main() -> None:
        h = Harness(CONFIG)
        made = h.remediator.veto(
            instance="vllm-0", requested_by="carol", reason="maintenance", duration_s=600.0
        )
        assert made.until_wall_s == pytest.approx(h.clock.wall() + 600.0)
        (task,) = h.tick(condition())
        assert (await task).decision == "vetoed"
        assert [v.target for v in h.remediator.status().vetoes] == ["vllm-0"]

        h.tick(condition(active=False), advance_s=601.0)
        assert h.remediator.status().vetoes == ()
        assert [a.decision for a in h.journal.audit if a.action == "veto"] == [
            "vetoed",
            "veto expired",
        ]
        assert not h.remediator.lift_veto(instance="vllm-0", requested_by="carol", reason="x")

    run(main)


def test_vetoes_outlive_a_restart_of_kvpilot_but_not_their_end() -> None:
    journal = MemoryJournal()
    first = Harness(CONFIG, journal=journal)
    first.remediator.veto(instance="vllm-0", requested_by="c", reason="r", duration_s=100.0)
    first.remediator.veto(incident_id="inc-1", requested_by="c", reason="r")

    later = Harness(CONFIG, journal=journal)
    later.clock.advance(50.0)
    later.remediator.reconcile()
    kept = {(v.kind, v.target, v.until_wall_s is None) for v in later.remediator.status().vetoes}
    assert kept == {("instance", "vllm-0", False), ("incident", "inc-1", True)}

    last = Harness(CONFIG, journal=journal)
    last.clock.advance(150.0)  # past the instance's end while no kvpilot ran
    last.remediator.reconcile()
    assert [v.target for v in last.remediator.status().vetoes] == ["inc-1"]


def test_vetoes_saved_by_an_earlier_version_are_restored() -> None:
    journal = MemoryJournal()
    journal.set_fact("remediation.vetoes", {"instances": ["vllm-0"], "incidents": []}, 0.0)
    h = Harness(CONFIG, journal=journal)
    h.remediator.reconcile()
    assert h.remediator.status().vetoed_instances == ("vllm-0",)


def test_tunings_restart_is_refused_while_paused() -> None:
    """A promotion or rollback goes through the remediator: paused, it is refused."""
    from kvpilot.agent.tuning.local.factory import remediated_restarter
    from kvpilot.tuner.rollout.ports import RestartRefused

    async def main() -> None:
        h = Harness(CONFIG)
        h.remediator.mode.set(ModeSource.NAMESPACE, Mode.PAUSED)
        with pytest.raises(RestartRefused, match="paused"):
            await remediated_restarter(h.remediator, "vllm-0")(("--x",), "promote", False)
        assert h.runtime.restarts == []

    run(main)
