"""The tuner's runtime over the local runtime, built one way for every caller: `kvpilot tune`,
`kvpilot trials` (which only recovers) and the agent's scheduled tuning (whose restarts of
the stable server go through the remediator, `remediated_restarter`)."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path

from kvpilot.agent.config.tuning import TuningConfig
from kvpilot.agent.remediation import Remediator, Trigger
from kvpilot.agent.remediation.ladder import LadderPlan
from kvpilot.agent.remediation.trigger import TUNING_RULE
from kvpilot.agent.runtimes.base import RuntimeFailure
from kvpilot.agent.runtimes.local import LocalInstanceSpec, LocalRuntime
from kvpilot.agent.state.db import Database
from kvpilot.agent.state.store import StateStore
from kvpilot.agent.tuning.local.adapter import STABLE_OWNER_ENV, LocalTunerAdapter, StableRestarter
from kvpilot.agent.tuning.promoted import PROMOTED_FACT, LiveArgv, live_argv
from kvpilot.agent.tuning.server import TunedServer
from kvpilot.tuner.rollout.ports import RestartRefused


def _never() -> bool:
    return False


def local_adapter(
    server: TunedServer,
    runtime: LocalRuntime,
    db: Database,
    *,
    tuning: TuningConfig,
    log_dir: Path,
    config_sha256: str,
    remediation_in_progress: Callable[[], bool] = _never,
    restart_stable: StableRestarter | None = None,
) -> LocalTunerAdapter:
    """The adapter for the tuned `server` in `runtime`: the canary on `tuning`'s port and
    CPUs with the server's environment, its log in `log_dir`, promotions recorded in `db`
    under `config_sha256`. Without `restart_stable` the stable instance restarts straight
    through `runtime`."""
    return LocalTunerAdapter(
        runtime,
        stable_name=server.name,
        canary_port=tuning.canary_port,
        log_dir=log_dir,
        db=db,
        configured_argv=server.argv,
        config_sha256=config_sha256,
        canary_env=server.env,
        canary_cpus=tuning.canary_cpus,
        remediation_in_progress=remediation_in_progress,
        restart_stable=restart_stable,
    )


def stable_runtime(
    server: TunedServer,
    log_dir: Path,
    db: Database,
    config_sha256: str,
    *,
    owner_id: str | None = None,
) -> tuple[LocalRuntime, LiveArgv]:
    """A runtime of the tuned `server` alone (its log in `log_dir`), with its live flags (and
    why), for the commands that tune outside the agent; a server an earlier kvpilot left
    running is adopted. The servers it starts carry `owner_id` (see `STABLE_FACT`)."""
    live = live_argv(server.argv, StateStore(db).get_fact(PROMOTED_FACT), config_sha256)
    env = server.env
    if owner_id is not None:
        env = (*env, (STABLE_OWNER_ENV, owner_id))
    spec = LocalInstanceSpec(server.name, live.argv, "stable", env, server.kvpool_port, server.cpus)
    runtime = LocalRuntime([spec], log_dir)

    runtime.adopt_orphans()
    return runtime, live


def remediated_restarter(remediator: Remediator, instance: str) -> StableRestarter:
    """The tuner's stable restarts as remediations of `instance` (rule `tuning`)."""

    async def restart(argv: tuple[str, ...], reason: str, restore: bool) -> None:
        trigger = Trigger(
            instance=instance,
            rule=TUNING_RULE,
            fingerprint=None,
            incident_id=f"tuning-{uuid.uuid4().hex[:12]}",
            actor="agent",
            requested_by="tuner",
            force=restore,
        )
        plan = LadderPlan(
            rule=TUNING_RULE, action="promote", steps=("promote",), reason=reason, argv=argv
        )
        outcome = await remediator.remediate(trigger, plan)
        if outcome.decision == "succeeded":
            return
        if outcome.decision == "failed":
            raise RuntimeFailure(outcome.reason)
        raise RestartRefused(outcome.reason)  # skipped by a guard, vetoed, dry-run

    return restart
