"""Attach to a vLLM that something else supervises (systemd, a pod's kubelet): find, signal, wait.

A process is a target's server when all of these hold:

* its command line is a vLLM server launch form (`vllm serve ...`, `python -m
  vllm.entrypoints.openai.api_server ...`) and its parent's is not (forked children keep
  their parent's command line for a while);
* `port` set: its `--port` (8000 when absent) is `port`;
* `host` set: it listens there: its `--host` is absent, empty, `0.0.0.0` or `::` (every
  address, vLLM's default), or equals `host` as text, case and IPv6 brackets aside (names are
  not resolved: `localhost` is not `127.0.0.1`);
* `cmdline_regex` set: the expression is found (`re.search`) in its arguments joined by
  single spaces.

A process that matches is trusted only when it runs as the expected uid (the agent's own
unless configured) and, with `host` unset, its `--host` is this machine's (process_trust).
When no trusted process matches but exactly one of another uid does, the server is there and
is reported running (its /proc stat, status and command line are readable, so a healthy
server is never "missing"); it is never signalled, and a stop or restart says why.

Exactly one process must match; none or several, and nothing is signalled. Right before each
signal the process is read again from /proc: it must still be the same process (PID and start
time) and the main process must still match. The signal goes through a pidfd opened before
that check, so a PID reused in between never receives it.

A restart is a drain by SIGTERM; the supervisor brings a new process back and the runtime
waits for it to be healthy and answer a probe.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvpilot.agent.model import Instance, Role
from kvpilot.agent.runtimes.base import (
    InstanceState,
    InstanceStatus,
    NotReady,
    RuntimeFailure,
    RuntimeKind,
    RuntimeUnsupported,
    StopResult,
    UnknownInstance,
)
from kvpilot.agent.runtimes.drain import drain_then_kill, wait_for
from kvpilot.agent.runtimes.probe import wait_ready
from kvpilot.agent.runtimes.process_trust import expected_uid, own_listen_host, uid_problem
from kvpilot.agent.runtimes.processes import find_vllm_mains, send_signal
from kvpilot.collectors.addresses import WILDCARD_HOSTS
from kvpilot.collectors.kvpool.listen_address import PORT_ENV as KVPOOL_PORT_ENV
from kvpilot.collectors.procfs import (
    PROC,
    ProcInfo,
    ProcRef,
    descendants,
    is_alive,
    list_processes,
    read_environ,
    read_proc,
    read_uids,
    start_wall_s,
)
from kvpilot.collectors.vllm_argv import NotAVllmServer, ServerArgs, parse_server_argv


class SupervisorTimeout(NotReady):
    """The outside supervisor did not bring vLLM back within the deadline."""


class IdentityChanged(RuntimeFailure):
    """The process found is still alive but no longer the target's server: not signalled."""


class NotPermitted(RuntimeFailure):
    """The server is there, but kvpilot may not (or cannot) signal it: another uid's."""


@dataclass(frozen=True, slots=True)
class ProcessTarget:
    """How to recognise one supervised server, and what /proc cannot tell."""

    name: str
    role: Role = "stable"
    port: int | None = None  # narrows the match to the server started with this --port
    host: str | None = None  # narrows to a server listening there; also where it is reached
    cmdline_regex: str | None = None  # narrows to a command line (arguments joined by spaces)
    kvpool_url: str | None = None  # else from KVPILOT_KVPOOL_PORT in the server's environment
    api_key: str | None = None  # else --api-key, else VLLM_API_KEY in its environment
    expected_uid: int | None = None  # the uid the server runs as; None: the agent's own


def _bare_host(host: str) -> str:
    return host.removeprefix("[").removesuffix("]").lower()


def _http_url(host: str, port: int) -> str:
    bare = host.removeprefix("[").removesuffix("]")
    return f"http://[{bare}]:{port}" if ":" in bare else f"http://{bare}:{port}"


def listens_at(server_host: str | None, host: str) -> bool:
    """Whether a server started with `--host server_host` (None: absent) is reachable at `host`."""
    if server_host is None or _bare_host(server_host) in WILDCARD_HOSTS:
        return True  # vLLM listens on every address
    return _bare_host(server_host) == _bare_host(host)


@dataclass(frozen=True, slots=True)
class _Found:
    main: ProcInfo | None
    tree: tuple[ProcInfo, ...]  # main and its live descendants
    reason: str | None  # why main is None
    untrusted: str | None = None  # why main is watched but never signalled (another uid's)


class ProcessRuntime:
    """Reports, stops and restarts vLLM servers that another supervisor owns."""

    kind: RuntimeKind = "process"
    can_change_flags = False  # it signals a server it did not start

    def __init__(
        self,
        targets: Iterable[ProcessTarget],
        *,
        proc_root: Path = PROC,
        wall_clock: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._targets: dict[str, ProcessTarget] = {}
        self._patterns: dict[str, re.Pattern[str]] = {}
        for target in targets:
            if target.name in self._targets:
                raise ValueError(f"duplicate instance name {target.name!r}")
            self._targets[target.name] = target
            if target.cmdline_regex is not None:
                self._patterns[target.name] = re.compile(target.cmdline_regex)
        self._proc_root = proc_root
        self._wall_clock = wall_clock
        self._clock = clock
        self._absent_since: dict[str, float] = {}

    def _target(self, name: str) -> ProcessTarget:
        try:
            return self._targets[name]
        except KeyError:
            raise UnknownInstance(f"no attached instance named {name!r}") from None

    def _matches(self, target: ProcessTarget, info: ProcInfo) -> bool:
        """Whether `info` is `target`'s server: by its command line, and trusted."""
        return self._looks_like(target, info) and self._distrust(target, info) is None

    def _looks_like(self, target: ProcessTarget, info: ProcInfo) -> bool:
        """Whether `info`'s command line is `target`'s server (the module's rules)."""
        try:
            args = parse_server_argv(info.argv)
        except NotAVllmServer:
            return False
        if target.port is not None and args.port != target.port:
            return False
        if target.host is not None and not listens_at(args.host, target.host):
            return False
        pattern = self._patterns.get(target.name)
        return pattern is None or pattern.search(" ".join(info.argv)) is not None

    def _distrust(self, target: ProcessTarget, info: ProcInfo) -> str | None:
        """Why a process that looks like the server is not trusted as it (process_trust)."""
        problem = uid_problem(info.pid, expected_uid(target.expected_uid), self._proc_root)
        return problem or self._elsewhere(target, info)

    def _elsewhere(self, target: ProcessTarget, info: ProcInfo) -> str | None:
        """Why the agent may not reach a server there: its --host is another machine's."""
        host = parse_server_argv(info.argv).host
        if target.host is None and own_listen_host(host) is None:
            return (
                f"PID {info.pid} says --host {host}, which is not this machine's: set the "
                "runtime's host to reach it there"
            )
        return None

    def _criteria(self, target: ProcessTarget) -> str:
        said = [f"--port {target.port}"] if target.port is not None else []
        said += [f"listening at {target.host}"] if target.host is not None else []
        if target.cmdline_regex is not None:
            said.append(f"a command line matching {target.cmdline_regex!r}")
        return f" with {', '.join(said)}" if said else ""

    def _find(self, target: ProcessTarget) -> _Found:
        procs = list_processes(self._proc_root)
        alike = [info for info in find_vllm_mains(procs) if self._looks_like(target, info)]
        distrust = {info.pid: self._distrust(target, info) for info in alike}
        mains = [info for info in alike if distrust[info.pid] is None]
        where = self._criteria(target)
        if not mains:
            # Another user's server on this machine is there: watched, never signalled.
            present = [info for info in alike if self._elsewhere(target, info) is None]
            if len(present) == 1:
                main = present[0]
                tree = (main, *descendants(main.pid, procs))
                return _Found(main, tree, None, untrusted=distrust[main.pid])
            why = "; ".join(d for d in distrust.values() if d)
            untrusted = f" (not trusted: {why})" if why else ""
            return _Found(None, (), f"no vLLM server process{where} found in /proc{untrusted}")
        if len(mains) > 1:
            pids = [info.pid for info in mains]
            return _Found(None, (), f"{len(mains)} vLLM servers{where} match (PIDs {pids})")
        main = mains[0]
        return _Found(main, (main, *descendants(main.pid, procs)), None)

    def _kvpool_url(self, target: ProcessTarget, found: _Found, main: ProcInfo) -> str | None:
        if target.kvpool_url is not None or found.untrusted is not None:
            return target.kvpool_url  # not a port another user's environment chose
        port = (read_environ(main.pid, self._proc_root) or {}).get(KVPOOL_PORT_ENV)
        return f"http://127.0.0.1:{port}" if port else None

    def _api_key(self, target: ProcessTarget, main: ProcInfo) -> str | None:
        if target.api_key is not None:
            return target.api_key
        args = parse_server_argv(main.argv)
        return args.api_key or (read_environ(main.pid, self._proc_root) or {}).get("VLLM_API_KEY")

    def _url(self, target: ProcessTarget, args: ServerArgs) -> str:
        """Where the agent reaches the server: `host` when set, else where it listens on
        this machine (a matched process has one: `_distrust`)."""
        host = target.host or own_listen_host(args.host) or "127.0.0.1"
        return _http_url(host, args.port)

    def _instance(self, target: ProcessTarget, found: _Found) -> Instance:
        main = found.main
        if main is None:
            host = target.host or "127.0.0.1"
            url = _http_url(host, target.port) if target.port is not None else ""
            return Instance(
                target.name, target.role, url, target.kvpool_url, frozenset(), None, None, None
            )
        return Instance(
            name=target.name,
            role=target.role,
            url=self._url(target, parse_server_argv(main.argv)),
            kvpool_url=self._kvpool_url(target, found, main),
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
            return InstanceStatus(name, "running", found.main.pid, since, reason=found.untrusted)
        if name not in self._absent_since:
            self._absent_since[name] = self._wall_clock()  # first observed, not exact
        since = self._absent_since[name]
        state: InstanceState = (
            "missing" if found.reason and found.reason.startswith("no ") else "unknown"
        )
        return InstanceStatus(name, state, None, since, reason=found.reason)

    async def start(self, name: str, *, ready_timeout_s: float = 240.0) -> Instance:
        self._target(name)
        raise RuntimeUnsupported(
            f"the process runtime cannot start {name!r}: its supervisor (systemd, the "
            "kubelet) starts vLLM; use restart, or the local runtime"
        )

    def _is_still(self, ref: ProcRef, target: ProcessTarget | None) -> bool:
        """Whether `ref` still names that live process and, with `target`, still its server."""
        info = read_proc(ref.pid, self._proc_root)
        if info is None or info.ref != ref or not info.alive:
            return False
        return target is None or self._matches(target, info)

    def _send(self, ref: ProcRef, sig: signal.Signals, target: ProcessTarget | None) -> bool:
        """Send `sig` if `_is_still(ref, target)` holds right now; returns whether it was sent."""
        try:
            return send_signal(ref, sig, self._proc_root, still=lambda r: self._is_still(r, target))
        except PermissionError:
            uids = read_uids(ref.pid, self._proc_root)
            owner = f"uid {uids[0]}" if uids is not None else "another user"
            raise NotPermitted(
                f"cannot signal PID {ref.pid}: operation not permitted (EPERM): it runs as "
                f"{owner} and kvpilot as uid {os.geteuid()}; run kvpilot as that user (or with "
                "CAP_KILL) to let it stop or restart the server"
            ) from None

    def _changed(self, target: ProcessTarget, pid: int) -> IdentityChanged:
        return IdentityChanged(
            f"PID {pid} no longer matches vLLM instance {target.name!r}{self._criteria(target)} "
            "(its command line changed): not signalled"
        )

    async def _stop(
        self, target: ProcessTarget, found: _Found, drain_timeout_s: float
    ) -> StopResult:
        name = target.name
        main = found.main
        if main is None:
            return StopResult(name, False, False, None, (), 0.0)
        if found.untrusted is not None:
            raise NotPermitted(
                f"vLLM instance {name!r} (PID {main.pid}) is not signalled: {found.untrusted}; "
                "set the runtime's expected_uid to that uid to let kvpilot stop or restart it"
            )
        if is_alive(main.ref, self._proc_root) and not self._is_still(main.ref, target):
            raise self._changed(target, main.pid)  # nor are the processes it started ours now
        children: set[ProcRef] = {info.ref for info in found.tree if info.ref != main.ref}

        def main_gone() -> bool:
            return not self._is_still(main.ref, target)

        def terminate() -> None:
            sent = self._send(main.ref, signal.SIGTERM, target)
            if not sent and is_alive(main.ref, self._proc_root):
                raise self._changed(target, main.pid)

        def survivors() -> list[int]:
            if is_alive(main.ref, self._proc_root):  # children it started meanwhile count too
                procs = list_processes(self._proc_root)
                children.update(info.ref for info in descendants(main.pid, procs))
            alive = [r.pid for r in children if is_alive(r, self._proc_root)]
            return sorted(alive if main_gone() else [main.pid, *alive])

        def kill() -> list[int]:
            sent = [main.pid] if self._send(main.ref, signal.SIGKILL, target) else []
            # The others were found in the server's tree: their start time tells them apart.
            sent += [r.pid for r in children if self._send(r, signal.SIGKILL, None)]
            return sent

        outcome = await drain_then_kill(
            terminate=terminate,
            main_exited=main_gone,
            survivors=survivors,
            kill=kill,
            drain_timeout_s=drain_timeout_s,
            what=f"vLLM instance {name!r} (PID {main.pid})",
            clock=self._clock,
        )
        return StopResult(
            name, outcome.was_running, outcome.drained, None, outcome.killed_pids, outcome.elapsed_s
        )

    async def stop(self, name: str, *, drain_timeout_s: float) -> StopResult:
        """Drain and stop the server's processes; its supervisor may well start it again."""
        target = self._target(name)
        return await self._stop(target, self._find(target), drain_timeout_s)

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
        await self._stop(target, old, drain_timeout_s)
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
            self._url(target, parse_server_argv(new.main.argv)),
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
