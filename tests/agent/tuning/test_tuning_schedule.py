"""Scheduled tuning: when a firing runs, when it is skipped, and how the tuner's restarts go
through the remediator (the real one, over the recording runtime double and its journal)."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import pytest

from kvpilot.agent.runtimes.base import RuntimeFailure
from kvpilot.agent.tuning.local.factory import remediated_restarter
from kvpilot.agent.tuning.schedule import ScheduledTuning
from kvpilot.tuner.rollout.ports import RestartRefused
from kvpilot.tuner.session import TuningBlocked
from tests.agent.remediation.remediation_helpers import Harness, remediation_config

NEW_FLAGS = (
    "python",
    "-m",
    "vllm.entrypoints.openai.api_server",
    "--model",
    "m",
    "--max-num-seqs",
    "8",
)


class Scheduled:
    """A ScheduledTuning whose run is a coroutine the test releases."""

    def __init__(self, result: object = "ran 3 trials") -> None:
        self.remediating = False
        self.cooling: str | None = None
        self.audits: list[tuple[str, str]] = []
        self.release = asyncio.Event()
        self.runs = 0
        self.result = result
        self.tuning = ScheduledTuning(
            "0 3 * * *",
            self._run,
            remediation_in_progress=lambda: self.remediating,
            audit=lambda decision, reason: self.audits.append((decision, reason)),
            cooling_down=lambda: self.cooling,
        )

    async def started(self) -> Scheduled:
        await self.tuning.start_up()
        return self

    async def _run(self) -> str:
        self.runs += 1
        await self.release.wait()
        if isinstance(self.result, BaseException):
            raise self.result
        return str(self.result)


def test_the_schedule_is_a_crontab_line_in_utc() -> None:
    tuning = Scheduled().tuning
    at = tuning.next_fire_time(datetime(2026, 11, 29, 14, 0, tzinfo=UTC))
    assert at == datetime(2026, 11, 30, 3, 0, tzinfo=UTC)


def test_a_firing_before_the_servers_have_started_runs_once_they_are() -> None:
    async def main() -> None:
        s = Scheduled()
        deferred = "deferred: kvpilot is still starting its servers: the run follows once they are"
        assert await s.tuning.fire() == deferred
        assert await s.tuning.fire() == deferred  # two firings meanwhile: one run
        assert s.runs == 0
        s.release.set()
        await s.tuning.start_up()
        assert s.runs == 1
        assert [d for d, _ in s.audits] == ["deferred", "deferred", "started", "finished"]
        await s.tuning.start_up()  # nothing deferred any more
        assert s.runs == 1

    asyncio.run(main())


def test_a_firing_runs_and_audits_its_start_and_end() -> None:
    async def main() -> None:
        s = await Scheduled().started()
        s.release.set()
        assert await s.tuning.fire() == "finished: ran 3 trials"
        assert s.audits == [("started", "scheduled tuning run"), ("finished", "ran 3 trials")]

    asyncio.run(main())


def test_no_run_starts_within_the_cooldown_of_a_restart_of_the_stable_instance() -> None:
    async def main() -> None:
        s = await Scheduled().started()
        s.cooling = "cooldown: last action 40 s ago, next allowed in 260 s"
        said = await s.tuning.fire()
        assert said == (
            "skipped: the stable instance was restarted recently: cooldown: last "
            "action 40 s ago, next allowed in 260 s"
        )
        assert s.runs == 0
        s.cooling = None
        s.release.set()
        assert await s.tuning.fire() == "finished: ran 3 trials"

    asyncio.run(main())


def test_no_run_starts_while_a_remediation_is_in_progress() -> None:
    async def main() -> None:
        s = await Scheduled().started()
        s.remediating = True
        assert await s.tuning.fire() == "skipped: a remediation is in progress"
        assert s.runs == 0 and s.audits == [("skipped", "a remediation is in progress")]

    asyncio.run(main())


def test_one_run_at_a_time() -> None:
    async def main() -> None:
        s = await Scheduled().started()
        first = asyncio.create_task(s.tuning.fire())
        await asyncio.sleep(0)  # the first firing starts its run and waits for the release
        assert s.tuning.running
        assert await s.tuning.fire() == "skipped: the previous tuning run is still going"
        s.release.set()
        assert await first == "finished: ran 3 trials"
        assert s.runs == 1

    asyncio.run(main())


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (TuningBlocked("a remediation is in progress"), "skipped: a remediation is in progress"),
        (
            RuntimeError("the canary port is taken"),
            "failed: RuntimeError: the canary port is taken",
        ),
    ],
)
def test_a_run_that_cannot_go_on_is_audited_and_the_next_firing_runs(
    error: Exception, expected: str
) -> None:
    async def main() -> None:
        s = await Scheduled(result=error).started()
        s.release.set()
        assert await s.tuning.fire() == expected
        s.result = "ran 1 trials"
        assert await s.tuning.fire() == "finished: ran 1 trials"

    asyncio.run(main())


def test_aclose_cancels_a_run_in_progress() -> None:
    async def main() -> None:
        s = await Scheduled().started()
        firing = asyncio.create_task(s.tuning.fire())
        await asyncio.sleep(0)
        await s.tuning.aclose()
        with pytest.raises(asyncio.CancelledError):
            await firing
        assert not s.tuning.running and s.audits[-1] == ("cancelled", "kvpilot is stopping")

    asyncio.run(main())


def test_a_promotion_is_a_guarded_audited_restart_with_the_new_flags() -> None:
    async def main() -> None:
        h = Harness(remediation_config(cooldown_s=300.0, preflight={"enabled": False}))
        restart = remediated_restarter(h.remediator, "vllm-0")
        assert h.remediator.cooling_down("vllm-0") is None
        await restart(NEW_FLAGS, "promoted by trial 4", False)
        # A tuning restart spends the restart budget, not remediation's cooldown.
        assert h.remediator.cooling_down("vllm-0") is None
        assert h.remediator.cooling_down("vllm-1") is None
        assert [(name, argv) for name, argv, *_ in h.runtime.restarts] == [("vllm-0", NEW_FLAGS)]
        (record,) = h.journal.remediations()
        assert (record.action, record.state, record.reason) == (
            "promote",
            "succeeded",
            "restarted: healthy and a probe answered",
        )
        # A sequential canary switches in and back at once: no cooldown stands between.
        await restart((*NEW_FLAGS, "--block-size", "16"), "canary of trial 5", False)
        await restart(NEW_FLAGS, "trial 5 rolled back", True)
        assert len(h.runtime.restarts) == 3
        assert all(a.actor == "agent" for a in h.journal.audit if a.target == "vllm-0")

    asyncio.run(main())


def test_dry_run_refuses_and_a_failed_restart_is_a_runtime_failure() -> None:
    async def main() -> None:
        dry = Harness(
            remediation_config(dry_run=True, cooldown_s=0.0, preflight={"enabled": False})
        )
        with pytest.raises(RestartRefused, match="dry-run"):
            await remediated_restarter(dry.remediator, "vllm-0")(NEW_FLAGS, "promote", False)
        assert dry.runtime.restarts == []
        h = Harness(remediation_config(cooldown_s=0.0, preflight={"enabled": False}))
        h.runtime.failures.append(RuntimeFailure("exit code 1 during start-up"))
        with pytest.raises(RuntimeFailure, match="exit code 1"):
            await remediated_restarter(h.remediator, "vllm-0")(NEW_FLAGS, "promote", False)

    asyncio.run(main())
