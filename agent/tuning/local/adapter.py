"""The tuner's runtime over the local runtime: the canary is a second local instance, the
stable instance restarts through the runtime (or the agent's remediator), and a promotion is
recorded for the next start (`promoted.py` decides what runs).

The canary carries an id in its environment, recorded in the state database before it
starts: a later kvpilot stops the canary an earlier one left behind by that id, and never
another process, whatever its command line or port.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from kvpilot.agent.runtimes.base import RuntimeFailure
from kvpilot.agent.runtimes.local import LocalInstanceSpec, LocalRuntime
from kvpilot.agent.runtimes.processes import find_vllm_mains
from kvpilot.agent.state.db import Database
from kvpilot.agent.state.store import StateStore
from kvpilot.agent.state.trials import SqliteRolloutJournal, SqliteTrialStore
from kvpilot.agent.tuning.promoted import PROMOTED_FACT
from kvpilot.collectors.procfs import list_processes, live_group_members, read_environ
from kvpilot.collectors.secrets import SecretLost, has_masked, restore_secrets
from kvpilot.collectors.vllm_argv import set_flag
from kvpilot.tuner.rollout.canary import Recovered, recover
from kvpilot.tuner.rollout.ports import CandidateStartFailed, RestartRefused

log = logging.getLogger(__name__)

CANARY_NAME = "canary"
CANARY_FACT = "tuning.canary"  # {"id": ..., "port": ...}: the canary this kvpilot started
CANARY_ID_ENV = "KVPILOT_CANARY_ID"
# The stable server a `kvpilot tune` started carries this id, recorded until that run ends:
# a run killed before its clean-up leaves a server the next run knows as a leftover.
STABLE_FACT = "tuning.stable_owner"
STABLE_OWNER_ENV = "KVPILOT_TUNE_OWNER"
_START_HEADER = "===== kvpilot: start #"

# Restarts the stable instance with (argv, reason, restore); raises RestartRefused when its
# guards say no and RuntimeFailure when the server does not come back.
StableRestarter = Callable[[tuple[str, ...], str, bool], Awaitable[None]]


class LocalTunerAdapter:
    """The tuner's TunerRuntime over a LocalRuntime: the canary is a second local instance."""

    def __init__(
        self,
        runtime: LocalRuntime,
        *,
        stable_name: str,
        canary_port: int,
        log_dir: Path,
        db: Database,
        configured_argv: Sequence[str],
        config_sha256: str,
        canary_env: Sequence[tuple[str, str]] = (),
        canary_cpus: Sequence[int] = (),
        drain_timeout_s: float = 10.0,
        remediation_in_progress: Callable[[], bool] = lambda: False,
        restart_stable: StableRestarter | None = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._runtime = runtime
        self._stable = stable_name
        self._canary_port = canary_port
        self._log_dir = log_dir
        self._store = StateStore(db)
        self._configured = tuple(configured_argv)
        self._sha = config_sha256
        self._canary_env = tuple(canary_env)
        self._canary_cpus = tuple(canary_cpus)
        self._drain_s = drain_timeout_s
        self._remediating = remediation_in_progress
        self._restart_stable = restart_stable
        self._wall = wall_clock
        self._canary: LocalRuntime | None = None
        self.last_trial_number: int | None = None

    def stable_argv(self) -> tuple[str, ...]:
        for instance in self._runtime.instances():
            if instance.name == self._stable:
                assert instance.argv is not None  # the local runtime starts it from its argv
                return tuple(instance.argv)
        raise RuntimeFailure(f"no stable instance {self._stable!r}")

    def stable_url(self) -> str:
        return next(i.url for i in self._runtime.instances() if i.name == self._stable)

    def canary_url(self) -> str:
        return f"http://127.0.0.1:{self._canary_port}"

    def _with_secrets(self, argv: Sequence[str]) -> tuple[str, ...]:
        """An argv read back from the journal holds its secrets masked: they come from the
        stable's argv (else the configured one), which the tuner never changes."""
        if not has_masked(argv):
            return tuple(argv)
        sources = [self._configured]
        with contextlib.suppress(RuntimeFailure):
            sources.insert(0, self.stable_argv())
        for source in sources:
            with contextlib.suppress(SecretLost):
                return restore_secrets(argv, source)
        raise RuntimeFailure(
            "a stored argv's masked secret is in neither the running argv nor the configured one"
        )

    async def start_canary(self, argv: Sequence[str], *, ready_timeout_s: float) -> str:
        argv = self._with_secrets(argv)
        await self._stop_left_canary()
        # Recorded before it starts: a kvpilot that dies while it starts leaves it findable.
        canary_id = uuid.uuid4().hex
        fact = {"id": canary_id, "port": self._canary_port}
        self._store.set_fact(CANARY_FACT, fact, self._wall())
        # The stable's environment (offline mode, thread binding), never its plugin port.
        spec = LocalInstanceSpec(
            CANARY_NAME,
            set_flag(argv, "--port", self._canary_port),
            "canary",
            (*self._canary_env, (CANARY_ID_ENV, canary_id)),
            cpus=self._canary_cpus,
        )
        self._canary = LocalRuntime([spec], self._log_dir)
        try:
            await self._canary.start(CANARY_NAME, ready_timeout_s=ready_timeout_s)
        except RuntimeFailure as exc:
            raise CandidateStartFailed(
                str(exc), _last_start(self._canary.log_path(CANARY_NAME))
            ) from exc
        return self.canary_url()

    async def stop_canary(self) -> None:
        if self._canary is not None:
            await self._canary.stop(CANARY_NAME, drain_timeout_s=self._drain_s)
            self._canary = None
        await self._stop_left_canary()
        for other in find_vllm_mains(list_processes(), port=self._canary_port):
            log.warning(
                "a vLLM server kvpilot did not start (PID %d) is on the canary port %d: left alone",
                other.pid,
                self._canary_port,
            )

    async def aclose(self) -> None:
        """Stop the canary this adapter started if one still runs (every way out of a run);
        a canary it did not start is left to recovery, by its recorded id."""
        if self._canary is not None:
            await self.stop_canary()

    async def _stop_left_canary(self) -> None:
        """The canary a kvpilot that died left running, by the id it recorded."""
        left = self._store.get_fact(CANARY_FACT)
        if left is not None:
            killed = await kill_own_canary(str(left["id"]))
            if killed:
                log.warning("stopped the canary an earlier kvpilot left running: PID %s", killed)
            self._store.delete_fact(CANARY_FACT)

    async def set_stable(
        self, argv: Sequence[str], *, reason: str, ready_timeout_s: float, restore: bool = False
    ) -> None:
        """Restart the stable instance with `argv`: through `restart_stable` (the agent's
        remediator, with its guards) when given, else straight through the runtime (an
        operator's `kvpilot tune`). A refusal changes nothing and is not recorded."""
        argv = self._with_secrets(argv)
        try:
            if self._restart_stable is not None:
                await self._restart_stable(tuple(argv), reason, restore)
            else:
                await self._runtime.restart(
                    self._stable,
                    drain_timeout_s=self._drain_s,
                    ready_timeout_s=ready_timeout_s,
                    argv=argv,
                )
        except RestartRefused:
            raise
        except RuntimeFailure as exc:
            log = _last_start(self._runtime.log_path(self._stable))
            raise CandidateStartFailed(str(exc), log) from exc
        finally:
            self._record(tuple(argv), reason)

    def _record(self, argv: tuple[str, ...], reason: str) -> None:
        """The promotion, for the next start; the store keeps the argv masked."""
        if argv == self._configured:
            self._store.delete_fact(PROMOTED_FACT)
        else:
            fact = {"argv": list(argv), "yaml_sha256": self._sha, "reason": reason}
            self._store.set_fact(PROMOTED_FACT, fact, self._wall())

    def remediation_in_progress(self) -> bool:
        return self._remediating()


async def kill_own_canary(canary_id: str, deadline_s: float = 30.0) -> list[int]:
    """SIGKILL the process group of the canary started with `canary_id` in its environment, and
    of nothing else; returns the PIDs killed. A canary leads its own process group (the
    runtime starts each server in its own session); a process of another user, whose
    environment cannot be read, is never this kvpilot's."""
    killed = []
    loop = asyncio.get_running_loop()
    for info in find_vllm_mains(list_processes()):
        if info.pgid != info.pid:
            continue
        env = read_environ(info.pid)
        if env is None or env.get(CANARY_ID_ENV) != canary_id:
            continue
        with contextlib.suppress(ProcessLookupError):
            os.killpg(info.pgid, signal.SIGKILL)
        killed.append(info.pid)
        end = loop.time() + deadline_s
        # Polls /proc: nothing signals the end of a process group that is not our child.
        while live_group_members(info.pgid) and loop.time() < end:  # noqa: ASYNC110
            await asyncio.sleep(0.2)
    return killed


def _last_start(path: Path) -> str:
    """The log of the last start only (earlier starts' errors are not this one's reason)."""
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return ""
    return text[text.rfind(_START_HEADER) :] if _START_HEADER in text else text


def open_stores(state_dir: Path) -> tuple[Database, SqliteTrialStore, SqliteRolloutJournal]:
    """The state database with the trial store and rollout journal on it."""
    db = Database.open(state_dir)
    return db, SqliteTrialStore(db), SqliteRolloutJournal(db)


async def recover_at_startup(
    db: Database, adapter: LocalTunerAdapter, *, wall_clock: Callable[[], float] = time.time
) -> list[Recovered]:
    """A trial left running by a dead kvpilot: stop its canary, keep or restore the stable
    flags, record it aborted. Returns what was recovered."""
    return await recover(
        SqliteRolloutJournal(db), SqliteTrialStore(db), adapter, at_wall_s=wall_clock()
    )


@dataclass(frozen=True, slots=True)
class StableEnd:
    """What the end of a `kvpilot tune` did with the stable server: `stopped` (it started
    it), `kept` (it started it and hands it over), `left` (it was running before), or
    `none` (none runs)."""

    name: str
    action: Literal["stopped", "kept", "left", "none"]
    pid: int | None
    port: int | None


async def end_stable(
    runtime: LocalRuntime, name: str, *, found_running: bool, keep: bool, drain_timeout_s: float
) -> StableEnd:
    """Stop the stable server a `kvpilot tune` started (drained, then its process group
    killed), unless `keep`; one that ran before it started (`found_running`, even when a
    promotion restarted it) is left as it was found."""
    status = runtime.status(name)
    url = next(i.url for i in runtime.instances() if i.name == name)
    port = urlsplit(url).port
    running = status.state == "running"
    if found_running or (keep and running):
        action: Literal["kept", "left", "none"] = "none"
        if running:
            action = "left" if found_running else "kept"
        return StableEnd(name, action, status.main_pid, port)
    await runtime.stop(name, drain_timeout_s=drain_timeout_s)  # an exited one's workers too
    return StableEnd(name, "stopped" if running else "none", status.main_pid, port)


def stable_owner_id(db: Database, wall_s: float) -> str:
    """The id the stable server a `kvpilot tune` starts carries: the one a killed run left
    recorded (its server is this run's to stop), else a new one; recorded before it starts."""
    store = StateStore(db)
    left = store.get_fact(STABLE_FACT)
    owner_id = str(left["id"]) if left is not None else uuid.uuid4().hex
    store.set_fact(STABLE_FACT, {"id": owner_id}, wall_s)
    return owner_id


def started_by_tune(runtime: LocalRuntime, name: str, owner_id: str) -> bool:
    """Whether the running stable server carries `owner_id`: a killed `kvpilot tune` left it."""
    pid = runtime.status(name).main_pid
    env = None if pid is None else read_environ(pid)
    return env is not None and env.get(STABLE_OWNER_ENV) == owner_id
