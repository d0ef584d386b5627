"""A Hugging Face config.json turned into the architecture facts the memory planner needs."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

# Families whose MLP is a plain up/down projection rather than a gated (SwiGLU) one.
_NON_GATED_MLP_TYPES = frozenset({"gpt2", "gpt_neox", "opt", "falcon", "gpt_bigcode", "phi"})
# Families with a LayerNorm bias (two vectors per norm instead of one).
_BIASED_NORM_TYPES = frozenset({"gpt2", "gpt_neox", "opt", "falcon", "gpt_bigcode", "phi"})
_DECODER_SUFFIXES = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")


class ModelShapeError(ValueError):
    """The config cannot be planned for: not a decoder, or fields are missing or wrong."""


class AttentionKind(Enum):
    """How keys and values are stored per token."""

    MHA = "multi-head"
    GQA = "grouped-query"
    MQA = "multi-query"
    MLA = "multi-head latent"


@dataclass(frozen=True, slots=True)
class ParameterCount:
    """Parameters implied by the config, split by how quantisation treats them."""

    embedding_params: int
    lm_head_params: int
    linear_params: int  # attention and MLP/expert matrices: what weight quantisation shrinks
    other_params: int  # norms, biases, routers: kept in 16 bit
    mtp_params: int  # multi-token-prediction layers vLLM does not load for serving

    @property
    def total_params(self) -> int:
        """Parameters vLLM loads to serve (multi-token-prediction layers excluded)."""
        return self.embedding_params + self.lm_head_params + self.linear_params + self.other_params


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The decoder's attention geometry and size, read from config.json."""

    architecture: str
    model_type: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int  # for MLA: 1 (one latent vector per token)
    head_dim: int  # for MLA: kv_lora_rank + qk_rope_head_dim (the cached latent width)
    head_dim_v: int  # for MLA: 0 (the latent holds both)
    attention_kind: AttentionKind
    vocab_size: int
    intermediate_size: int
    max_position_embeddings: int
    torch_dtype: str | None
    sliding_window_tokens: int | None
    sliding_window_layers: int  # layers that use the window (0 without one)
    params: ParameterCount
    quantization_method: str | None  # from the config's quantization_config, if any

    @property
    def full_attention_layers(self) -> int:
        """Layers that keep KV for every token."""
        return self.num_layers - self.sliding_window_layers


def load_model_shape(path: str | Path) -> ModelShape:
    """Read a config.json (or the folder holding one) into a ModelShape."""
    config_path = config_file(path)
    try:
        raw = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelShapeError(f"{config_path} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ModelShapeError(f"{config_path} holds a JSON {type(raw).__name__}, not an object")
    return shape_from_config(raw)


def config_file(path: str | Path) -> Path:
    """The config.json named by a path to the file or to the folder that holds it."""
    candidate = Path(path)
    if candidate.is_dir():
        candidate = candidate / "config.json"
    if not candidate.is_file():
        raise ModelShapeError(f"no config.json at {candidate}")
    return candidate


def shape_from_config(raw: Mapping[str, Any]) -> ModelShape:
    """Turn a parsed config.json into a ModelShape; raises ModelShapeError with what is wrong."""
    architecture = _decoder_architecture(raw)
    text_config = raw.get("text_config")
    cfg: Mapping[str, Any] = text_config if isinstance(text_config, Mapping) else raw
    model_type = str(cfg.get("model_type") or raw.get("model_type") or "unknown")
    _require(cfg, ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size"))
    layers = _positive_int(cfg, "num_hidden_layers")
    hidden = _positive_int(cfg, "hidden_size")
    heads = _positive_int(cfg, "num_attention_heads")
    vocab = _positive_int(cfg, "vocab_size")
    max_pos = _max_positions(cfg)
    quant = raw.get("quantization_config")
    quant_method = str(quant.get("quant_method")) if isinstance(quant, Mapping) else None
    dtype = cfg.get("torch_dtype") or cfg.get("dtype") or raw.get("torch_dtype")

    if cfg.get("kv_lora_rank"):
        return _mla_shape(
            cfg,
            architecture,
            model_type,
            layers,
            hidden,
            heads,
            vocab,
            max_pos,
            dtype,
            quant_method,
        )

    kv_heads = (
        _positive_int(cfg, "num_key_value_heads") if cfg.get("num_key_value_heads") else heads
    )
    if heads % kv_heads:
        raise ModelShapeError(
            f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
        )
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    if kv_heads == heads:
        kind = AttentionKind.MHA
    elif kv_heads == 1:
        kind = AttentionKind.MQA
    else:
        kind = AttentionKind.GQA
    window, window_layers = _sliding_window(cfg, layers)
    intermediate = _positive_int(cfg, "intermediate_size")
    return ModelShape(
        architecture=architecture,
        model_type=model_type,
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        head_dim_v=head_dim,
        attention_kind=kind,
        vocab_size=vocab,
        intermediate_size=intermediate,
        max_position_embeddings=max_pos,
        torch_dtype=str(dtype) if dtype else None,
        sliding_window_tokens=window,
        sliding_window_layers=window_layers,
        params=_standard_params(cfg, model_type, layers, hidden, heads, kv_heads, head_dim, vocab),
        quantization_method=quant_method,
    )


def _decoder_architecture(raw: Mapping[str, Any]) -> str:
    archs = raw.get("architectures") or []
    if raw.get("is_encoder_decoder"):
        raise ModelShapeError(
            f"not a decoder-only model: {archs or raw.get('model_type')} is an encoder-decoder; "
            "the planner sizes vLLM's KV cache for decoder language models"
        )
    for arch in archs:
        if str(arch).endswith(_DECODER_SUFFIXES):
            return str(arch)
    if not archs:
        raise ModelShapeError(
            "config.json has no 'architectures' entry; cannot tell it is a decoder"
        )
    raise ModelShapeError(
        f"not a decoder model: architectures {list(archs)} (a decoder ends in "
        f"{', '.join(_DECODER_SUFFIXES)}); the planner sizes KV caches of decoder language models"
    )


def _require(cfg: Mapping[str, Any], names: tuple[str, ...]) -> None:
    missing = [name for name in names if cfg.get(name) in (None, "")]
    if missing:
        raise ModelShapeError(f"config.json lacks required field(s): {', '.join(missing)}")


def _positive_int(cfg: Mapping[str, Any], name: str) -> int:
    value = cfg.get(name)
    if value is None:
        raise ModelShapeError(f"config.json lacks required field: {name}")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ModelShapeError(f"config.json field {name} must be a positive integer, not {value!r}")
    return value


def _max_positions(cfg: Mapping[str, Any]) -> int:
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = cfg.get(name)
        if isinstance(value, int) and value > 0:
            return value
    raise ModelShapeError("config.json lacks max_position_embeddings (the model's longest context)")


def _sliding_window(cfg: Mapping[str, Any], layers: int) -> tuple[int | None, int]:
    """The window and how many layers use it, as vLLM reads them."""
    window = cfg.get("sliding_window")
    # Qwen2-style configs carry a window that is switched off.
    if not window or cfg.get("use_sliding_window") is False:
        return None, 0
    layer_types = cfg.get("layer_types")
    if isinstance(layer_types, list) and layer_types:
        count = sum(1 for kind in layer_types if kind == "sliding_attention")
        return (int(window), count) if count else (None, 0)
    if cfg.get("use_sliding_window") and isinstance(cfg.get("max_window_layers"), int):
        # Qwen2: layers from max_window_layers on use the window (transformers' rule).
        count = max(0, layers - cfg["max_window_layers"])
        return (int(window), count) if count else (None, 0)
    return int(window), layers


def _gated_mlp(model_type: str) -> int:
    return 2 if model_type in _NON_GATED_MLP_TYPES else 3


def _standard_params(
    cfg: Mapping[str, Any],
    model_type: str,
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    vocab: int,
) -> ParameterCount:
    """Parameters of a Llama-like decoder (dense or mixture-of-experts)."""
    q_width, kv_width = heads * head_dim, kv_heads * head_dim
    attn_linear = hidden * q_width + 2 * hidden * kv_width + q_width * hidden
    attn_bias = 0
    if cfg.get("attention_bias"):
        attn_bias = q_width + 2 * kv_width + hidden
    elif model_type.startswith("qwen2"):
        attn_bias = q_width + 2 * kv_width  # Qwen2 has q/k/v biases, no o bias
    qk_norm = 2 * head_dim if model_type.startswith("qwen3") else 0
    norm_vectors = 2 if model_type in _BIASED_NORM_TYPES else 1
    mats = _gated_mlp(model_type)
    intermediate = int(cfg["intermediate_size"])

    experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    mlp_linear_per_layer = [mats * hidden * intermediate] * layers
    router_per_layer = [0] * layers
    if experts > 1:
        moe_inter = int(cfg.get("moe_intermediate_size") or intermediate)
        shared_inter = int(cfg.get("shared_expert_intermediate_size") or 0)
        sparse_step = int(cfg.get("decoder_sparse_step") or 1)
        dense_layers = set(cfg.get("mlp_only_layers") or [])
        for i in range(layers):
            if i in dense_layers or (i + 1) % sparse_step:
                continue
            mlp_linear_per_layer[i] = experts * mats * hidden * moe_inter
            mlp_linear_per_layer[i] += mats * hidden * shared_inter
            router_per_layer[i] = hidden * experts + (hidden if shared_inter else 0)

    linear = layers * attn_linear + sum(mlp_linear_per_layer)
    other = (
        layers * (attn_bias + qk_norm + 2 * norm_vectors * hidden)
        + sum(router_per_layer)
        + norm_vectors * hidden
    )
    embedding = vocab * hidden
    lm_head = 0 if cfg.get("tie_word_embeddings") else vocab * hidden
    return ParameterCount(embedding, lm_head, linear, other, mtp_params=0)


def _mla_shape(
    cfg: Mapping[str, Any],
    architecture: str,
    model_type: str,
    layers: int,
    hidden: int,
    heads: int,
    vocab: int,
    max_pos: int,
    dtype: Any,
    quant_method: str | None,
) -> ModelShape:
    _require(cfg, ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"))
    kv_rank = int(cfg["kv_lora_rank"])
    rope = int(cfg["qk_rope_head_dim"])
    nope = int(cfg["qk_nope_head_dim"])
    v_dim = int(cfg["v_head_dim"])
    q_rank = cfg.get("q_lora_rank")

    q_head = nope + rope
    if q_rank:
        q_linear = hidden * int(q_rank) + int(q_rank) * heads * q_head
        q_norm = int(q_rank)
    else:
        q_linear, q_norm = hidden * heads * q_head, 0
    attn_linear = (
        q_linear
        + hidden * (kv_rank + rope)  # kv_a_proj_with_mqa
        + kv_rank * heads * (nope + v_dim)  # kv_b_proj
        + heads * v_dim * hidden  # o_proj
    )
    attn_other = q_norm + kv_rank  # q_a_layernorm, kv_a_layernorm

    intermediate = _positive_int(cfg, "intermediate_size")
    experts = int(cfg.get("n_routed_experts") or 0)
    moe_inter = int(cfg.get("moe_intermediate_size") or intermediate)
    shared = int(cfg.get("n_shared_experts") or 0)
    first_dense = int(cfg.get("first_k_dense_replace") or 0)
    freq = int(cfg.get("moe_layer_freq") or 1)
    # DeepSeek-V3 routers carry a score-correction bias per expert.
    router_bias = experts if cfg.get("topk_method") == "noaux_tc" else 0

    def layer_params(index: int) -> tuple[int, int]:
        is_moe = experts > 0 and index >= first_dense and index % freq == 0
        if is_moe:
            mlp = (experts + shared) * 3 * hidden * moe_inter
            router = hidden * experts + router_bias
        else:
            mlp, router = 3 * hidden * intermediate, 0
        return attn_linear + mlp, attn_other + router + 2 * hidden

    per_layer = [layer_params(i) for i in range(layers)]
    linear = sum(p[0] for p in per_layer)
    other = sum(p[1] for p in per_layer) + hidden
    mtp_layers = int(cfg.get("num_nextn_predict_layers") or 0)
    # An MTP layer as the checkpoint stores it: a full (MoE) decoder layer, two input norms,
    # a 2h->h projection, its own copies of the embedding and head, and a final norm.
    last = layer_params(layers)
    own_copies = 2 * vocab * hidden + hidden
    mtp = mtp_layers * (last[0] + last[1] + 2 * hidden + 2 * hidden * hidden + own_copies)
    params = ParameterCount(
        embedding_params=vocab * hidden,
        lm_head_params=0 if cfg.get("tie_word_embeddings") else vocab * hidden,
        linear_params=linear,
        other_params=other,
        mtp_params=mtp,
    )
    return ModelShape(
        architecture=architecture,
        model_type=model_type,
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_kv_heads=1,
        head_dim=kv_rank + rope,
        head_dim_v=0,
        attention_kind=AttentionKind.MLA,
        vocab_size=vocab,
        intermediate_size=intermediate,
        max_position_embeddings=max_pos,
        torch_dtype=str(dtype) if dtype else None,
        sliding_window_tokens=None,
        sliding_window_layers=0,
        params=params,
        quantization_method=quant_method,
    )
