"""What `kvpilot run` does once its parts exist: the servers an earlier kvpilot left running
adopted, the local servers started beside the loop, and a tuning trial left open recovered."""

from __future__ import annotations

import asyncio
import logging
import time

from kvpilot.agent.config.runtime import RuntimeConfig
from kvpilot.agent.remediation import Remediator
from kvpilot.agent.remediation.oom.startup import start_guarded
from kvpilot.agent.runtimes import LocalRuntime, Runtime, RuntimeFailure
from kvpilot.agent.runtimes.probe import StartFailed
from kvpilot.agent.state import StateStore
from kvpilot.agent.tuning.schedule import ScheduledTuning
from kvpilot.agent.tuning.study import StudyError

log = logging.getLogger(__name__)


def adopt_orphans(runtime: LocalRuntime, store: StateStore) -> None:
    """The local runtime's servers an earlier kvpilot left running: adopted, and audited."""
    for name in runtime.adopt_orphans():
        log.warning("instance %s: adopted the server an earlier kvpilot left running", name)
        store.record_audit(
            wall_s=time.time(),
            actor="agent",
            action="adopt",
            target=name,
            decision="adopted",
            reason="a server started by an earlier kvpilot still runs with this instance's argv",
        )


async def start_local(
    section: RuntimeConfig,
    runtime: Runtime,
    remediator: Remediator,
    tuning: ScheduledTuning | None,
    stop: asyncio.Event,
    failed: list[StartFailed],
) -> None:
    """The local runtime's servers start beside the loop, so /healthz answers meanwhile
    (the other runtimes start none); then a tuning trial an earlier kvpilot left open is
    recovered (the pod's: a rollout resumed). A server that exits before it was first ready
    (a wrong argv, no vLLM in its Python) stops the agent."""

    async def start(name: str) -> None:
        try:
            await start_guarded(  # a memory death at start-up: the OOM guard steps the knob
                runtime, remediator, name, ready_timeout_s=section.ready_timeout_s
            )
            log.info("instance %s started", name)
        except StartFailed as exc:
            log.error("instance %s failed to start, stopping kvpilot: %s", name, exc.headline)
            failed.append(exc)
            stop.set()
        except RuntimeFailure as exc:
            # Still starting, or gone later: the rules see it; remediation decides.
            log.error("instance %s failed to start: %s", name, exc)

    await asyncio.gather(*(start(i.name) for i in section.started_instances))

    if tuning is not None:
        await tuning_start_up(tuning)


async def tuning_start_up(tuning: ScheduledTuning) -> None:
    try:
        await tuning.start_up()
    except StudyError as exc:
        # Expected while vLLM still downloads its model: said in one line, not a traceback.
        log.warning(
            "tuning: no recovery at start-up (%s); the next scheduled run recovers first", exc
        )
    except Exception:  # the next scheduled run recovers again first
        log.exception("recovering the tuning trial left open failed")
