"""Bad input gets a message that says what is wrong, what does not fit, and by how much."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpilot.tuner.planner import (
    ModelShapeError,
    PlanError,
    PlanInputs,
    make_plan,
    shape_from_config,
)

GIB = 1024**3
CONFIGS = Path(__file__).parent / "configs"
LLAMA = json.loads((CONFIGS / "meta-llama_Meta-Llama-3-8B.json").read_text())


def test_encoder_is_not_a_decoder() -> None:
    bert = {"architectures": ["BertForMaskedLM"], "model_type": "bert", "hidden_size": 768}
    with pytest.raises(
        ModelShapeError, match=r"not a decoder model: architectures \['BertForMaskedLM'\]"
    ):
        shape_from_config(bert)


def test_encoder_decoder_is_refused() -> None:
    t5 = {"architectures": ["T5ForConditionalGeneration"], "is_encoder_decoder": True}
    with pytest.raises(ModelShapeError, match="encoder-decoder"):
        shape_from_config(t5)


def test_missing_fields_are_all_named() -> None:
    broken = {k: v for k, v in LLAMA.items() if k not in ("hidden_size", "vocab_size")}
    with pytest.raises(
        ModelShapeError, match="lacks required field\\(s\\): hidden_size, vocab_size"
    ):
        shape_from_config(broken)


def test_missing_context_length_is_named() -> None:
    broken = {k: v for k, v in LLAMA.items() if k != "max_position_embeddings"}
    with pytest.raises(ModelShapeError, match="max_position_embeddings"):
        shape_from_config(broken)


def test_wrong_types_are_named() -> None:
    with pytest.raises(ModelShapeError, match="num_hidden_layers must be a positive integer"):
        shape_from_config({**LLAMA, "num_hidden_layers": "32"})
    with pytest.raises(ModelShapeError, match="not a multiple of num_key_value_heads 5"):
        shape_from_config({**LLAMA, "num_key_value_heads": 5})


def test_incomplete_mla_config_is_named() -> None:
    with pytest.raises(ModelShapeError, match="qk_rope_head_dim"):
        shape_from_config({**LLAMA, "kv_lora_rank": 512})


def test_no_config_file(tmp_path: Path) -> None:
    with pytest.raises(ModelShapeError, match=r"no config\.json at"):
        make_plan(tmp_path, PlanInputs(gpu_memory_bytes=80 * GIB))


def test_invalid_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelShapeError, match="not valid JSON"):
        make_plan(tmp_path, PlanInputs(gpu_memory_bytes=80 * GIB))


def test_gpu_too_small_for_the_weights_says_by_how_much() -> None:
    with pytest.raises(PlanError) as caught:
        make_plan(
            CONFIGS / "meta-llama_Meta-Llama-3-70B.json", PlanInputs(gpu_memory_bytes=24 * GIB)
        )
    message = str(caught.value)
    weights = 2 * 70_553_706_496
    requested = 24 * GIB * 0.9
    assert f"{weights / GIB:.2f} GiB per GPU" in message
    assert f"short by {(weights - requested) / GIB:.2f} GiB" in message


def test_no_room_left_for_kv_is_a_problem_not_a_crash() -> None:
    # Llama-3-8B in bf16 on a 16 GiB GPU: the weights fit in 0.99 of it, the KV does not.
    plan = make_plan(
        CONFIGS / "meta-llama_Meta-Llama-3-8B.json",
        PlanInputs(gpu_memory_bytes=16 * GIB, gpu_memory_utilization=0.99),
    )
    assert plan.capacity.num_blocks == 0
    assert plan.problems and "no memory left for the KV cache" in plan.problems[0]
    assert plan.utilization.min_gpu_memory_utilization is None
    assert "does not fit" in (plan.utilization.min_reason or "")


def test_no_gpu_size_and_no_budget() -> None:
    with pytest.raises(PlanError, match="pass --gpu-memory"):
        make_plan(CONFIGS / "meta-llama_Meta-Llama-3-8B.json", PlanInputs())


def test_unknown_dtypes_are_refused() -> None:
    config = CONFIGS / "meta-llama_Meta-Llama-3-8B.json"
    with pytest.raises(ValueError, match="unknown KV-cache dtype 'int3'"):
        make_plan(config, PlanInputs(gpu_memory_bytes=80 * GIB, kv_cache_dtype="int3"))
    with pytest.raises(ValueError, match="unknown weight format 'int2'"):
        make_plan(config, PlanInputs(gpu_memory_bytes=80 * GIB, weights="int2"))
