"""The tuner's runtime over the local runtime, built one way for every caller: `kvpilot tune`,
`kvpilot trials` (which only recovers) and the agent's scheduled tuning."""

from __future__ import annotations

from collections.abc import Callable

from kvpilot.agent.config import AgentConfig
from kvpilot.agent.config.tuning import TuningConfig
from kvpilot.agent.runtimes.local import LocalInstanceSpec, LocalRuntime
from kvpilot.agent.state.db import Database
from kvpilot.agent.state.store import StateStore
from kvpilot.agent.tuning.local_adapter import STABLE_OWNER_ENV, LocalTunerAdapter, StableRestarter
from kvpilot.agent.tuning.promoted import PROMOTED_FACT, LiveArgv, live_argv
from kvpilot.agent.tuning.study import stable_instance


def _never() -> bool:
    return False


def local_adapter(
    config: AgentConfig,
    runtime: LocalRuntime,
    db: Database,
    *,
    config_sha256: str,
    tuning: TuningConfig | None = None,
    remediation_in_progress: Callable[[], bool] = _never,
    restart_stable: StableRestarter | None = None,
) -> LocalTunerAdapter:
    """The adapter for the configuration's tuned instance in `runtime`: the canary on
    `tuning`'s port and CPUs (default: the configuration's `tuning`) with the stable
    instance's environment, promotions recorded in `db` under `config_sha256`. Without
    `restart_stable` the stable instance restarts straight through `runtime`."""
    inst = stable_instance(config)
    tuning = tuning or config.tuning
    return LocalTunerAdapter(
        runtime,
        stable_name=inst.name,
        canary_port=tuning.canary_port,
        log_dir=config.state_dir / "logs",
        db=db,
        configured_argv=tuple(inst.argv),
        config_sha256=config_sha256,
        canary_env=tuple(inst.env.items()),
        canary_cpus=tuning.canary_cpus,
        remediation_in_progress=remediation_in_progress,
        restart_stable=restart_stable,
    )


def stable_runtime(
    config: AgentConfig, db: Database, config_sha256: str, *, owner_id: str | None = None
) -> tuple[LocalRuntime, LiveArgv]:
    """A runtime of the tuned instance alone, with its live flags (and why), for the commands
    that tune outside the agent; a server an earlier kvpilot left running is adopted. The
    servers it starts carry `owner_id` (see `STABLE_FACT`)."""
    inst = stable_instance(config)
    live = live_argv(inst.argv, StateStore(db).get_fact(PROMOTED_FACT), config_sha256)
    env = tuple(inst.env.items())
    if owner_id is not None:
        env = (*env, (STABLE_OWNER_ENV, owner_id))
    spec = LocalInstanceSpec(inst.name, live.argv, "stable", env, inst.kvpool_port, inst.cpus)
    runtime = LocalRuntime([spec], config.state_dir / "logs")
    runtime.adopt_orphans()
    return runtime, live
