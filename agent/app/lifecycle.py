"""The agent process: ticks on a schedule, serves /metrics and /healthz, stops on a signal.

The listen address is bound before anything starts, so a taken port is one clear error and
nothing claims to be listening. The ticks run on the monotonic clock (`TickLoop`); APScheduler
only runs the jobs the caller adds (the nightly tuning run). Shutdown is a path: SIGTERM and
SIGINT only set an event; no new tick starts, the running tick gets a bounded time to finish,
then the HTTP server closes. SIGHUP reloads the configuration where the caller can (else it
says so).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import signal
import socket
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass

import uvicorn
from apscheduler.schedulers.asyncio import AsyncIOScheduler
from starlette.applications import Starlette

from kvpilot.agent.app.listener_limits import listener_config
from kvpilot.agent.app.loop_watch import log_tick_start, watch_loop_if_asked
from kvpilot.agent.app.tick_loop import TickLoop
from kvpilot.agent.config.agent import DEFAULT_PORT
from kvpilot.agent.tick.overruns import TickOverruns

log = logging.getLogger(__name__)


NO_RELOAD = "reload is not supported; restart kvpilot to apply a new configuration"
SIGHUP_WHILE_STARTING = (
    "received SIGHUP while starting: the configuration read at the start stays; "
    "send SIGHUP again once kvpilot serves to reload"
)


class ListenError(Exception):
    """The listen address cannot be bound (taken, not this machine's, not allowed); `host`
    and `port` say which address, so that the caller can name the setting that holds it."""

    def __init__(self, message: str, host: str, port: int) -> None:
        super().__init__(message)
        self.host = host
        self.port = port


_BIND_ERRORS = {
    errno.EADDRINUSE: "address already in use (another process listens there)",
    errno.EADDRNOTAVAIL: "not an address of this machine",
    errno.EACCES: "permission denied (ports below 1024 need privileges)",
}


def bind_listener(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port, or ListenError with what to change."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ListenError(
            f"cannot listen on {host}:{port}: unknown host ({exc.strerror})", host, port
        ) from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        why = _BIND_ERRORS.get(exc.errno or 0, exc.strerror or str(exc))
        raise ListenError(f"cannot listen on {host}:{port}: {why}", host, port) from None
    return sock


@dataclass(frozen=True, slots=True)
class LoopSettings:
    listen_host: str = "127.0.0.1"
    listen_port: int = DEFAULT_PORT
    interval_s: float = 1.0
    shutdown_grace_s: float = 10.0


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: the agent owns SIGTERM, SIGINT and SIGHUP."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def main_loop(self) -> None:
        """uvicorn's housekeeping (the Date header, the exit flag) once a second instead of
        ten times: an idle agent should cost nothing. Shutdown is noticed within a second."""
        counter = 0
        while not await self.on_tick(counter):
            counter = (counter + 10) % 864000  # on_tick refreshes the Date header at % 10
            await asyncio.sleep(1.0)


async def serve_and_tick(
    tick: Callable[[], Awaitable[None]],
    app: Starlette,
    settings: LoopSettings,
    *,
    stop: asyncio.Event | None = None,
    add_jobs: Callable[[AsyncIOScheduler], None] | None = None,
    overruns: TickOverruns | None = None,
    sock: socket.socket | None = None,
    reload: Callable[[], Awaitable[object]] | None = None,
    control: tuple[Starlette, socket.socket] | None = None,
) -> None:
    """Run `tick` every interval and serve `app` until `stop` is set or SIGTERM/SIGINT.

    `sock` is the bound listen socket (bound here when not given: ListenError before anything
    starts). `add_jobs` may put more jobs on the same scheduler (the scheduled tuning run).
    `reload` runs on SIGHUP; without it SIGHUP is logged and otherwise ignored. `control` is
    the control API's own app and bound socket, served beside `app` when given."""
    sock = sock or bind_listener(settings.listen_host, settings.listen_port)
    stop = stop or asyncio.Event()
    own_signals(stop)
    loop = asyncio.get_running_loop()
    watching = watch_loop_if_asked(loop)  # off unless the environment asks (soaks)
    reloads = _Reloads(reload)
    with contextlib.suppress(NotImplementedError, RuntimeError):
        loop.add_signal_handler(signal.SIGHUP, reloads.on_sighup)
    listeners = [(app, sock), *([control] if control else [])]
    servers = [_Server(listener_config(each)) for each, _ in listeners]
    ticks = TickLoop(
        tick, settings.interval_s, overruns, on_start=log_tick_start if watching else None
    )
    scheduler = AsyncIOScheduler(event_loop=loop)
    if add_jobs is not None:
        add_jobs(scheduler)
    serving = [
        asyncio.create_task(server.serve(sockets=[bound]), name="the HTTP server")
        for server, (_, bound) in zip(servers, listeners, strict=True)
    ]
    ticking = asyncio.create_task(ticks.run(stop), name="the tick loop")
    scheduler.start()
    log.info(
        "kvpilot agent listening on %s, ticking every %.1f s",
        " and ".join(_address(bound) for _, bound in listeners),
        settings.interval_s,
    )
    try:
        stopped = asyncio.create_task(stop.wait())
        done, _ = await asyncio.wait(
            {stopped, ticking, *serving}, return_when=asyncio.FIRST_COMPLETED
        )
        stopped.cancel()
        for failed in done - {stopped}:
            if not stop.is_set():
                failed.result()  # the HTTP server or the tick loop failed: raise it
                raise RuntimeError(f"{failed.get_name()} stopped on its own")
    finally:
        log.info("stopping: no new ticks")
        ticking.cancel()
        scheduler.shutdown(wait=False)
        running = ticks.running
        if running is not None:
            log.info(
                "stopping: waiting up to %.0f s for the running tick", settings.shutdown_grace_s
            )
            _, pending = await asyncio.wait({running}, timeout=settings.shutdown_grace_s)
            for task in pending:
                log.warning("stopping: tick did not finish in time, cancelling it")
                task.cancel()
        await reloads.aclose()
        for server in servers:
            server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError, TimeoutError):
            await asyncio.wait_for(asyncio.gather(*serving), timeout=settings.shutdown_grace_s)
        for _, bound in listeners:
            bound.close()
        log.info("stopped")


def _address(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def own_signals(stop: asyncio.Event) -> None:
    """From now on SIGTERM and SIGINT set `stop`, and SIGHUP is answered, instead of the
    default action that kills the process. Called before anything is started or adopted: a
    signal during start-up then ends in the same clean shutdown (servers stopped, state saved)
    as one while serving. The loop takes SIGHUP over once it serves (a reload)."""
    loop = asyncio.get_running_loop()
    with contextlib.suppress(NotImplementedError, RuntimeError):
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, _on_signal, stop, sig)
        loop.add_signal_handler(signal.SIGHUP, log.warning, SIGHUP_WHILE_STARTING)


def _on_signal(stop: asyncio.Event, sig: signal.Signals) -> None:
    log.info("received %s, shutting down", sig.name)
    stop.set()


class _Reloads:
    """SIGHUP: one reload at a time, each in its own task; a failed reload is logged."""

    def __init__(self, reload: Callable[[], Awaitable[object]] | None) -> None:
        self._reload = reload
        self._task: asyncio.Task[None] | None = None

    def on_sighup(self) -> None:
        if self._reload is None:
            log.warning("received SIGHUP: %s", NO_RELOAD)
            return
        if self._task is not None and not self._task.done():
            log.warning("received SIGHUP: a reload is still running; this one is skipped")
            return
        log.info("received SIGHUP: reloading the configuration")
        self._task = asyncio.get_running_loop().create_task(self._run(self._reload))

    @staticmethod
    async def _run(reload: Callable[[], Awaitable[object]]) -> None:
        try:
            await reload()
        except Exception:  # a reload that fails keeps the running configuration
            log.exception("reload failed; still running the configuration loaded before")

    async def aclose(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
