"""The planner's prediction against what a live server reports in `vllm:cache_config_info`."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

from kvpilot.tuner.planner.kv_sizing import cdiv
from kvpilot.tuner.planner.plan import GIB, Plan, PlanInputs, make_plan

# Beyond this relative difference in blocks an estimated plan earns a warning.
DEFAULT_WARN_RATIO = 0.05


@dataclass(frozen=True, slots=True)
class LiveCacheConfig:
    """The sizing labels of one engine's `vllm:cache_config_info`; None where absent."""

    num_gpu_blocks: int | None
    kv_cache_size_tokens: int | None
    block_size: int | None
    cache_dtype: str | None
    gpu_memory_utilization: float | None
    kv_cache_memory_bytes: int | None
    num_gpu_blocks_override: int | None
    kv_cache_max_concurrency: float | None


def parse_cache_config_labels(labels: Iterable[tuple[str, str]]) -> LiveCacheConfig:
    """Read the labels vLLM writes with `str(value)` ('None' for unset) into typed values."""
    found = dict(labels)

    def text(name: str) -> str | None:
        value = found.get(name)
        return None if value in (None, "", "None") else value

    def integer(name: str) -> int | None:
        value = text(name)
        try:
            return None if value is None else int(value)
        except ValueError:
            return None

    def number(name: str) -> float | None:
        value = text(name)
        try:
            return None if value is None else float(value)
        except ValueError:
            return None

    return LiveCacheConfig(
        num_gpu_blocks=integer("num_gpu_blocks"),
        kv_cache_size_tokens=integer("kv_cache_size_tokens"),
        block_size=integer("block_size"),
        cache_dtype=text("cache_dtype"),
        gpu_memory_utilization=number("gpu_memory_utilization"),
        kv_cache_memory_bytes=integer("kv_cache_memory_bytes"),
        num_gpu_blocks_override=integer("num_gpu_blocks_override"),
        kv_cache_max_concurrency=number("kv_cache_max_concurrency"),
    )


@dataclass(frozen=True, slots=True)
class Calibration:
    """Predicted against reported KV pool, the difference, and the likely cause of a gap."""

    predicted_num_blocks: int
    live_num_blocks: int | None
    blocks_difference: int | None  # live - predicted
    blocks_ratio: float | None  # live / predicted
    predicted_kv_cache_size_tokens: int
    live_kv_cache_size_tokens: int | None
    tokens_difference: int | None  # live - predicted
    predicted_kv_cache_memory_bytes: int
    live_kv_cache_memory_bytes: int | None  # live blocks * bytes per block (all engines)
    memory_difference_bytes: int | None  # live - predicted (all engines)
    implied_overhead_bytes: int | None  # per engine, what vLLM measured beyond the weights
    estimated_overhead_bytes: int | None  # what the planner assumed for the same
    exact: bool  # the prediction is deterministic (explicit KV budget or block override)
    max_model_len: int
    max_model_len_source: str
    warning: str | None
    likely_cause: str | None
    missing_reason: str | None  # why the comparison could not be made

    @property
    def summary(self) -> str:
        """One line for `kvpilot collect` and logs."""
        if self.live_num_blocks is None:
            return f"planner predicted {self.predicted_num_blocks} blocks; {self.missing_reason}"
        pct = "n/a" if self.blocks_ratio is None else f"{(self.blocks_ratio - 1) * 100:+.1f}%"
        line = (
            f"planner predicted {self.predicted_num_blocks} blocks, server reports "
            f"{self.live_num_blocks} (diff {self.blocks_difference:+d}, {pct})"
        )
        if self.likely_cause:
            line += f": likely cause {self.likely_cause}"
        return line


def calibrate(
    plan: Plan,
    live: LiveCacheConfig,
    *,
    max_model_len_source: str = "plan",
    gpu_used_by_others_bytes: int | None = None,
    data_parallel_size: int = 1,
    warn_ratio: float = DEFAULT_WARN_RATIO,
) -> Calibration:
    """Compare a plan with a live server's cache config.

    With data parallelism vLLM sums num_gpu_blocks over the engines while
    kv_cache_size_tokens stays per engine; the comparison does the same.
    """
    cap, geo, budget = plan.capacity, plan.geometry, plan.budget
    exact = budget.requested_bytes is None or live.num_gpu_blocks_override is not None
    engine_blocks = cap.num_blocks
    if live.num_gpu_blocks_override is not None:
        engine_blocks = live.num_gpu_blocks_override
    predicted_tokens = int(engine_blocks / cap.blocks_per_request * cap.max_model_len)
    predicted_blocks = engine_blocks * data_parallel_size
    predicted_bytes = predicted_blocks * geo.bytes_per_block
    estimated_overhead = None if exact else budget.overheads.total_bytes
    unmeasured = Calibration(
        predicted_num_blocks=predicted_blocks,
        live_num_blocks=None,
        blocks_difference=None,
        blocks_ratio=None,
        predicted_kv_cache_size_tokens=predicted_tokens,
        live_kv_cache_size_tokens=live.kv_cache_size_tokens,
        tokens_difference=None,
        predicted_kv_cache_memory_bytes=predicted_bytes,
        live_kv_cache_memory_bytes=None,
        memory_difference_bytes=None,
        implied_overhead_bytes=None,
        estimated_overhead_bytes=estimated_overhead,
        exact=exact,
        max_model_len=cap.max_model_len,
        max_model_len_source=max_model_len_source,
        warning=None,
        likely_cause=None,
        missing_reason="the server reports no num_gpu_blocks in vllm:cache_config_info",
    )
    if live.num_gpu_blocks is None:
        return unmeasured
    live_blocks = live.num_gpu_blocks
    diff = live_blocks - predicted_blocks
    ratio = live_blocks / predicted_blocks if predicted_blocks else None
    live_bytes = live_blocks * geo.bytes_per_block
    implied = None
    if budget.requested_bytes is not None and not exact:
        implied = budget.requested_bytes - budget.weights_bytes - live_bytes // data_parallel_size
    tokens_diff = (
        None if live.kv_cache_size_tokens is None else live.kv_cache_size_tokens - predicted_tokens
    )
    cause = None
    if diff != 0 or (tokens_diff or 0) != 0:
        off = ratio is None or abs(ratio - 1) > warn_ratio
        if exact or off:
            per_engine_gap = (live_bytes - predicted_bytes) // data_parallel_size
            cause = _likely_cause(plan, per_engine_gap, exact, gpu_used_by_others_bytes)
    warning = None
    if cause is not None:
        warning = (
            f"KV pool differs from the plan: predicted {predicted_blocks} blocks, server "
            f"reports {live_blocks} ({diff:+d}); likely cause: {cause}"
        )
    return replace(
        unmeasured,
        live_num_blocks=live_blocks,
        blocks_difference=diff,
        blocks_ratio=ratio,
        tokens_difference=tokens_diff,
        live_kv_cache_memory_bytes=live_bytes,
        memory_difference_bytes=live_bytes - predicted_bytes,
        implied_overhead_bytes=implied,
        warning=warning,
        likely_cause=cause,
        missing_reason=None,
    )


def _likely_cause(plan: Plan, diff_bytes: int, exact: bool, others_bytes: int | None) -> str:
    """Name the most plausible reason for a gap of `diff_bytes` (live - predicted)."""
    if exact:
        return (
            "settings differ from the plan (block size, KV-cache dtype, max_model_len, "
            "tensor parallelism or the model config): with an explicit KV budget vLLM's "
            "arithmetic is deterministic"
        )
    over = plan.budget.overheads
    shortfall = -diff_bytes
    if others_bytes is not None and others_bytes > 0 and others_bytes >= shortfall / 2:
        return (
            f"another process: {others_bytes / GIB:.2f} GiB held by other processes on the "
            "GPU while vLLM profiled counts as vLLM's own non-KV memory"
        )
    if shortfall > 0 and over.cuda_graph_bytes > 0 and shortfall <= 2 * over.cuda_graph_bytes:
        return (
            f"CUDA graphs: capture took about {(shortfall + over.cuda_graph_bytes) / GIB:.2f} "
            f"GiB, the plan estimated {over.cuda_graph_bytes / GIB:.2f} GiB"
        )
    if shortfall > 0:
        return (
            f"activation peak: vLLM's profiling run needed about "
            f"{(shortfall + over.activation_peak_bytes) / GIB:.2f} GiB beyond the weights, "
            f"the plan estimated {over.activation_peak_bytes / GIB:.2f} GiB "
            f"(max_num_batched_tokens {over.max_num_batched_tokens}, sampler rows "
            f"{over.max_num_seqs})"
        )
    return (
        f"overheads smaller than estimated by {diff_bytes / GIB:.2f} GiB (activation peak "
        "or CUDA graphs: --enforce-eager, a smaller max_num_batched_tokens or max_num_seqs)"
    )


def predict_from_cache_config(
    config: str | Path,
    labels: Iterable[tuple[str, str]],
    *,
    max_model_len: int | None = None,
    gpu_memory_bytes: int | None = None,
    tensor_parallel_size: int = 1,
    weights: str = "auto",
    dtype: str = "auto",
    gpu_used_by_others_bytes: int | None = None,
    enforce_eager: bool = False,
    data_parallel_size: int = 1,
    warn_ratio: float = DEFAULT_WARN_RATIO,
) -> Calibration:
    """Plan with a live server's own cache settings, then compare with what it reports.

    `labels` are the (name, value) pairs of one `vllm:cache_config_info` sample. The
    server's max_model_len is not among them: pass it, else it is inferred from
    kv_cache_size_tokens / kv_cache_max_concurrency, else the model's maximum is assumed.
    """
    live = parse_cache_config_labels(labels)
    length, source = _max_model_len(max_model_len, live, data_parallel_size)
    inputs = PlanInputs(
        gpu_memory_bytes=gpu_memory_bytes,
        tensor_parallel_size=tensor_parallel_size,
        weights=weights,
        kv_cache_dtype=live.cache_dtype or "auto",
        dtype=dtype,
        block_size=live.block_size or 16,
        gpu_memory_utilization=live.gpu_memory_utilization or 0.9,
        max_model_len=length,
        kv_cache_memory_bytes=live.kv_cache_memory_bytes,
        enforce_eager=enforce_eager,
    )
    plan = make_plan(config, inputs)
    if length is None:
        source = "the model's maximum (assumed)"
    return calibrate(
        plan,
        live,
        max_model_len_source=source,
        gpu_used_by_others_bytes=gpu_used_by_others_bytes,
        data_parallel_size=data_parallel_size,
        warn_ratio=warn_ratio,
    )


def _max_model_len(
    given: int | None, live: LiveCacheConfig, data_parallel_size: int
) -> tuple[int | None, str]:
    if given is not None:
        return given, "given"
    tokens, concurrency, block = (
        live.kv_cache_size_tokens,
        live.kv_cache_max_concurrency,
        live.block_size,
    )
    if tokens and concurrency and block:
        # tokens = int(concurrency * len): the nearest whole length reproduces both figures.
        guess = round(tokens / concurrency)
        engine_blocks = (live.num_gpu_blocks or 0) // data_parallel_size
        if engine_blocks and int(engine_blocks / cdiv(guess, block) * guess) == tokens:
            return guess, "inferred from kv_cache_size_tokens / kv_cache_max_concurrency"
    return None, "unknown"
