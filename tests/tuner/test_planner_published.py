"""Published model configs: KV bytes per token and parameter counts, arithmetic written out.

KV bytes per token follow vLLM's `AttentionSpec.page_size_bytes / block_size`:
layers * num_kv_heads * (head_size + head_size_v) * dtype bytes; for multi-head latent
attention `MLAAttentionSpec` stores one latent of kv_lora_rank + qk_rope_head_dim per layer
(num_kv_heads = 1, head_size_v = 0). Parameter counts are compared with the published figures.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpilot.tuner.planner import (
    AttentionKind,
    PlanInputs,
    kv_geometry,
    load_model_shape,
    make_plan,
)
from kvpilot.tuner.planner.weights import WeightFormat, weight_memory

CONFIGS = Path(__file__).parent / "configs"


def shape(name: str):
    return load_model_shape(CONFIGS / f"{name}.json")


def test_llama3_8b_gqa() -> None:
    s = shape("meta-llama_Meta-Llama-3-8B")
    assert s.attention_kind is AttentionKind.GQA
    # 32 layers * 8 KV heads * (128 + 128) * 2 bytes
    assert kv_geometry(s, block_size=16).bytes_per_token == 32 * 8 * (128 + 128) * 2 == 131_072
    # embed 128256*4096, head 128256*4096, per layer q 4096*4096 + k,v 2*4096*1024
    # + o 4096*4096 + MLP 3*4096*14336 + 2 norms 2*4096; final norm 4096
    per_layer = 4096 * 4096 + 2 * 4096 * 1024 + 4096 * 4096 + 3 * 4096 * 14336 + 2 * 4096
    expected = 2 * 128256 * 4096 + 32 * per_layer + 4096
    assert s.params.total_params == expected == 8_030_261_248  # the published 8.03B


def test_llama3_70b_gqa_with_tensor_parallelism() -> None:
    s = shape("meta-llama_Meta-Llama-3-70B")
    per_layer = 8192 * 8192 + 2 * 8192 * 1024 + 8192 * 8192 + 3 * 8192 * 28672 + 2 * 8192
    assert s.params.total_params == 2 * 128256 * 8192 + 80 * per_layer + 8192 == 70_553_706_496
    # 80 layers * 8 KV heads * 256 * 2 bytes; TP 4 keeps 2 KV heads per GPU; TP 16 replicates 1.
    assert kv_geometry(s, block_size=16).bytes_per_token == 80 * 8 * 256 * 2 == 327_680
    assert kv_geometry(s, block_size=16, tensor_parallel_size=4).bytes_per_token == 80 * 2 * 512
    assert kv_geometry(s, block_size=16, tensor_parallel_size=16).bytes_per_token == 80 * 1 * 512
    # bf16 weights: 2 bytes a parameter; TP 4 splits all but the norms.
    w1 = weight_memory(s, WeightFormat.BF16)
    assert w1.total_bytes == 2 * 70_553_706_496
    w4 = weight_memory(s, WeightFormat.BF16, tensor_parallel_size=4)
    norms = 2 * (80 * 2 * 8192 + 8192)
    assert w4.per_rank_bytes == -(-(w1.total_bytes - norms) // 4) + norms


def test_qwen2_7b_biases_and_disabled_window() -> None:
    s = shape("Qwen_Qwen2-7B")
    # use_sliding_window is false: the 131072 window is not applied.
    assert s.sliding_window_tokens is None
    # 28 layers * 4 KV heads * 256 * 2 bytes
    assert kv_geometry(s, block_size=16).bytes_per_token == 28 * 4 * 256 * 2 == 57_344
    q, kv = 3584, 4 * 128
    per_layer = (3584 * q + 2 * 3584 * kv + q * 3584) + (q + 2 * kv) + 3 * 3584 * 18944 + 2 * 3584
    assert s.params.total_params == 2 * 152064 * 3584 + 28 * per_layer + 3584 == 7_615_616_512


def test_mistral_7b_sliding_window() -> None:
    s = shape("mistralai_Mistral-7B-v0.1")
    assert (s.sliding_window_tokens, s.sliding_window_layers) == (4096, 32)
    assert s.params.total_params == 7_241_732_096  # the published 7.24B
    geo = kv_geometry(s, block_size=16)
    assert geo.bytes_per_token == 32 * 8 * 256 * 2 and geo.exact
    # Every layer slides: one request holds the window plus the tokens in flight, plus one
    # block (vLLM's SlidingWindowSpec), not the whole context.
    plan = make_plan(
        CONFIGS / "mistralai_Mistral-7B-v0.1.json",
        PlanInputs(gpu_memory_bytes=80 * 1024**3, max_model_len=32768, max_num_batched_tokens=2048),
    )
    assert plan.capacity.blocks_per_request == -(-(4096 - 1 + 2048) // 16) + 1 == 385
    # At 4096 tokens the window covers the whole request, and vLLM still adds its spare block.
    at_4k = [r.blocks_per_request for r in plan.context_table if r.max_model_len == 4096]
    assert at_4k == [4096 // 16 + 1]


def test_deepseek_v3_mla() -> None:
    s = shape("deepseek-ai_DeepSeek-V3")
    assert s.attention_kind is AttentionKind.MLA
    # 61 layers * (kv_lora_rank 512 + qk_rope_head_dim 64) * 2 bytes, no separate V
    assert kv_geometry(s, block_size=64).bytes_per_token == 61 * (512 + 64) * 2 == 70_272
    # MLA's latent is replicated on every TP rank: TP 8 does not shrink it.
    assert kv_geometry(s, block_size=64, tensor_parallel_size=8).bytes_per_token == 70_272
    # fp8 KV: one byte a number.
    assert kv_geometry(s, block_size=64, kv_cache_dtype="fp8").bytes_per_token == 61 * 576
    # Published: 671B main-model parameters plus 14B in the multi-token-prediction module.
    assert s.params.total_params == pytest.approx(671e9, rel=0.001)
    assert s.params.mtp_params == pytest.approx(14e9, rel=0.05)
    # The checkpoint is fp8: its matrices take a byte a parameter (plus block scales).
    plan = make_plan(
        CONFIGS / "deepseek-ai_DeepSeek-V3.json",
        PlanInputs(gpu_memory_bytes=141 * 1024**3, tensor_parallel_size=8),
    )
    assert plan.weights.weight_format is WeightFormat.FP8
    linear = s.params.linear_params
    sixteen_bit = 2 * (s.params.embedding_params + s.params.lm_head_params)
    assert plan.weights.per_rank_bytes == (
        -(-(linear + 4 * -(-linear // 16384) + sixteen_bit) // 8) + 2 * s.params.other_params
    )


def test_quantised_weight_formats_shrink_only_the_matrices() -> None:
    s = shape("meta-llama_Meta-Llama-3-8B")
    p = s.params
    keep = 2 * (p.embedding_params + p.lm_head_params + p.other_params)
    int4 = weight_memory(s, WeightFormat.INT4_AWQ).total_bytes
    # half a byte a weight, plus a 16-bit scale and a 4-bit zero per 128 weights
    assert int4 == p.linear_params // 2 + int(p.linear_params // 128 * 2.5) + keep
    int8 = weight_memory(s, WeightFormat.INT8).total_bytes
    assert keep + p.linear_params < int8 < keep + 1.01 * p.linear_params
    assert int4 < int8 < weight_memory(s, WeightFormat.BF16).total_bytes
