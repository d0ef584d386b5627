"""`kvpilot plan`: will this model fit, and how many requests at which context length."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from kvpilot.collectors.nvml import gpu_from_nvml
from kvpilot.tuner.planner import ModelShapeError, PlanError, PlanInputs, make_plan
from kvpilot.tuner.planner.render import plan_to_json, print_plan

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """'80GiB', '80GB', '81920MiB' or a plain byte count -> bytes."""
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise typer.BadParameter(f"{text!r} is not a size (e.g. 80GiB, 80GB, 85899345920)")
    return int(float(match.group(1)) * _UNITS[unit])


def plan_command(
    config: Annotated[Path, typer.Argument(help="A Hugging Face config.json, or its folder.")],
    gpu_memory: Annotated[
        str | None,
        typer.Option(help="GPU memory per device (80GiB, 80GB); default: what NVML reports."),
    ] = None,
    gpu_free: Annotated[
        str | None,
        typer.Option(help="Memory free now (others' use excluded); default: NVML's figure."),
    ] = None,
    gpu_index: Annotated[int, typer.Option(help="The GPU NVML is asked about.")] = 0,
    tensor_parallel_size: Annotated[int, typer.Option("--tensor-parallel-size", "-tp")] = 1,
    weights: Annotated[
        str, typer.Option(help="auto, bf16, fp16, fp8, int8, int4-awq or int4-gptq.")
    ] = "auto",
    dtype: Annotated[str, typer.Option(help="vLLM --dtype (auto follows the config).")] = "auto",
    kv_cache_dtype: Annotated[str, typer.Option(help="auto, fp8, fp8_e4m3, fp8_e5m2.")] = "auto",
    block_size: Annotated[int, typer.Option(help="vLLM --block-size.")] = 16,
    gpu_memory_utilization: Annotated[float, typer.Option()] = 0.9,
    max_model_len: Annotated[
        int | None, typer.Option(help="Default: the model's maximum context.")
    ] = None,
    kv_cache_memory_bytes: Annotated[
        str | None, typer.Option(help="An explicit KV budget, as vLLM's flag (e.g. 4GiB).")
    ] = None,
    max_num_seqs: Annotated[int | None, typer.Option()] = None,
    max_num_batched_tokens: Annotated[int | None, typer.Option()] = None,
    enforce_eager: Annotated[bool, typer.Option(help="No CUDA graphs.")] = False,
    concurrency: Annotated[
        list[int] | None,
        typer.Option(help="Concurrency targets for the longest-length table (repeatable)."),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")] = False,
) -> None:
    """Plan the KV cache: weights, KV bytes per token and block, blocks, concurrency by length."""
    err = Console(stderr=True)
    total = parse_size(gpu_memory) if gpu_memory else None
    free = parse_size(gpu_free) if gpu_free else None
    name = ""
    if total is None or free is None:
        found = gpu_from_nvml(gpu_index)
        if isinstance(found, str):
            if total is None and kv_cache_memory_bytes is None:
                err.print(f"[red]no GPU memory size: {found}; pass --gpu-memory[/red]")
                raise typer.Exit(2)
        else:
            total = total if total is not None else found[0]
            free = free if free is not None else found[1]
            name = found[2]
    inputs = PlanInputs(
        gpu_memory_bytes=total,
        gpu_free_bytes=free,
        tensor_parallel_size=tensor_parallel_size,
        weights=weights,
        kv_cache_dtype=kv_cache_dtype,
        dtype=dtype,
        block_size=block_size,
        gpu_memory_utilization=gpu_memory_utilization,
        max_model_len=max_model_len,
        kv_cache_memory_bytes=parse_size(kv_cache_memory_bytes) if kv_cache_memory_bytes else None,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        enforce_eager=enforce_eager,
        gpu_name=name,
        **({"concurrency_targets": tuple(concurrency)} if concurrency else {}),
    )
    try:
        plan = make_plan(config, inputs)
    except (ModelShapeError, PlanError, ValueError) as exc:
        err.print(f"[red]cannot plan: {exc}[/red]")
        raise typer.Exit(2) from exc
    if as_json:
        typer.echo(plan_to_json(plan))
    else:
        print_plan(plan, Console())
    if plan.problems:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    """Add `plan` to the kvpilot command line."""
    app.command("plan")(plan_command)
