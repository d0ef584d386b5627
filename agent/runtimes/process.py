"""Attach to a vLLM that something else supervises (systemd, a pod's kubelet): find, signal, wait.

The server is found by its command line in /proc (either launch form), optionally narrowed
by `--port`. A restart is a drain by SIGTERM; the supervisor brings a new process back and
the runtime waits for it to be healthy and answer a probe.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvpilot.agent.model import Instance, Role
from kvpilot.agent.runtimes.base import (
    InstanceStatus,
    NotReady,
    RuntimeUnsupported,
    StopResult,
    UnknownInstance,
)
from kvpilot.agent.runtimes.drain import drain_then_kill, wait_for
from kvpilot.agent.runtimes.probe import wait_ready
from kvpilot.agent.runtimes.procfs import (
    PROC,
    ProcInfo,
    ProcRef,
    descendants,
    find_vllm_mains,
    is_alive,
    list_processes,
    read_environ,
    signal_refs,
    start_wall_s,
)
from kvpilot.collectors.vllm_argv import parse_server_argv
from kvpilot.rig.server import KVPOOL_PORT_ENV


class SupervisorTimeout(NotReady):
    """The outside supervisor did not bring vLLM back within the deadline."""


@dataclass(frozen=True, slots=True)
class ProcessTarget:
    """How to recognise one supervised server, and what /proc cannot tell."""

    name: str
    role: Role = "stable"
    port: int | None = None  # narrows the match to the server started with this --port
    kvpool_url: str | None = None  # else from KVPILOT_KVPOOL_PORT in the server's environment
    api_key: str | None = None  # else --api-key, else VLLM_API_KEY in its environment


@dataclass(frozen=True, slots=True)
class _Found:
    main: ProcInfo | None
    tree: tuple[ProcInfo, ...]  # main and its live descendants
    reason: str | None  # why main is None


class ProcessRuntime:
    """Reports, stops and restarts vLLM servers that another supervisor owns."""

    kind = "process"

    def __init__(
        self,
        targets: Iterable[ProcessTarget],
        *,
        proc_root: Path = PROC,
        wall_clock: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._targets: dict[str, ProcessTarget] = {}
        for target in targets:
            if target.name in self._targets:
                raise ValueError(f"duplicate instance name {target.name!r}")
            self._targets[target.name] = target
        self._proc_root = proc_root
        self._wall_clock = wall_clock
        self._clock = clock
        self._absent_since: dict[str, float] = {}

    def _target(self, name: str) -> ProcessTarget:
        try:
            return self._targets[name]
        except KeyError:
            raise UnknownInstance(f"no attached instance named {name!r}") from None

    def _find(self, target: ProcessTarget) -> _Found:
        procs = list_processes(self._proc_root)
        mains = find_vllm_mains(procs, port=target.port)
        where = "" if target.port is None else f" with --port {target.port}"
        if not mains:
            return _Found(None, (), f"no vLLM server process{where} found in /proc")
        if len(mains) > 1:
            pids = [info.pid for info in mains]
            return _Found(None, (), f"{len(mains)} vLLM servers{where} match (PIDs {pids})")
        main = mains[0]
        return _Found(main, (main, *descendants(main.pid, procs)), None)

    def _kvpool_url(self, target: ProcessTarget, main: ProcInfo) -> str | None:
        if target.kvpool_url is not None:
            return target.kvpool_url
        port = (read_environ(main.pid, self._proc_root) or {}).get(KVPOOL_PORT_ENV)
        return f"http://127.0.0.1:{port}" if port else None

    def _api_key(self, target: ProcessTarget, main: ProcInfo) -> str | None:
        if target.api_key is not None:
            return target.api_key
        args = parse_server_argv(main.argv)
        return args.api_key or (read_environ(main.pid, self._proc_root) or {}).get("VLLM_API_KEY")

    def _instance(self, target: ProcessTarget, found: _Found) -> Instance:
        main = found.main
        if main is None:
            url = f"http://127.0.0.1:{target.port}" if target.port is not None else ""
            return Instance(target.name, target.role, url, target.kvpool_url, frozenset(),
                            None, None, None)  # fmt: skip
        return Instance(
            name=target.name,
            role=target.role,
            url=parse_server_argv(main.argv).url,
            kvpool_url=self._kvpool_url(target, main),
            pids=frozenset(info.pid for info in found.tree),
            main_pid=main.pid,
            argv=main.argv,
            started_at_wall_s=start_wall_s(main, self._proc_root),
        )

    def instances(self) -> tuple[Instance, ...]:
        return tuple(self._instance(t, self._find(t)) for t in self._targets.values())

    def status(self, name: str) -> InstanceStatus:
        target = self._target(name)
        found = self._find(target)
        if found.main is not None:
            self._absent_since.pop(name, None)
            since = start_wall_s(found.main, self._proc_root)
            return InstanceStatus(name, "running", found.main.pid, since)
        if name not in self._absent_since:
            self._absent_since[name] = self._wall_clock()  # first observed, not exact
        since = self._absent_since[name]
        state = "missing" if found.reason and found.reason.startswith("no ") else "unknown"
        return InstanceStatus(name, state, None, since, reason=found.reason)

    async def start(self, name: str, *, ready_timeout_s: float = 240.0) -> Instance:
        self._target(name)
        raise RuntimeUnsupported(
            f"the process runtime cannot start {name!r}: its supervisor (systemd, the "
            "kubelet) starts vLLM; use restart, or the local runtime"
        )

    async def _stop(self, name: str, found: _Found, drain_timeout_s: float) -> StopResult:
        main = found.main
        if main is None:
            return StopResult(name, False, False, None, (), 0.0)
        tracked: set[ProcRef] = {info.ref for info in found.tree}

        def survivors() -> list[int]:
            if is_alive(main.ref, self._proc_root):  # children it started meanwhile count too
                procs = list_processes(self._proc_root)
                tracked.update(info.ref for info in descendants(main.pid, procs))
            return sorted(r.pid for r in tracked if is_alive(r, self._proc_root))

        outcome = await drain_then_kill(
            terminate=lambda: signal_refs([main.ref], signal.SIGTERM, self._proc_root),
            main_exited=lambda: not is_alive(main.ref, self._proc_root),
            survivors=survivors,
            kill=lambda: signal_refs(list(tracked), signal.SIGKILL, self._proc_root),
            drain_timeout_s=drain_timeout_s,
            what=f"vLLM instance {name!r} (PID {main.pid})",
            clock=self._clock,
        )
        return StopResult(name, outcome.was_running, outcome.drained, None,
                          outcome.killed_pids, outcome.elapsed_s)  # fmt: skip

    async def stop(self, name: str, *, drain_timeout_s: float) -> StopResult:
        """Drain and stop the server's processes; its supervisor may well start it again."""
        target = self._target(name)
        return await self._stop(name, self._find(target), drain_timeout_s)

    async def restart(
        self,
        name: str,
        *,
        drain_timeout_s: float,
        ready_timeout_s: float,
        argv: Sequence[str] | None = None,
    ) -> Instance:
        """SIGTERM (drain), then wait for the supervisor's new process to be ready."""
        target = self._target(name)
        if argv is not None:
            raise RuntimeUnsupported(
                f"the process runtime cannot change {name!r}'s command line: its supervisor "
                "owns it (change the unit or the pod spec)"
            )
        old = self._find(target)
        await self._stop(name, old, drain_timeout_s)
        old_ref = None if old.main is None else old.main.ref
        started = self._clock()
        latest: list[_Found] = []

        def back() -> bool:
            found = self._find(target)
            latest[:] = [found]
            return found.main is not None and found.main.ref != old_ref

        if not await wait_for(back, ready_timeout_s, clock=self._clock):
            why = latest[0].reason if latest and latest[0].reason else "the old process only"
            raise SupervisorTimeout(
                f"the supervisor did not bring vLLM {name!r} back within "
                f"{ready_timeout_s:.0f} s ({why})"
            )
        new = latest[0]
        assert new.main is not None
        new_ref = new.main.ref
        await wait_ready(
            parse_server_argv(new.main.argv).url,
            api_key=self._api_key(target, new.main),
            timeout_s=max(0.0, ready_timeout_s - (self._clock() - started)),
            exited=lambda: (
                None
                if is_alive(new_ref, self._proc_root)
                else (f"PID {new_ref.pid} exited (the supervisor may be restarting it in a loop)")
            ),
            clock=self._clock,
        )
        return self._instance(target, self._find(target))

    async def aclose(self, *, drain_timeout_s: float = 30.0) -> None:
        """Nothing to release: the supervisor owns the servers, and they keep running."""
