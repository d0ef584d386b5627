"""Adapter inside the engine: read a vLLM worker's memory into a `MemoryLedger` at once.

vLLM 0.32 exports neither the weights' size nor the CUDA graphs' memory; both are known
only inside the worker: `model_runner.model_memory_usage` (GPU, measured around loading),
the model's parameter storages (CPU, where nothing measures them), and what
`capture_model()` returns (the plugin keeps it on the runner as `GRAPH_BYTES_ATTR`). The KV
part is the bytes of the KV cache tensors themselves. Every vLLM attribute is read with
`getattr`; the caller guards the whole read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from kvpilot.collectors.kvpool.ledger import (
    ALLOCATOR_SLACK,
    CUDA_CONTEXT,
    CUDA_GRAPHS,
    KV_CACHE,
    WEIGHTS,
    LedgerPart,
    MemoryLedger,
)
from kvpilot.collectors.procfs import read_pss_bytes

GRAPH_BYTES_ATTR = "_kvpilot_cuda_graph_bytes"


def storage_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer count once)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        seen[int(storage.data_ptr())] = int(storage.nbytes())
    return sum(seen.values())


def _model_tensors(model: Any) -> list[Any]:
    return [*model.parameters(), *model.buffers()]


def _kv_tensors(runner: Any) -> list[Any]:
    caches = getattr(runner, "kv_caches", None) or []
    flat: list[Any] = []
    for cache in caches:  # a tensor per layer, or a list of them (some backends)
        flat.extend(cache if isinstance(cache, list | tuple) else [cache])
    return [tensor for tensor in flat if tensor is not None]


def pool_blocks(block_pool: Any) -> tuple[int, int] | None:
    """(blocks including the null block, free blocks) of vLLM's block pool, if readable."""
    total = getattr(block_pool, "num_gpu_blocks", None)
    free = getattr(block_pool, "get_num_free_blocks", None)
    if not isinstance(total, int) or free is None:
        return None
    return total, int(free())


def _kv_figures(
    kv_bytes: int, blocks: tuple[int, int] | None, runner: Any = None
) -> tuple[int | None, int | None]:
    """Block bytes and the bytes of blocks held by requests (the null block is never used).
    Without the block pool (a worker in its own process) only the block bytes, from the
    runner's KV cache config."""
    if blocks is None:
        total = getattr(getattr(runner, "kv_cache_config", None), "num_blocks", None)
        if not isinstance(total, int) or total <= 0 or kv_bytes % total:
            return None, None
        return kv_bytes // total, None
    if blocks[0] <= 0 or kv_bytes % blocks[0]:
        return None, None
    block_bytes = kv_bytes // blocks[0]
    used_blocks = max(blocks[0] - 1 - blocks[1], 0)
    return block_bytes, used_blocks * block_bytes


def read_cpu_ledger(
    worker: Any,
    *,
    rank: str,
    blocks: tuple[int, int] | None,
    pss: Callable[[], int | None] = lambda: read_pss_bytes("self"),
) -> MemoryLedger:
    """The CPU ledger: weights and KV tensors, of this process's proportional set size."""
    runner = getattr(worker, "model_runner", None)
    model = getattr(runner, "model", None)
    parts = []
    if model is not None:
        parts.append(LedgerPart(WEIGHTS, storage_bytes(_model_tensors(model)), "model_parameters"))
    kv_bytes = storage_bytes(_kv_tensors(runner))
    parts.append(LedgerPart(KV_CACHE, kv_bytes, "kv_cache_tensors"))
    block_bytes, kv_used = _kv_figures(kv_bytes, blocks, runner)
    return MemoryLedger(
        device="cpu",
        rank=rank,
        used_bytes=pss(),
        used_source="proc_smaps_rollup_pss",
        parts=tuple(parts),
        kv_used_bytes=kv_used,
        kv_block_bytes=block_bytes,
    )


def cuda_ledger_from(
    *,
    device: int,
    rank: str,
    memory_stats: Mapping[str, Any],
    free_and_total: tuple[int, int],
    weights_bytes: int | None,
    graph_bytes: int | None,
    context_bytes: int | None,
    kv_bytes: int,
    blocks: tuple[int, int] | None,
    budget_bytes: int | None,
) -> MemoryLedger:
    """The GPU ledger from plain figures (tested on recorded allocator stats)."""
    parts = []
    if weights_bytes is not None:
        parts.append(LedgerPart(WEIGHTS, weights_bytes, "vllm_model_memory_usage"))
    if graph_bytes is not None:
        parts.append(LedgerPart(CUDA_GRAPHS, graph_bytes, "vllm_capture_model"))
    if context_bytes is not None:
        parts.append(LedgerPart(CUDA_CONTEXT, context_bytes, "vllm_init_snapshot_non_torch"))
    parts.append(LedgerPart(KV_CACHE, kv_bytes, "kv_cache_tensors"))
    reserved = memory_stats.get("reserved_bytes.all.current")
    allocated = memory_stats.get("allocated_bytes.all.current")
    if isinstance(reserved, int) and isinstance(allocated, int):
        slack = max(reserved - allocated, 0)
        parts.append(LedgerPart(ALLOCATOR_SLACK, slack, "torch_cuda_memory_stats"))
    free, total = free_and_total
    block_bytes, kv_used = _kv_figures(kv_bytes, blocks)
    return MemoryLedger(
        device=str(device),
        rank=rank,
        used_bytes=total - free,
        used_source="cuda_mem_get_info",
        parts=tuple(parts),
        kv_used_bytes=kv_used,
        kv_block_bytes=block_bytes,
        budget_bytes=budget_bytes,
        budget_source="vllm_requested_memory" if budget_bytes is not None else "",
        total_bytes=total,
        unallocated_bytes=free,
    )


def _int_or_none(value: object) -> int | None:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def read_cuda_ledger(
    worker: Any, *, device: int, rank: str, blocks: tuple[int, int] | None, torch_cuda: Any = None
) -> MemoryLedger:
    """The GPU ledger of `worker`'s device, read live; raises what torch raises."""
    if torch_cuda is None:
        import torch.cuda as torch_cuda  # only a process that owns a GPU gets here
    runner = getattr(worker, "model_runner", None)
    snapshot = getattr(worker, "init_snapshot", None)
    free, total = torch_cuda.mem_get_info(device)
    return cuda_ledger_from(
        device=device,
        rank=rank,
        memory_stats=torch_cuda.memory_stats(device),
        free_and_total=(int(free), int(total)),
        weights_bytes=_int_or_none(getattr(runner, "model_memory_usage", None)),
        graph_bytes=_int_or_none(getattr(runner, GRAPH_BYTES_ATTR, None)),
        context_bytes=_int_or_none(getattr(snapshot, "non_torch_memory", None)),
        kv_bytes=storage_bytes(_kv_tensors(runner)),
        blocks=blocks,
        budget_bytes=_int_or_none(getattr(worker, "requested_memory", None)),
    )
