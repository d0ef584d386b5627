"""A runtime's reads, from the event loop: in a worker thread where they block on the network.

The Kubernetes runtime reads the API server synchronously (the official client); called on
the event loop, an API server that accepts a connection and never answers would stop ticks,
`/healthz`, delivery and SIGTERM handling. Its calls carry a deadline (`kubernetes.api.call`), and
run here in a daemon thread of their own: the loop goes on while one waits, and a read still
waiting when the agent stops does not hold the process up (the default executor's threads
are joined at exit, which would add the read's deadline to the shutdown). Other runtimes
read /proc: cheap, and kept on the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


async def runtime_read(runtime: Any, read: Callable[..., T], *args: Any) -> T:
    """`read(*args)`, in a daemon thread when the runtime says its reads block."""
    if not getattr(runtime, "blocking_reads", False):
        return read(*args)
    return await in_daemon_thread(read, *args)


async def in_daemon_thread(read: Callable[..., T], *args: Any) -> T:
    """`read(*args)` in a daemon thread of its own, awaited (its context goes with it)."""
    loop = asyncio.get_running_loop()
    context = contextvars.copy_context()
    done: asyncio.Future[T] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if done.cancelled():
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)

    def work() -> None:
        try:
            result, error = context.run(read, *args), None
        except BaseException as exc:  # handed to the awaiting task, raised there
            result, error = None, exc
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=work, name="kvpilot-runtime-read", daemon=True).start()
    return await done
