"""Weight memory: from a checkpoint's safetensors files when present, else from the config."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from kvpilot.tuner.planner.model_shape import ModelShape

# int4 AWQ/GPTQ store, per group of 128 inputs and per output, a 16-bit scale and a 4-bit zero.
_INT4_GROUP = 128
_INT4_GROUP_OVERHEAD_BYTES = 2.5
# fp8 checkpoints carry a float32 scale per 128x128 block (DeepSeek style) or per channel.
_FP8_BLOCK = 128 * 128


class WeightFormat(Enum):
    """How the served weights are stored."""

    BF16 = "bf16"
    FP16 = "fp16"
    FP8 = "fp8"
    INT8 = "int8"
    INT4_AWQ = "int4-awq"
    INT4_GPTQ = "int4-gptq"


_QUANT_METHODS = {
    "fp8": WeightFormat.FP8,
    "awq": WeightFormat.INT4_AWQ,
    "awq_marlin": WeightFormat.INT4_AWQ,
    "gptq": WeightFormat.INT4_GPTQ,
    "gptq_marlin": WeightFormat.INT4_GPTQ,
}


def parse_weight_format(value: str, shape: ModelShape) -> WeightFormat:
    """A `--weights` value ('auto' reads the config's quantization_config and dtype)."""
    if value == "auto":
        if shape.quantization_method is not None:
            found = _QUANT_METHODS.get(shape.quantization_method)
            if found is None:
                raise ValueError(
                    f"the config's quantization method {shape.quantization_method!r} is not "
                    f"one the planner sizes; pass --weights "
                    f"({', '.join(f.value for f in WeightFormat)})"
                )
            return found
        return WeightFormat.FP16 if shape.torch_dtype == "float16" else WeightFormat.BF16
    try:
        return WeightFormat(value)
    except ValueError:
        known = ", ".join(["auto", *(f.value for f in WeightFormat)])
        raise ValueError(f"unknown weight format {value!r}; known: {known}") from None


@dataclass(frozen=True, slots=True)
class WeightMemory:
    """Bytes of weights, in total and on each tensor-parallel rank."""

    weight_format: WeightFormat
    params_total: int
    total_bytes: int
    per_rank_bytes: int
    source: str  # "safetensors index", "safetensors headers" or "parameter count (estimate)"


def weight_memory(
    shape: ModelShape,
    weight_format: WeightFormat,
    tensor_parallel_size: int = 1,
    checkpoint_dir: Path | None = None,
) -> WeightMemory:
    """Weight bytes: the checkpoint's own size when it is on disk, else the parameter count."""
    params = shape.params
    on_disk = checkpoint_bytes(checkpoint_dir) if checkpoint_dir is not None else None
    if on_disk is not None:
        total, source = on_disk
        return WeightMemory(
            weight_format, params.total_params, total, cdiv_int(total, tensor_parallel_size), source
        )
    linear = _linear_bytes(params.linear_params, weight_format)
    # Embeddings, the LM head, norms and routers stay 16 bit in the formats sized here.
    sharded_16bit = 2 * (params.embedding_params + params.lm_head_params)
    replicated = 2 * params.other_params
    total = linear + sharded_16bit + replicated
    per_rank = cdiv_int(linear + sharded_16bit, tensor_parallel_size) + replicated
    return WeightMemory(
        weight_format, params.total_params, total, per_rank, "parameter count (estimate)"
    )


def cdiv_int(a: int, b: int) -> int:
    """Ceiling division."""
    return -(a // -b)


def _linear_bytes(linear_params: int, weight_format: WeightFormat) -> int:
    if weight_format in (WeightFormat.BF16, WeightFormat.FP16):
        return 2 * linear_params
    if weight_format is WeightFormat.FP8:
        return linear_params + 4 * cdiv_int(linear_params, _FP8_BLOCK)
    if weight_format is WeightFormat.INT8:
        return linear_params + 4 * cdiv_int(linear_params, 4096)  # a per-channel scale, roughly
    groups = cdiv_int(linear_params, _INT4_GROUP)
    return cdiv_int(linear_params, 2) + int(groups * _INT4_GROUP_OVERHEAD_BYTES)


def checkpoint_bytes(model_dir: Path) -> tuple[int, str] | None:
    """Bytes of the safetensors weights in a folder, or None when there are none."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            size = json.loads(index.read_text())["metadata"]["total_size"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"{index} has no metadata.total_size: {exc}") from exc
        return int(size), "safetensors index"
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        return None
    return sum(_safetensors_data_bytes(f) for f in files), "safetensors headers"


def _safetensors_data_bytes(path: Path) -> int:
    """Sum of tensor byte ranges from a safetensors header (the data itself is not read)."""
    with path.open("rb") as handle:
        prefix = handle.read(8)
        if len(prefix) != 8:
            raise ValueError(f"{path} is too short to be a safetensors file")
        (header_len,) = struct.unpack("<Q", prefix)
        header = json.loads(handle.read(header_len))
    total = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        start, end = entry["data_offsets"]
        total += end - start
    return total
