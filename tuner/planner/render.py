"""A plan as rich tables for people and as JSON for machines."""

from __future__ import annotations

import dataclasses
import json
from enum import Enum
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from kvpilot.tuner.planner.plan import GIB, Plan


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    """The plan as plain JSON-ready values (enums by value, paths as strings)."""
    data: dict[str, Any] = _plain(dataclasses.asdict(plan))
    data["shape"]["params"]["total_params"] = plan.shape.params.total_params
    data["budget"]["overheads"]["total_bytes"] = plan.budget.overheads.total_bytes
    data["budget"]["estimates"] = ["non_torch_bytes", "activation_peak_bytes", "cuda_graph_bytes"]
    return data


def plan_to_json(plan: Plan) -> str:
    """The plan as an indented JSON document."""
    return json.dumps(plan_to_dict(plan), indent=2, sort_keys=True)


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, Path):
        return str(value)
    return value


def _gib(n: int | None) -> str:
    return "unknown" if n is None else f"{n / GIB:,.2f} GiB"


def render_plan(plan: Plan) -> Group:
    """The plan as rich renderables: model, budget, KV, context table, bounds, problems."""
    shape, geo, cap, budget = plan.shape, plan.geometry, plan.capacity, plan.budget
    model = Table(title=f"Model: {plan.config_path}", show_header=False, title_justify="left")
    model.add_column("what")
    model.add_column("value", justify="right")
    model.add_row("architecture", shape.architecture)
    model.add_row("attention", f"{shape.attention_kind.value} ({shape.num_layers} layers)")
    model.add_row(
        "KV heads x head dim (per GPU)",
        f"{geo.kv_heads_per_rank} x {shape.head_dim}"
        + (f" + {shape.head_dim_v}" if shape.head_dim_v != shape.head_dim else ""),
    )
    if shape.sliding_window_tokens:
        model.add_row(
            "sliding window",
            f"{shape.sliding_window_tokens} tokens on {shape.sliding_window_layers} layers",
        )
    model.add_row("parameters", f"{shape.params.total_params / 1e9:,.2f} B")
    model.add_row(
        "weights per GPU",
        f"{_gib(plan.weights.per_rank_bytes)} ({plan.weights.weight_format.value}, "
        f"{plan.weights.source})",
    )

    mem = Table(title="Memory budget per GPU", show_header=False, title_justify="left")
    mem.add_column("what")
    mem.add_column("bytes", justify="right")
    mem.add_row("GPU memory", _gib(budget.gpu_memory_bytes))
    if budget.requested_bytes is not None:
        mem.add_row(f"requested (x {budget.gpu_memory_utilization})", _gib(budget.requested_bytes))
        mem.add_row("- weights", _gib(budget.weights_bytes))
        mem.add_row("- non-torch (estimate)", _gib(budget.overheads.non_torch_bytes))
        mem.add_row("- activation peak (estimate)", _gib(budget.overheads.activation_peak_bytes))
        mem.add_row("- CUDA graphs (estimate)", _gib(budget.overheads.cuda_graph_bytes))
    mem.add_row(f"= KV cache ({budget.kv_source})", _gib(budget.kv_cache_memory_bytes))

    kv = Table(title="KV cache", show_header=False, title_justify="left")
    kv.add_column("what")
    kv.add_column("value", justify="right")
    kv.add_row("bytes per token", f"{geo.bytes_per_token:,}")
    kv.add_row(f"bytes per block ({geo.block_size} tokens)", f"{geo.bytes_per_block:,}")
    kv.add_row("blocks (num_gpu_blocks)", f"{cap.num_blocks:,}")
    kv.add_row("KV tokens (kv_cache_size_tokens)", f"{cap.kv_cache_size_tokens:,}")
    kv.add_row(
        f"max concurrency at {cap.max_model_len:,} tokens",
        f"{cap.max_concurrency:,.2f} (full requests: {cap.full_requests:,})",
    )

    ctx = Table(title="Context length against concurrency", title_justify="left")
    ctx.add_column("max_model_len", justify="right")
    ctx.add_column("blocks / request", justify="right")
    ctx.add_column("max concurrency", justify="right")
    ctx.add_column("full requests", justify="right")
    for row in plan.context_table:
        ctx.add_row(
            f"{row.max_model_len:,}",
            f"{row.blocks_per_request:,}",
            f"{row.max_concurrency:,.2f}",
            f"{row.full_requests:,}",
        )

    lengths = Table(title="Longest max_model_len at a concurrency", title_justify="left")
    lengths.add_column("concurrent requests", justify="right")
    lengths.add_column("max_model_len", justify="right")
    for length in plan.lengths_at_concurrency:
        value = "does not fit" if length.max_model_len is None else f"{length.max_model_len:,}"
        lengths.add_row(str(length.concurrency), value)

    util = plan.utilization
    bounds = Table(title="--gpu-memory-utilization", show_header=False, title_justify="left")
    bounds.add_column("what")
    bounds.add_column("value", justify="right")
    bounds.add_row(
        "smallest that serves one max_model_len request",
        str(util.min_gpu_memory_utilization) if util.min_gpu_memory_utilization else "-",
    )
    bounds.add_row(
        "largest that starts with today's free memory",
        str(util.max_gpu_memory_utilization) if util.max_gpu_memory_utilization else "-",
    )
    parts: list[Any] = [model, mem, kv, ctx, lengths, bounds]
    for reason in (util.min_reason, util.max_reason):
        if reason:
            parts.append(Text(f"note: {reason}", style="yellow"))
    for note in plan.notes:
        parts.append(Text(f"note: {note}", style="yellow"))
    for problem in plan.problems:
        parts.append(Text(f"will not start: {problem}", style="bold red"))
    return Group(*parts)


def print_plan(plan: Plan, console: Console | None = None) -> None:
    """Print the readable plan."""
    (console or Console()).print(render_plan(plan))
