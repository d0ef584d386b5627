"""The memory ledger: where one device's (or, on CPU, one process's) memory went.

Parts are disjoint shares of the used memory, each naming the source it was read from;
`unattributed` is the used memory minus the parts (live activations, other processes on a
shared device, anything no source names), so the parts and it add up to the used memory.
"""

from __future__ import annotations

from dataclasses import dataclass

# Part names, one vocabulary for the plugin, the agent and the dashboard.
WEIGHTS = "weights"
CUDA_GRAPHS = "cuda_graphs"
CUDA_CONTEXT = "cuda_context"
KV_CACHE = "kv_cache"
ALLOCATOR_SLACK = "allocator_slack"
UNATTRIBUTED = "unattributed"
UNATTRIBUTED_SOURCE = "used minus the attributed parts"


@dataclass(frozen=True, slots=True)
class LedgerPart:
    """One attributed share of the used memory and where its figure comes from."""

    name: str
    size_bytes: int
    source: str


@dataclass(frozen=True, slots=True)
class MemoryLedger:
    """One device's ledger at one instant; `device` is `cpu` or the CUDA index as text."""

    device: str
    rank: str
    used_bytes: int | None
    used_source: str
    parts: tuple[LedgerPart, ...]
    kv_used_bytes: int | None = None  # blocks held by requests, a share of the kv_cache part
    kv_block_bytes: int | None = None
    budget_bytes: int | None = None  # the budget vLLM computed at start-up
    budget_source: str = ""
    total_bytes: int | None = None  # the device's capacity (GPU)
    unallocated_bytes: int | None = None  # free on the device, held by no one (GPU)

    def part(self, name: str) -> LedgerPart | None:
        return next((part for part in self.parts if part.name == name), None)

    @property
    def attributed_bytes(self) -> int:
        return sum(part.size_bytes for part in self.parts)

    @property
    def unattributed_bytes(self) -> int | None:
        """Used minus the parts; negative when a part counts memory not yet resident."""
        return None if self.used_bytes is None else self.used_bytes - self.attributed_bytes

    @property
    def drift_bytes(self) -> int | None:
        """Used beyond the budget vLLM computed (negative: under it)."""
        if self.used_bytes is None or self.budget_bytes is None:
            return None
        return self.used_bytes - self.budget_bytes

    @property
    def headroom_bytes(self) -> int | None:
        """What the budget leaves of the device: the margin before out-of-memory."""
        if self.total_bytes is None or self.budget_bytes is None:
            return None
        return self.total_bytes - self.budget_bytes

    @property
    def slack_bytes(self) -> int | None:
        slack = self.part(ALLOCATOR_SLACK)
        return None if slack is None else slack.size_bytes
