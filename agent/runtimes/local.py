"""The embedded runtime: kvpilot starts and supervises vLLM processes from their argv.

Each instance runs in its own process group (its own session), with its output appended to
`<log_dir>/<name>.log`, and carries a mark of its own in its environment (`SERVER_MARK_ENV`):
a stop reaches every process it started, whatever killed its leader and wherever they went.
The runtime never restarts a server by itself: an exit shows in `status()` and the
remediation layer decides, under its budget.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path

from kvpilot.agent.model import Instance, Role
from kvpilot.agent.runtimes.base import (
    InstanceStatus,
    RuntimeFailure,
    RuntimeKind,
    StopResult,
    UnknownInstance,
)
from kvpilot.agent.runtimes.drain import drain_then_kill
from kvpilot.agent.runtimes.launch_hint import no_vllm_hint, not_found_hint
from kvpilot.agent.runtimes.probe import START_MARKER, StartFailed, wait_ready
from kvpilot.agent.runtimes.processes import (
    KEEP_ENVIRON_ENV,
    SERVER_MARK_ENV,
    GroupWatch,
    find_vllm_mains,
    send_signal,
)
from kvpilot.collectors.kvpool.listen_address import PORT_ENV as KVPOOL_PORT_ENV
from kvpilot.collectors.procfs import (
    ProcRef,
    is_alive,
    list_processes,
    read_environ,
    start_wall_s,
)
from kvpilot.collectors.safe_files import open_no_follow
from kvpilot.collectors.secrets import mask_argv
from kvpilot.collectors.vllm_argv import ServerArgs, parse_server_argv

LOG_TAIL_CHARS = 4000
EARLIER_MARKS_KEPT = 32  # starts remembered per instance, for naming leftovers

_LOG_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_APPEND


@dataclass(frozen=True, slots=True)
class LocalInstanceSpec:
    """One server kvpilot runs: its argv (never through a shell), env and plugin port."""

    name: str
    argv: tuple[str, ...]
    role: Role = "stable"
    env: tuple[tuple[str, str], ...] = ()  # added to the agent's own environment
    kvpool_port: int | None = None  # set as KVPILOT_KVPOOL_PORT in the child
    cpus: tuple[int, ...] = ()  # CPU affinity of the server and its children; empty: any


@dataclass(slots=True)
class _Slot:
    """The runtime's mutable record of one instance."""

    spec: LocalInstanceSpec
    args: ServerArgs
    log_path: Path
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    process: subprocess.Popen[bytes] | None = None
    starts_total: int = 0
    started_at_wall_s: float | None = None
    exited_at_wall_s: float | None = None
    stopped_by_runtime: bool = False
    # A server an earlier kvpilot started (its own session, so it outlived that agent),
    # taken over at start-up instead of started twice on one port.
    adopted: ProcRef | None = None
    # The mark in the environment of the server last started (or adopted), and of everything
    # it started; None for a server an older kvpilot started without one.
    mark: str | None = None
    # The marks of earlier starts, newest last: a process that still carries one is a
    # leftover of this server (an engine that outlived its API server), not a stranger.
    earlier_marks: tuple[str, ...] = ()


class LocalRuntime:
    """Starts, stops and restarts vLLM servers as child process groups of the agent."""

    kind: RuntimeKind = "local"
    can_change_flags = True

    def __init__(
        self,
        specs: Iterable[LocalInstanceSpec],
        log_dir: Path,
        *,
        base_env: Mapping[str, str] | None = None,
        wall_clock: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log_dir = log_dir
        self._base_env = base_env
        self._wall_clock = wall_clock
        self._clock = clock
        self._slots: dict[str, _Slot] = {}
        for spec in specs:
            if spec.name in self._slots:
                raise ValueError(f"duplicate instance name {spec.name!r}")
            self._slots[spec.name] = _Slot(
                spec=spec, args=parse_server_argv(spec.argv), log_path=log_dir / f"{spec.name}.log"
            )

    # -- reading -----------------------------------------------------------------------

    def _slot(self, name: str) -> _Slot:
        try:
            return self._slots[name]
        except KeyError:
            raise UnknownInstance(f"no local instance named {name!r}") from None

    def server_marks(self, name: str) -> frozenset[str]:
        """The marks of this instance's starts, the current one and the earlier ones (none
        for a name this runtime does not hold)."""
        slot = self._slots.get(name)
        if slot is None:
            return frozenset()
        current = () if slot.mark is None else (slot.mark,)
        return frozenset((*slot.earlier_marks, *current))

    def log_path(self, name: str) -> Path:
        return self._slot(name).log_path

    def log_tail(self, name: str, max_chars: int = LOG_TAIL_CHARS) -> str | None:
        try:
            with self._slot(name).log_path.open("rb") as log:
                log.seek(0, os.SEEK_END)
                log.seek(max(0, log.tell() - max_chars))
                return log.read().decode(errors="replace")
        except FileNotFoundError:
            return None

    def _poll(self, slot: _Slot) -> int | None:
        """The exit code once the main process has exited (it is reaped here)."""
        if slot.process is None:
            return None
        code = slot.process.poll()
        if code is not None and slot.exited_at_wall_s is None:
            slot.exited_at_wall_s = self._wall_clock()  # first observed, not exact
        return code

    def _main_pid(self, slot: _Slot) -> int | None:
        """The running server's main PID: our child, or an adopted one still alive."""
        if slot.process is not None:
            return slot.process.pid if self._poll(slot) is None else None
        if slot.adopted is not None and is_alive(slot.adopted):
            return slot.adopted.pid
        return None

    def _watch(self, slot: _Slot) -> GroupWatch | None:
        """The server's processes: its group (whose id is ours while our child is not reaped,
        an adopted leader's while it lives) and whatever carries its mark."""
        process, adopted = slot.process, slot.adopted
        if process is not None:
            return GroupWatch(process.pid, lambda: process.returncode is None, mark=slot.mark)
        if adopted is not None:  # it leads its own group
            return GroupWatch(adopted.pid, lambda: is_alive(adopted), mark=slot.mark)
        return None

    def _group(self, slot: _Slot) -> list[int]:
        watch = self._watch(slot)
        return [] if watch is None else watch.live_pids()

    def adopt_orphans(self) -> list[str]:
        """Take over servers an earlier kvpilot left running (it was killed, they were not).

        A server is adopted when a vLLM main process with exactly this instance's argv
        leads its own process group (as `_spawn` starts them). Returns the adopted names.
        """
        procs = list_processes()
        adopted = []
        for slot in self._slots.values():
            if slot.process is not None or slot.adopted is not None:
                continue
            for info in find_vllm_mains(procs, port=slot.args.port):
                if info.argv == tuple(slot.spec.argv) and info.pgid == info.pid:
                    slot.adopted = info.ref
                    slot.mark = (read_environ(info.pid) or {}).get(SERVER_MARK_ENV)
                    slot.started_at_wall_s = start_wall_s(info)
                    adopted.append(slot.spec.name)
                    break
        return adopted

    def _instance(self, slot: _Slot) -> Instance:
        main_pid = self._main_pid(slot)
        spec = slot.spec
        return Instance(
            name=spec.name,
            role=spec.role,
            url=slot.args.url,
            kvpool_url=None if spec.kvpool_port is None else f"http://127.0.0.1:{spec.kvpool_port}",
            pids=frozenset(self._group(slot)),
            main_pid=main_pid,
            argv=spec.argv,
            started_at_wall_s=slot.started_at_wall_s,
        )

    def instances(self) -> tuple[Instance, ...]:
        return tuple(self._instance(slot) for slot in self._slots.values())

    def status(self, name: str) -> InstanceStatus:
        slot = self._slot(name)
        if slot.process is None and slot.adopted is not None:
            if is_alive(slot.adopted):
                return InstanceStatus(
                    name,
                    "running",
                    slot.adopted.pid,
                    slot.started_at_wall_s,
                    reason="adopted from an earlier kvpilot",
                )
            if slot.exited_at_wall_s is None:
                slot.exited_at_wall_s = self._wall_clock()
            # Not our child: its exit code cannot be read.
            return InstanceStatus(
                name,
                "exited",
                None,
                slot.exited_at_wall_s,
                reason="the adopted server exited",
            )
        if slot.process is None:
            return InstanceStatus(name, "missing", None, None, reason="not started")
        code = self._poll(slot)
        if code is None:
            return InstanceStatus(name, "running", slot.process.pid, slot.started_at_wall_s)
        return InstanceStatus(
            name,
            "exited",
            None,
            slot.exited_at_wall_s,
            exit_code=code,
            reason="stopped by the runtime" if slot.stopped_by_runtime else "exited by itself",
        )

    # -- acting ------------------------------------------------------------------------

    def _env(self, spec: LocalInstanceSpec, mark: str | None = None) -> dict[str, str]:
        env = dict(os.environ if self._base_env is None else self._base_env)
        env.update(dict(spec.env))
        env.pop(KVPOOL_PORT_ENV, None)  # never inherit another instance's port
        if spec.kvpool_port is not None:
            env[KVPOOL_PORT_ENV] = str(spec.kvpool_port)
        env.pop(SERVER_MARK_ENV, None)  # never another server's (the agent's own, if any)
        if mark is not None:
            env[SERVER_MARK_ENV] = mark
            env.setdefault(*KEEP_ENVIRON_ENV)
        return env

    def _api_key(self, slot: _Slot) -> str | None:
        # vLLM takes --api-key first, else VLLM_API_KEY from its environment.
        return slot.args.api_key or self._env(slot.spec).get("VLLM_API_KEY") or None

    def _spawn(self, slot: _Slot) -> None:
        spec = slot.spec
        self._log_dir.mkdir(parents=True, exist_ok=True)
        slot.starts_total += 1
        stamp = datetime.fromtimestamp(self._wall_clock(), UTC).isoformat(timespec="seconds")
        header = (
            f"\n{START_MARKER}{slot.starts_total} of {spec.name} at {stamp}: "
            f"{shlex.join(mask_argv(spec.argv))} =====\n"
        )
        if slot.mark is not None:
            slot.earlier_marks = (*slot.earlier_marks, slot.mark)[-EARLIER_MARKS_KEPT:]
        slot.mark = uuid.uuid4().hex
        env = self._env(spec, slot.mark)
        # Not through a link planted at the log's path (it would append to the link's target).
        with os.fdopen(open_no_follow(slot.log_path, _LOG_FLAGS), "ab") as log:
            log.write(header.encode())
            log.flush()
            try:
                slot.process = subprocess.Popen(  # an argv list, never a shell
                    list(spec.argv),
                    shell=False,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    close_fds=True,
                    start_new_session=True,  # its own group: a stop reaches engine and workers
                )
            except OSError as exc:  # the program is missing or not executable
                slot.process = None
                why = f"{spec.argv[0]}: {exc.strerror or exc}"
                log.write(f"kvpilot: cannot execute {why}\n".encode())
                raise StartFailed(
                    f"the vLLM server {spec.name!r} could not be started ({why})",
                    hint=not_found_hint(spec.argv[0], env.get("PATH")),
                    log_path=slot.log_path,
                ) from None
        if spec.cpus:
            # Set on the freshly exec'd interpreter, before it starts any thread or engine
            # process, so everything it spawns inherits it (no preexec_fn: unsafe in threads).
            try:
                os.sched_setaffinity(slot.process.pid, spec.cpus)
            except OSError as exc:
                slot.process.kill()  # our child, not yet reaped: its PID is still its own
                slot.process.wait()
                why = f"cannot pin {spec.name!r} to CPUs {list(spec.cpus)}: {exc}"
                raise RuntimeFailure(why) from exc
        slot.started_at_wall_s = self._wall_clock()
        slot.exited_at_wall_s = None
        slot.stopped_by_runtime = False

    async def _wait_ready(self, slot: _Slot, ready_timeout_s: float) -> Instance:
        process = slot.process
        assert process is not None

        def exited() -> str | None:
            code = self._poll(slot) if slot.process is process else process.poll()
            return None if code is None else f"exit code {code}"

        try:
            await wait_ready(
                slot.args.url,
                api_key=self._api_key(slot),
                timeout_s=ready_timeout_s,
                exited=exited,
                log_tail=lambda: self.log_tail(slot.spec.name),
                clock=self._clock,
            )
        except StartFailed as exc:
            why = exited() or "exited"
            argv, path = slot.spec.argv, self._env(slot.spec).get("PATH")
            raise StartFailed(
                f"the vLLM server {slot.spec.name!r} exited before it was ready ({why})",
                exc.log_tail,
                hint=no_vllm_hint(argv, path, exc.log_tail),
                log_path=slot.log_path,
            ) from None
        return self._instance(slot)

    async def _stop(self, slot: _Slot, drain_timeout_s: float) -> StopResult:
        process, adopted = slot.process, slot.adopted
        if process is None and adopted is None:
            return StopResult(slot.spec.name, False, False, None, (), 0.0)

        def main_exited() -> bool:
            if process is not None:
                return self._poll(slot) is not None
            return not is_alive(adopted)  # type: ignore[arg-type]  # set when process is None

        def terminate() -> None:
            # The API server drains, then stops. Our child cannot be mistaken for another
            # process until it is reaped (Popen checks); an adopted one is signalled by identity.
            if process is not None:
                process.send_signal(signal.SIGTERM)
            elif adopted is not None:
                send_signal(adopted, signal.SIGTERM)

        # The group id is ours while our child is not reaped (an adopted leader: while it
        # lives); after that only the members seen meanwhile, their children, and whatever
        # carries the server's mark (an engine orphaned before we looked) are killed.
        group = self._watch(slot)
        assert group is not None  # process or adopted is set

        slot.stopped_by_runtime = True
        outcome = await drain_then_kill(
            terminate=terminate,
            main_exited=main_exited,
            survivors=group.live_pids,
            kill=group.kill,
            drain_timeout_s=drain_timeout_s,
            what=f"vLLM instance {slot.spec.name!r}",
            clock=self._clock,
        )
        slot.adopted = None
        return StopResult(
            name=slot.spec.name,
            was_running=outcome.was_running,
            drained=outcome.drained,
            exit_code=self._poll(slot),
            killed_pids=outcome.killed_pids,
            elapsed_s=outcome.elapsed_s,
        )

    async def start(self, name: str, *, ready_timeout_s: float = 240.0) -> Instance:
        """Start a stopped or exited instance; raises if it is already running."""
        slot = self._slot(name)
        async with slot.lock:
            if slot.process is None and slot.adopted is not None and is_alive(slot.adopted):
                return self._instance(slot)  # adopted at start-up: already serving
            if slot.process is not None and self._poll(slot) is None:
                raise RuntimeFailure(f"instance {name!r} is already running")
            # Leftovers of an earlier run (workers of a killed server) go first.
            await self._stop(slot, drain_timeout_s=0.0)
            self._spawn(slot)
            return await self._wait_ready(slot, ready_timeout_s)

    async def stop(self, name: str, *, drain_timeout_s: float) -> StopResult:
        slot = self._slot(name)
        async with slot.lock:
            return await self._stop(slot, drain_timeout_s)

    async def restart(
        self,
        name: str,
        *,
        drain_timeout_s: float,
        ready_timeout_s: float,
        argv: Sequence[str] | None = None,
    ) -> Instance:
        """Drain and stop, start again (with `argv` from now on if given), wait until ready."""
        slot = self._slot(name)
        # A bad new argv is refused before the running server is touched.
        new_args = None if argv is None else parse_server_argv(argv)
        async with slot.lock:
            await self._stop(slot, drain_timeout_s)
            if argv is not None and new_args is not None:
                slot.spec = replace(slot.spec, argv=tuple(argv))
                slot.args = new_args
            self._spawn(slot)
            return await self._wait_ready(slot, ready_timeout_s)

    async def aclose(self, *, drain_timeout_s: float = 30.0) -> None:
        """Stop every instance this runtime started (the agent is shutting down)."""
        for slot in self._slots.values():
            async with slot.lock:
                await self._stop(slot, drain_timeout_s)
