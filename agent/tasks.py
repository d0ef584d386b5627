"""Background tasks with names, whose failures are logged and counted, never dropped."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Coroutine
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


class GuardedTasks:
    """Starts named tasks and keeps them until they end; a failure is one log line with its
    traceback and one count by task name (`kvpilot_background_task_failures_total`)."""

    def __init__(self) -> None:
        self.failures: Counter[str] = Counter()
        self._running: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, T], name: str) -> asyncio.Task[T]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self.watch(task)
        return task

    def watch(self, task: asyncio.Task[Any]) -> None:
        """Guard a task something else started (the remediator's restarts)."""
        self._running.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._running.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            self.failures[task.get_name()] += 1
            log.error("background task %s failed", task.get_name(), exc_info=exc)

    def running(self) -> tuple[asyncio.Task[Any], ...]:
        return tuple(self._running)
