"""A memo bounded in bytes, not entries: a server whose label values change on every scrape,
or run to megabytes, costs at most the budget.

When an insert would pass the budget the whole memo is emptied (a generation ends): a hit stays
one ``dict.get``, and the series a server exports steadily are parsed again once. An entry too
large for its share of the budget (a 256th) is never kept. Thread-safe: reads are single dict
operations; inserts take a lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")

ENTRY_OVERHEAD_BYTES = 200  # a dict slot, the key's and the value's object headers


class ByteBudgetMemo(Generic[K, V]):
    """``compute(key)`` remembered while the kept entries cost at most ``budget_bytes``."""

    __slots__ = ("_compute", "_cost", "_entries", "_lock", "_spent", "budget_bytes", "largest")

    def __init__(
        self, compute: Callable[[K], V], cost: Callable[[K], int], *, budget_bytes: int
    ) -> None:
        self._compute = compute
        self._cost = cost
        self._entries: dict[K, V] = {}
        self._lock = threading.Lock()
        self._spent = 0
        self.budget_bytes = budget_bytes
        # One entry's most (a 32 KiB head in an 8 MiB memo): a vLLM series head is under 2 KiB,
        # so what is larger is parsed each time rather than crowding out the steady heads.
        self.largest = budget_bytes // 256

    def __call__(self, key: K) -> V:
        try:
            return self._entries[key]
        except KeyError:
            pass
        value = self._compute(key)  # may raise: nothing is kept then
        cost = self._cost(key) + ENTRY_OVERHEAD_BYTES
        if cost <= self.largest:
            with self._lock:
                if self._spent + cost > self.budget_bytes:
                    self._entries = {}
                    self._spent = 0
                self._entries[key] = value
                self._spent += cost
        return value

    @property
    def spent_bytes(self) -> int:
        """What the kept entries are reckoned to cost."""
        return self._spent

    def clear(self) -> None:
        with self._lock:
            self._entries = {}
            self._spent = 0
