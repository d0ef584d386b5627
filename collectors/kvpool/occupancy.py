"""Token occupancy of the KV pool: tokens held / (blocks in use x block size), per KV group.

Blocks count as used when only partly filled, so block usage overstates what the cache
holds: 33-token prompts in 32-token blocks use two blocks for 33 tokens (51.6 %). A block in
use is one a request holds (`ref_cnt > 0`); free blocks that keep a prefix hash are not used.
A block shared by several requests (a prefix hit) is counted once, with the most tokens any
holder wrote into it. Read on the engine thread at a step boundary, like `blocks.py`.

The block sizes the backend accepts travel with it, so the agent can name one: CPU
attention takes multiples of 32 (vLLM's CPU default is 128), most CUDA backends multiples of
16; models with multi-head latent attention or several KV groups (hybrid) fix the size.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

NO_BLOCKS_IN_USE = "no request holds KV blocks"
NO_GROUPS = "scheduler exposes no per-request blocks"
FIXED_MLA = "multi-head latent attention fixes the block size"
FIXED_HYBRID = "a hybrid model (several KV groups) fixes the block size"
CPU_STEP_TOKENS = 32
CUDA_STEP_TOKENS = 16


@dataclass(frozen=True, slots=True)
class GroupOccupancy:
    """One KV cache group: distinct blocks its requests hold and the tokens written in them."""

    group: int
    block_size_tokens: int
    blocks_in_use: int
    tokens: int

    @property
    def ratio(self) -> float | None:
        """tokens / (blocks in use x block size); None while no block is in use."""
        slots = self.blocks_in_use * self.block_size_tokens
        return self.tokens / slots if slots else None


@dataclass(frozen=True, slots=True)
class BlockSizeChoice:
    """Which block sizes the engine's backend accepts: multiples of `step_tokens`, or none
    other than the current one (`fixed_reason` says why)."""

    step_tokens: int | None
    fixed_reason: str | None


def _computed_tokens(scheduler: object) -> Mapping[object, int]:
    """Tokens whose KV is written, per request id (waiting requests may hold blocks too)."""
    requests = getattr(scheduler, "requests", None)
    if not isinstance(requests, Mapping):
        requests = {getattr(r, "request_id", None): r for r in getattr(scheduler, "running", ())}
    return {rid: int(getattr(req, "num_computed_tokens", 0) or 0) for rid, req in requests.items()}


def group_occupancy(scheduler: object) -> tuple[GroupOccupancy, ...]:
    """Per KV group, the distinct non-null blocks held by requests and the tokens in them."""
    manager = getattr(scheduler, "kv_cache_manager", None)
    groups = getattr(getattr(manager, "coordinator", None), "single_type_managers", None)
    if not groups:
        return ()
    computed = _computed_tokens(scheduler)
    out = []
    for index, group in enumerate(groups):
        req_to_blocks = getattr(group, "req_to_blocks", None)
        block_size = getattr(group, "block_size", None)
        if not isinstance(req_to_blocks, Mapping) or not isinstance(block_size, int):
            return ()
        filled: dict[int, int] = {}  # block id -> most tokens any holder wrote in it
        for request_id, held in req_to_blocks.items():
            written = computed.get(request_id, 0)
            for position, block in enumerate(held):
                if getattr(block, "is_null", False):
                    continue  # a skipped sliding-window position: no memory behind it
                block_id = getattr(block, "block_id", None)
                if not isinstance(block_id, int):
                    return ()
                in_block = min(block_size, max(0, written - position * block_size))
                filled[block_id] = max(filled.get(block_id, 0), in_block)
        out.append(GroupOccupancy(index, block_size, len(filled), sum(filled.values())))
    return tuple(out)


def block_size_choice(scheduler: object, groups: int) -> BlockSizeChoice:
    """The block sizes this engine's backend accepts, from its configuration."""
    vllm_config = getattr(scheduler, "vllm_config", None)
    if bool(getattr(getattr(vllm_config, "model_config", None), "use_mla", False)):
        return BlockSizeChoice(None, FIXED_MLA)
    if groups > 1:
        return BlockSizeChoice(None, FIXED_HYBRID)
    device = getattr(getattr(vllm_config, "device_config", None), "device_type", None)
    if device == "cpu":
        return BlockSizeChoice(CPU_STEP_TOKENS, None)
    if device == "cuda":
        return BlockSizeChoice(CUDA_STEP_TOKENS, None)
    return BlockSizeChoice(None, None)  # another platform: unknown, not fixed
