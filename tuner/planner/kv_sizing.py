"""KV-cache arithmetic as vLLM 0.32 (v1 engine) does it: bytes per token and block, blocks, tokens.

The formulas mirror `vllm/v1/kv_cache_interface.py` (page sizes) and
`vllm/v1/core/kv_cache_utils.py` (`get_kv_cache_config_from_groups`,
`get_max_concurrency_for_kv_cache_config`, `get_kv_cache_capacity`).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpilot.tuner.planner.model_shape import AttentionKind, ModelShape

# Bytes of one cached number per --kv-cache-dtype; "auto" follows the model dtype.
_KV_DTYPE_BYTES = {
    "bfloat16": 2,
    "float16": 2,
    "half": 2,
    "float32": 4,
    "float": 4,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "fp8_inc": 1,
}


def cdiv(a: int, b: int) -> int:
    """Ceiling division, as vLLM's `cdiv`."""
    return -(a // -b)


def model_dtype(shape: ModelShape, dtype: str = "auto") -> str:
    """The dtype vLLM serves in: `--dtype`, or the config's float16/bfloat16 (else bfloat16)."""
    if dtype != "auto":
        return dtype
    if shape.torch_dtype in ("float16", "bfloat16"):
        return shape.torch_dtype
    return "bfloat16"


def kv_dtype_bytes(kv_cache_dtype: str, serving_dtype: str) -> int:
    """Bytes per cached number for a `--kv-cache-dtype` value."""
    name = serving_dtype if kv_cache_dtype == "auto" else kv_cache_dtype
    try:
        return _KV_DTYPE_BYTES[name]
    except KeyError:
        known = ", ".join(["auto", *sorted(_KV_DTYPE_BYTES)])
        raise ValueError(f"unknown KV-cache dtype {name!r}; known: {known}") from None


@dataclass(frozen=True, slots=True)
class KvGeometry:
    """Per-GPU KV layout of one model at one block size and dtype."""

    kv_heads_per_rank: int
    bytes_per_token_per_layer: int
    bytes_per_token: int  # all attention layers, one GPU
    bytes_per_block: int  # one block across all layers: vLLM's divisor
    block_size: int
    num_layers: int
    sliding_window_tokens: int | None
    sliding_window_layers: int
    exact: bool  # False where vLLM's grouping of mixed layers is only approximated
    inexact_reason: str | None


def kv_geometry(
    shape: ModelShape,
    *,
    block_size: int,
    kv_cache_dtype: str = "auto",
    dtype: str = "auto",
    tensor_parallel_size: int = 1,
) -> KvGeometry:
    """The page arithmetic of `AttentionSpec.page_size_bytes` for every layer of a model."""
    if block_size <= 0:
        raise ValueError(f"block size must be positive, not {block_size}")
    if tensor_parallel_size <= 0:
        raise ValueError(f"tensor-parallel size must be positive, not {tensor_parallel_size}")
    elem = kv_dtype_bytes(kv_cache_dtype, model_dtype(shape, dtype))
    if shape.attention_kind is AttentionKind.MLA:
        # One latent (kv_lora_rank + rope dims) per token, replicated on every TP rank.
        heads = 1
        per_layer = shape.head_dim * elem
    else:
        # vLLM replicates KV heads when TP exceeds them: max(1, heads // tp).
        heads = max(1, shape.num_kv_heads // tensor_parallel_size)
        per_layer = heads * (shape.head_dim + shape.head_dim_v) * elem
    mixed = 0 < shape.sliding_window_layers < shape.num_layers
    return KvGeometry(
        kv_heads_per_rank=heads,
        bytes_per_token_per_layer=per_layer,
        bytes_per_token=per_layer * shape.num_layers,
        bytes_per_block=per_layer * shape.num_layers * block_size,
        block_size=block_size,
        num_layers=shape.num_layers,
        sliding_window_tokens=shape.sliding_window_tokens,
        sliding_window_layers=shape.sliding_window_layers,
        exact=not mixed,
        inexact_reason=(
            "sliding-window and full-attention layers mixed: vLLM's hybrid grouping is "
            "approximated layer by layer"
            if mixed
            else None
        ),
    )


def blocks_per_request(geo: KvGeometry, max_model_len: int, in_flight_tokens: int) -> int:
    """Blocks one request of `max_model_len` tokens holds at most.

    Full attention: cdiv(len, block). Sliding window: vLLM keeps the window plus the tokens
    in flight, plus one block for misalignment
    (`SlidingWindowSpec.max_admission_blocks_per_request`).
    """
    full = cdiv(max_model_len, geo.block_size)
    if geo.sliding_window_tokens is None or geo.sliding_window_layers == 0:
        return full
    window_tokens = min(geo.sliding_window_tokens - 1 + in_flight_tokens, max_model_len)
    window = cdiv(window_tokens, geo.block_size) + 1
    if geo.sliding_window_layers == geo.num_layers:
        return window
    # Mixed layers: weight the two kinds by their share of layers (an approximation).
    full_layers = geo.num_layers - geo.sliding_window_layers
    return cdiv(full * full_layers + window * geo.sliding_window_layers, geo.num_layers)


@dataclass(frozen=True, slots=True)
class KvCapacity:
    """What a KV budget buys, in vLLM's own terms."""

    kv_cache_memory_bytes: int
    num_blocks: int  # as vLLM's `num_gpu_blocks` (the null block included)
    blocks_per_request: int
    max_model_len: int
    kv_cache_size_tokens: int  # as vLLM's `kv_cache_size_tokens`
    max_concurrency: float  # as vLLM logs it: num_blocks / blocks_per_request
    full_requests: int  # requests of max_model_len that fit at once, the null block excluded
    fits_one_request: bool  # vLLM's start-up check


def kv_capacity(
    geo: KvGeometry, kv_cache_memory_bytes: int, max_model_len: int, in_flight_tokens: int = 0
) -> KvCapacity:
    """Blocks, tokens and concurrency from KV bytes, as `get_kv_cache_config_from_groups`."""
    num_blocks = max(0, kv_cache_memory_bytes) // geo.bytes_per_block
    per_request = blocks_per_request(geo, max_model_len, in_flight_tokens)
    concurrency = num_blocks / per_request
    return KvCapacity(
        kv_cache_memory_bytes=kv_cache_memory_bytes,
        num_blocks=num_blocks,
        blocks_per_request=per_request,
        max_model_len=max_model_len,
        kv_cache_size_tokens=int(concurrency * max_model_len),
        max_concurrency=concurrency,
        full_requests=max(0, num_blocks - 1) // per_request,
        # vLLM reserves the null block, then needs one request's worth.
        fits_one_request=num_blocks - 1 >= per_request,
    )


def kv_bytes_for_requests(
    geo: KvGeometry, concurrency: int, max_model_len: int, in_flight_tokens: int = 0
) -> int:
    """The smallest KV budget for `concurrency` requests of `max_model_len`, null block included."""
    per_request = blocks_per_request(geo, max_model_len, in_flight_tokens)
    return (concurrency * per_request + 1) * geo.bytes_per_block


def largest_max_model_len(
    geo: KvGeometry, num_blocks: int, concurrency: int, limit: int, in_flight_tokens: int = 0
) -> int | None:
    """The longest max_model_len (<= limit) at which `concurrency` requests fit; None if none."""
    usable = num_blocks - 1

    def fits(length: int) -> bool:
        return concurrency * blocks_per_request(geo, length, in_flight_tokens) <= usable

    if not fits(1):
        return None
    low, high = 1, limit
    while low < high:  # blocks per request never shrink as the length grows
        mid = (low + high + 1) // 2
        if fits(mid):
            low = mid
        else:
            high = mid - 1
    return low
