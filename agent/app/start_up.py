"""What `kvpilot run` does once its parts exist: the scheduled tuning chosen for the runtime,
the servers an earlier kvpilot left running adopted, the local servers started beside the
loop, and a tuning trial left open recovered."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from kvpilot.agent.config import AgentConfig, LocalRuntimeConfig
from kvpilot.agent.remediation import Remediator
from kvpilot.agent.remediation.oom.startup import start_guarded
from kvpilot.agent.runtimes import LocalRuntime, Runtime, RuntimeFailure
from kvpilot.agent.runtimes.kubernetes.runtime import KubernetesRuntime
from kvpilot.agent.runtimes.probe import StartFailed
from kvpilot.agent.state import StateStore
from kvpilot.agent.tick.after import CompletedRuns
from kvpilot.agent.tuning.schedule import (
    ScheduledTuning,
    pod_scheduled_tuning,
    scheduled_tuning,
)
from kvpilot.agent.tuning.study import StudyError
from kvpilot.agent.tuning.workload.choice import WorkloadChoice

log = logging.getLogger(__name__)


def scheduled_tuning_of(
    config: AgentConfig,
    config_sha256: str | None,
    parts: tuple[Runtime, Remediator, StateStore],
    *,
    api_key: str | None,
    vllm_version: Callable[[], str | None],
    workload: Callable[[], WorkloadChoice | None],
    completed_runs: CompletedRuns,
) -> ScheduledTuning | None:
    """The scheduled tuning of the local or the pod runtime; None when no schedule is set
    (or the study cannot be built: collecting and alerting go on without it). Each run that
    completes is marked in `completed_runs`, for the re-tune step."""
    runtime, remediator, store = parts
    if config.tuning.schedule is None:
        return None
    if isinstance(runtime, LocalRuntime):
        try:
            return scheduled_tuning(
                config,
                config_sha256 or "",
                runtime,
                remediator,
                store,
                api_key=api_key,
                vllm_version=vllm_version,
                workload=workload,
                on_tuned=completed_runs.mark,
            )
        except StudyError as exc:
            log.error("scheduled tuning is off: %s", exc)
            return None
    if isinstance(runtime, KubernetesRuntime):
        return pod_scheduled_tuning(
            config,
            runtime,
            remediator,
            store,
            api_key=api_key,
            vllm_version=vllm_version,
            workload=workload,
            on_tuned=completed_runs.mark,
        )
    return None


def adopt_orphans(runtime: Runtime, store: StateStore) -> None:
    """The local runtime's servers an earlier kvpilot left running: adopted, and audited."""
    if not isinstance(runtime, LocalRuntime):
        return
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
    config: AgentConfig,
    runtime: Runtime,
    remediator: Remediator,
    tuning: ScheduledTuning | None,
    stop: asyncio.Event,
    failed: list[StartFailed],
) -> None:
    """The local runtime's servers start beside the loop, so /healthz answers meanwhile;
    then a tuning trial an earlier kvpilot left open is recovered. A server that exits
    before it was first ready (a wrong argv, no vLLM in its Python) stops the agent."""
    if not isinstance(config.runtime, LocalRuntimeConfig):
        if tuning is not None:  # the pod's: resume or recover a rollout left open
            await tuning_start_up(tuning)
        return

    async def start(name: str) -> None:
        try:
            await start_guarded(  # a memory death at start-up: the OOM guard steps the knob
                runtime, remediator, name, ready_timeout_s=config.runtime.ready_timeout_s
            )
            log.info("instance %s started", name)
        except StartFailed as exc:
            log.error("instance %s failed to start, stopping kvpilot: %s", name, exc.headline)
            failed.append(exc)
            stop.set()
        except RuntimeFailure as exc:
            # Still starting, or gone later: the rules see it; remediation decides.
            log.error("instance %s failed to start: %s", name, exc)

    await asyncio.gather(*(start(i.name) for i in config.runtime.instances))
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
