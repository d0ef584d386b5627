"""The whole memory plan for one model on one GPU, and the feasible bounds the tuner searches in.

On a GPU, vLLM 0.32 sizes the KV cache as
    requested = ceil(total * gpu_memory_utilization)
    kv_bytes  = requested - weights - non-torch growth - activation peak - CUDA-graph estimate
    blocks    = kv_bytes // bytes_per_block
(`Worker.determine_available_memory`). Weights follow from the checkpoint or the parameter
count; the other three terms are measured by vLLM at start-up and can only be estimated here,
so they are named as estimates and `calibration` corrects them from a live server. With an
explicit `--kv-cache-memory-bytes` vLLM skips the subtraction and the arithmetic is exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from kvpilot.tuner.planner.kv_sizing import (
    KvCapacity,
    KvGeometry,
    kv_bytes_for_requests,
    kv_capacity,
    kv_geometry,
    largest_max_model_len,
)
from kvpilot.tuner.planner.model_shape import ModelShape, config_file, load_model_shape
from kvpilot.tuner.planner.weights import WeightMemory, parse_weight_format, weight_memory

GIB = 1024**3
MIB = 1024**2
# Non-torch growth during vLLM's profiling (cuBLAS workspaces; NCCL buffers with TP > 1).
NON_TORCH_ESTIMATE_BYTES = 192 * MIB
NON_TORCH_TP_ESTIMATE_BYTES = 768 * MIB
# CUDA graphs for vLLM's default capture sizes: a base plus a share per layer.
CUDA_GRAPH_BASE_ESTIMATE_BYTES = 256 * MIB
CUDA_GRAPH_PER_LAYER_ESTIMATE_BYTES = 8 * MIB
DEFAULT_CONCURRENCY_TARGETS = (1, 8, 16, 32, 64, 128, 256)


class PlanError(ValueError):
    """The model cannot start with these settings; the message says what does not fit."""


@dataclass(frozen=True, slots=True)
class PlanInputs:
    """Everything the plan depends on besides the model config."""

    gpu_memory_bytes: int | None = None  # None: only an explicit KV budget can be planned
    gpu_free_bytes: int | None = None  # free now (NVML); bounds the utilisation that starts
    tensor_parallel_size: int = 1
    weights: str = "auto"  # bf16, fp16, fp8, int8, int4-awq, int4-gptq, auto
    kv_cache_dtype: str = "auto"
    dtype: str = "auto"
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None  # None: the model's maximum
    kv_cache_memory_bytes: int | None = None  # vLLM's --kv-cache-memory-bytes
    max_num_seqs: int | None = None  # None: vLLM's default for this GPU size
    max_num_batched_tokens: int | None = None
    enforce_eager: bool = False
    gpu_name: str = ""
    concurrency_targets: tuple[int, ...] = DEFAULT_CONCURRENCY_TARGETS


@dataclass(frozen=True, slots=True)
class OverheadEstimates:
    """What vLLM measures at start-up and the planner can only estimate, per GPU."""

    non_torch_bytes: int
    activation_peak_bytes: int
    cuda_graph_bytes: int
    max_num_seqs: int
    max_num_batched_tokens: int

    @property
    def total_bytes(self) -> int:
        """Sum of the three estimates."""
        return self.non_torch_bytes + self.activation_peak_bytes + self.cuda_graph_bytes


@dataclass(frozen=True, slots=True)
class MemoryBudget:
    """Where one GPU's memory goes under this plan."""

    gpu_memory_bytes: int | None
    gpu_memory_utilization: float | None
    requested_bytes: int | None  # ceil(total * utilisation)
    weights_bytes: int  # per GPU
    overheads: OverheadEstimates
    kv_cache_memory_bytes: int
    kv_source: str  # "explicit --kv-cache-memory-bytes" or "gpu_memory_utilization (estimate)"


@dataclass(frozen=True, slots=True)
class ContextRow:
    """Concurrency at one max_model_len with this plan's KV budget."""

    max_model_len: int
    blocks_per_request: int
    max_concurrency: float  # vLLM's figure (null block included)
    full_requests: int


@dataclass(frozen=True, slots=True)
class LengthRow:
    """The longest max_model_len that serves `concurrency` requests at once."""

    concurrency: int
    max_model_len: int | None  # None: not even one token per request fits


@dataclass(frozen=True, slots=True)
class UtilizationBounds:
    """The --gpu-memory-utilization range that starts and serves one full-length request."""

    min_gpu_memory_utilization: float | None
    min_reason: str | None
    max_gpu_memory_utilization: float | None
    max_reason: str | None


@dataclass(frozen=True, slots=True)
class Plan:
    """A complete memory plan."""

    config_path: Path
    shape: ModelShape
    inputs: PlanInputs
    weights: WeightMemory
    geometry: KvGeometry
    budget: MemoryBudget
    capacity: KvCapacity
    context_table: tuple[ContextRow, ...]
    lengths_at_concurrency: tuple[LengthRow, ...]
    utilization: UtilizationBounds
    problems: tuple[str, ...] = field(default=())  # reasons vLLM would refuse to start
    notes: tuple[str, ...] = field(default=())


@dataclass(frozen=True, slots=True)
class FeasibleBounds:
    """The search space the tuner may use for one model on one GPU."""

    min_gpu_memory_utilization: float | None
    max_gpu_memory_utilization: float | None
    min_kv_cache_memory_bytes: int  # one request of max_model_len plus the null block
    max_kv_cache_memory_bytes: int | None  # the KV left at the largest utilisation that starts
    bytes_per_block: int
    reasons: tuple[str, ...]


def default_scheduler_limits(gpu_memory_bytes: int | None, gpu_name: str = "") -> tuple[int, int]:
    """vLLM's API-server defaults (max_num_seqs, max_num_batched_tokens) for a GPU's size."""
    memory = gpu_memory_bytes or 0
    if memory >= 160 * GIB:
        return 1024, 16384
    if memory >= 70 * GIB and "a100" not in gpu_name.lower():
        return 1024, 8192
    return 256, 2048


def estimate_overheads(shape: ModelShape, inputs: PlanInputs) -> OverheadEstimates:
    """Estimates of vLLM's non-torch growth, activation peak and CUDA-graph memory, per GPU."""
    seqs, tokens = default_scheduler_limits(inputs.gpu_memory_bytes, inputs.gpu_name)
    seqs = inputs.max_num_seqs or seqs
    tokens = inputs.max_num_batched_tokens or tokens
    tp = inputs.tensor_parallel_size
    inter = math.ceil(shape.intermediate_size / tp)
    qkv = math.ceil(shape.num_attention_heads * shape.head_dim * 3 / tp)
    # The profile run pushes max_num_batched_tokens through one layer at a time: the gated
    # MLP's gate/up output and activation, the residual stream twice, the fused QKV output.
    per_token = (3 * inter + 2 * shape.hidden_size + qkv) * 2
    # The sampler warm-up: float32 logits and probabilities for max_num_seqs rows.
    sampler = seqs * math.ceil(shape.vocab_size / tp) * 4 * 2
    graphs = 0
    if not inputs.enforce_eager:
        graphs = CUDA_GRAPH_BASE_ESTIMATE_BYTES + CUDA_GRAPH_PER_LAYER_ESTIMATE_BYTES * (
            shape.num_layers
        )
    return OverheadEstimates(
        non_torch_bytes=NON_TORCH_ESTIMATE_BYTES if tp == 1 else NON_TORCH_TP_ESTIMATE_BYTES,
        activation_peak_bytes=tokens * per_token + sampler,
        cuda_graph_bytes=graphs,
        max_num_seqs=seqs,
        max_num_batched_tokens=tokens,
    )


def make_plan(config: str | Path, inputs: PlanInputs) -> Plan:
    """Plan the KV cache for the model whose config.json is at `config`."""
    path = config_file(config)
    return plan_for_shape(load_model_shape(path), inputs, path)


def plan_for_shape(shape: ModelShape, inputs: PlanInputs, config_path: Path) -> Plan:
    """Plan the KV cache for an already-read model shape."""
    _check_inputs(inputs)
    max_len = inputs.max_model_len or shape.max_position_embeddings
    notes: list[str] = []
    if max_len > shape.max_position_embeddings:
        notes.append(
            f"max_model_len {max_len} exceeds the model's {shape.max_position_embeddings}; "
            "vLLM refuses that unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1"
        )
    fmt = parse_weight_format(inputs.weights, shape)
    weights = weight_memory(shape, fmt, inputs.tensor_parallel_size, config_path.parent)
    geo = kv_geometry(
        shape,
        block_size=inputs.block_size,
        kv_cache_dtype=inputs.kv_cache_dtype,
        dtype=inputs.dtype,
        tensor_parallel_size=inputs.tensor_parallel_size,
    )
    if not geo.exact:
        notes.append(f"approximate: {geo.inexact_reason}")
    overheads = estimate_overheads(shape, inputs)
    in_flight = overheads.max_num_batched_tokens
    budget = _budget(inputs, weights, overheads)
    capacity = kv_capacity(geo, budget.kv_cache_memory_bytes, max_len, in_flight)
    problems = _problems(geo, capacity, budget, in_flight)
    return Plan(
        config_path=config_path,
        shape=shape,
        inputs=inputs,
        weights=weights,
        geometry=geo,
        budget=budget,
        capacity=capacity,
        context_table=_context_table(geo, capacity.num_blocks, shape, max_len, in_flight),
        lengths_at_concurrency=tuple(
            LengthRow(c, largest_max_model_len(geo, capacity.num_blocks, c, max_len, in_flight))
            for c in inputs.concurrency_targets
        ),
        utilization=_utilization_bounds(inputs, weights, overheads, geo, max_len, in_flight),
        problems=problems,
        notes=tuple(notes),
    )


def feasible_bounds(config: str | Path, inputs: PlanInputs) -> FeasibleBounds:
    """The gpu_memory_utilization and KV-budget range in which vLLM starts and serves a request."""
    path = config_file(config)
    shape = load_model_shape(path)
    _check_inputs(inputs)
    max_len = inputs.max_model_len or shape.max_position_embeddings
    fmt = parse_weight_format(inputs.weights, shape)
    weights = weight_memory(shape, fmt, inputs.tensor_parallel_size, path.parent)
    geo = kv_geometry(
        shape,
        block_size=inputs.block_size,
        kv_cache_dtype=inputs.kv_cache_dtype,
        dtype=inputs.dtype,
        tensor_parallel_size=inputs.tensor_parallel_size,
    )
    overheads = estimate_overheads(shape, inputs)
    in_flight = overheads.max_num_batched_tokens
    bounds = _utilization_bounds(inputs, weights, overheads, geo, max_len, in_flight)
    max_kv = None
    if inputs.gpu_memory_bytes is not None and bounds.max_gpu_memory_utilization is not None:
        requested = math.ceil(inputs.gpu_memory_bytes * bounds.max_gpu_memory_utilization)
        max_kv = max(0, requested - weights.per_rank_bytes - overheads.total_bytes)
    reasons = tuple(r for r in (bounds.min_reason, bounds.max_reason) if r)
    return FeasibleBounds(
        min_gpu_memory_utilization=bounds.min_gpu_memory_utilization,
        max_gpu_memory_utilization=bounds.max_gpu_memory_utilization,
        min_kv_cache_memory_bytes=kv_bytes_for_requests(geo, 1, max_len, in_flight),
        max_kv_cache_memory_bytes=max_kv,
        bytes_per_block=geo.bytes_per_block,
        reasons=reasons,
    )


def _check_inputs(inputs: PlanInputs) -> None:
    if not 0 < inputs.gpu_memory_utilization <= 1:
        raise PlanError(
            f"gpu_memory_utilization must be in (0, 1], not {inputs.gpu_memory_utilization}"
        )
    if inputs.gpu_memory_bytes is None and inputs.kv_cache_memory_bytes is None:
        raise PlanError(
            "no GPU memory to plan with: pass --gpu-memory (e.g. 80GiB), run where NVML sees "
            "the GPU, or give an explicit --kv-cache-memory-bytes"
        )
    if inputs.max_model_len is not None and inputs.max_model_len <= 0:
        raise PlanError(f"max_model_len must be positive, not {inputs.max_model_len}")


def _budget(inputs: PlanInputs, weights: WeightMemory, over: OverheadEstimates) -> MemoryBudget:
    if inputs.kv_cache_memory_bytes is not None:
        return MemoryBudget(
            gpu_memory_bytes=inputs.gpu_memory_bytes,
            gpu_memory_utilization=None,
            requested_bytes=None,
            weights_bytes=weights.per_rank_bytes,
            overheads=over,
            kv_cache_memory_bytes=inputs.kv_cache_memory_bytes,
            kv_source="explicit --kv-cache-memory-bytes",
        )
    assert inputs.gpu_memory_bytes is not None  # _check_inputs guarantees one of the two
    total = inputs.gpu_memory_bytes
    requested = math.ceil(total * inputs.gpu_memory_utilization)
    kv = requested - weights.per_rank_bytes - over.total_bytes
    if requested < weights.per_rank_bytes:
        raise PlanError(
            f"the weights do not fit: {_gib(weights.per_rank_bytes)} per GPU "
            f"({weights.weight_format.value}, TP {inputs.tensor_parallel_size}) against "
            f"{_gib(requested)} requested ({inputs.gpu_memory_utilization} of {_gib(total)}); "
            f"short by {_gib(weights.per_rank_bytes - requested)} before activations and KV"
        )
    return MemoryBudget(
        gpu_memory_bytes=total,
        gpu_memory_utilization=inputs.gpu_memory_utilization,
        requested_bytes=requested,
        weights_bytes=weights.per_rank_bytes,
        overheads=over,
        kv_cache_memory_bytes=max(0, kv),
        kv_source="gpu_memory_utilization (estimate)",
    )


def _problems(
    geo: KvGeometry, cap: KvCapacity, budget: MemoryBudget, in_flight: int
) -> tuple[str, ...]:
    if cap.fits_one_request:
        return ()
    need = kv_bytes_for_requests(geo, 1, cap.max_model_len, in_flight)
    have = budget.kv_cache_memory_bytes
    longest = largest_max_model_len(geo, cap.num_blocks, 1, cap.max_model_len, in_flight)
    hint = (
        f"; the longest max_model_len that fits is {longest}"
        if longest
        else "; no request length fits"
    )
    if have <= 0:
        return (
            "no memory left for the KV cache: weights and estimated overheads take the "
            f"whole budget; one request of {cap.max_model_len} tokens needs {_gib(need)} more"
            + hint,
        )
    return (
        f"the KV cache cannot hold one request of {cap.max_model_len} tokens: it needs "
        f"{_gib(need)} ({cap.blocks_per_request} blocks + the null block), the budget has "
        f"{_gib(have)}; short by {_gib(need - have)}" + hint,
    )


def _context_table(
    geo: KvGeometry, num_blocks: int, shape: ModelShape, max_len: int, in_flight: int
) -> tuple[ContextRow, ...]:
    limit = max(max_len, shape.max_position_embeddings)
    lengths: list[int] = []
    length = 4096
    while length < limit:
        lengths.append(length)
        length *= 2
    lengths.append(limit)
    if max_len not in lengths:
        lengths.append(max_len)
    rows = []
    for n in sorted(set(lengths)):
        cap = kv_capacity(geo, num_blocks * geo.bytes_per_block, n, in_flight)
        rows.append(ContextRow(n, cap.blocks_per_request, cap.max_concurrency, cap.full_requests))
    return tuple(rows)


def _utilization_bounds(
    inputs: PlanInputs,
    weights: WeightMemory,
    over: OverheadEstimates,
    geo: KvGeometry,
    max_len: int,
    in_flight: int,
) -> UtilizationBounds:
    total = inputs.gpu_memory_bytes
    if total is None:
        reason = "GPU memory unknown: pass --gpu-memory"
        return UtilizationBounds(None, reason, None, reason)
    need = weights.per_rank_bytes + over.total_bytes
    need += kv_bytes_for_requests(geo, 1, max_len, in_flight)
    min_util: float | None = math.ceil(need / total * 10_000) / 10_000
    min_reason = None
    if min_util is not None and min_util > 1:
        min_reason = (
            f"does not fit: one request of {max_len} tokens needs {_gib(need)} "
            f"(weights, estimated overheads, KV) on a {_gib(total)} GPU; short by "
            f"{_gib(need - total)}"
        )
        min_util = None
    if inputs.gpu_free_bytes is None:
        return UtilizationBounds(
            min_util, min_reason, None, "free memory unknown: NVML not read (pass --gpu-free)"
        )
    # vLLM refuses to start when free memory < ceil(total * utilisation).
    max_util = math.floor(inputs.gpu_free_bytes / total * 10_000) / 10_000
    max_reason = None
    if min_util is not None and max_util < min_util:
        max_reason = (
            f"other processes hold {_gib(total - inputs.gpu_free_bytes)}: the largest "
            f"utilisation that starts ({max_util}) is below the smallest that serves one "
            f"request ({min_util})"
        )
    return UtilizationBounds(min_util, min_reason, max_util, max_reason)


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"
