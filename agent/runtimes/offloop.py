"""A runtime's reads, from the event loop: in a worker thread where they block on the network.

The Kubernetes runtime reads the API server synchronously (the official client); called on
the event loop, an API server that accepts a connection and never answers would stop ticks,
`/healthz`, delivery and SIGTERM handling. Its calls carry a deadline (`k8s_api.call`), and
run here in a thread, so the loop goes on while one waits. Other runtimes read /proc: cheap,
and kept on the loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


async def runtime_read(runtime: Any, read: Callable[..., T], *args: Any) -> T:
    """`read(*args)`, in a worker thread when the runtime says its reads block."""
    if getattr(runtime, "blocking_reads", False):
        return await asyncio.to_thread(read, *args)
    return read(*args)
