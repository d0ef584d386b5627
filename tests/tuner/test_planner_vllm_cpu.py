"""The planner against a real CPU vLLM: with an explicit KV budget the figures agree exactly.

Each case writes a tiny random-weight `LlamaForCausalLM` config.json, starts the CPU vLLM with
`--kv-cache-memory-bytes` (one server at a time), reads `vllm:cache_config_info` from
`/metrics`, and compares `num_gpu_blocks` and `kv_cache_size_tokens` with the planner's
prediction. The cases vary KV heads (MHA, GQA, MQA), head size, layer count, block size
(multiples of 32, which the CPU attention backend prefers) and the KV dtype: the CPU
backend accepts `--kv-cache-dtype fp8` (e4m3 and e5m2) on x86 with AVX-512 or AMX, for head
sizes divisible by 32; on a machine without them those cases are skipped with the reason.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.rig.server import ServerSpec, VllmServer, free_port
from kvpilot.tuner.planner import PlanInputs, make_plan, predict_from_cache_config

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 1024

# (layers, attention heads, KV heads, head dim, block size, KV dtype, KV budget in bytes)
CASES = [
    pytest.param(2, 4, 2, 64, 32, "auto", 3_333_333, id="gqa-hd64-bs32-auto"),
    pytest.param(3, 8, 8, 32, 64, "fp8", 7_777_777, id="mha-hd32-bs64-fp8"),
    pytest.param(4, 6, 1, 96, 96, "auto", 5_000_321, id="mqa-hd96-bs96-auto"),
    pytest.param(2, 8, 4, 128, 32, "fp8_e5m2", 9_123_457, id="gqa-hd128-bs32-fp8e5m2"),
]


def _write_config(folder: Path, layers: int, heads: int, kv_heads: int, head_dim: int) -> Path:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": heads * head_dim,
        "intermediate_size": 2 * heads * head_dim,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": 1024,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    }
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _cache_config_labels(metrics_text: str) -> tuple[tuple[str, str], ...]:
    for family in text_string_to_metric_families(metrics_text):
        if family.name == "vllm:cache_config_info":
            return tuple(sorted(family.samples[0].labels.items()))
    raise AssertionError("the server exports no vllm:cache_config_info")


def _fp8_supported() -> bool:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return "avx512f" in flags or "amx_tile" in flags


@pytest.mark.parametrize(
    ("layers", "heads", "kv_heads", "head_dim", "block", "kv_dtype", "budget"), CASES
)
def test_prediction_equals_what_the_cpu_server_reports(
    tmp_path: Path,
    layers: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block: int,
    kv_dtype: str,
    budget: int,
) -> None:
    if kv_dtype != "auto" and not _fp8_supported():
        pytest.skip("the CPU backend's fp8 KV cache needs x86 with AVX-512 or AMX")
    model_dir = _write_config(tmp_path, layers, heads, kv_heads, head_dim)
    plan = make_plan(
        model_dir,
        PlanInputs(
            kv_cache_memory_bytes=budget,
            block_size=block,
            kv_cache_dtype=kv_dtype,
            max_model_len=MAX_MODEL_LEN,
        ),
    )
    spec = ServerSpec(
        port=free_port(),
        model_dir=model_dir,
        served_model_name="planner-probe",
        max_model_len=MAX_MODEL_LEN,
        block_size=block,
        kv_cache_memory_bytes=budget,
        plugin_enabled=False,
        extra_args=("--kv-cache-dtype", kv_dtype),
    )
    with VllmServer(spec) as server:
        metrics = httpx.get(f"{server.url}/metrics", timeout=10.0).text
    labels = _cache_config_labels(metrics)
    reported = dict(labels)

    assert reported["block_size"] == str(block)
    assert reported["cache_dtype"] == kv_dtype
    assert int(reported["num_gpu_blocks"]) == plan.capacity.num_blocks
    assert int(reported["kv_cache_size_tokens"]) == plan.capacity.kv_cache_size_tokens
    # The calibration path reaches the same verdict from the labels alone.
    calibration = predict_from_cache_config(model_dir, labels, max_model_len=MAX_MODEL_LEN)
    assert calibration.exact
    assert calibration.blocks_difference == 0
    assert calibration.tokens_difference == 0
    assert calibration.warning is None
    inferred = predict_from_cache_config(model_dir, labels)
    assert inferred.max_model_len == MAX_MODEL_LEN
    assert inferred.blocks_difference == 0
