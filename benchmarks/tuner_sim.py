"""Simulated landscapes for the tuner benchmark: the product's objective over continuous knobs.

A landscape is one model on one device under one learned load. The knobs are the KV budget
(`kv_cache_memory_bytes`), `max_num_seqs` (1-512, log) and `max_num_batched_tokens`
(512-16384, log). The product's question: the least KV memory that still holds the SLO at
the learned load times the headroom (1.25).

The service model, in batches (sequences decoding at once):

* Inter-token latency grows with the batch: itl(B) = itl0 * (1 + B / B0) * stall(t), where
  stall grows with the prefill chunk `t` (large chunks stall decodes). The rate served at
  batch B is T(B) = B / (output_tokens * itl(B)); the target rate needs batch `need`.
* The inter-token SLO caps the useful batch at B_itl(t); a `max_num_seqs` above it lets
  bursts overshoot: capacity falls as (B_itl / s) ** itl_exponent.
* The KV budget holds B_kv = kv / bytes_per_sequence sequences; below the batch the
  scheduler admits, preemptions recompute: capacity falls as (B_kv / B) ** kv_exponent.
  This is the throughput knee, at the KV need K = need * bytes_per_sequence.
* A prefill chunk below the chunk knee delays first tokens: capacity times
  (t / knee) ** 0.3. The knee is about twice the prompt (arrivals come in bursts), drawn
  0.6-1.6x around it: a tuner's rule of thumb for the chunk errs against it.
* Start limit: kv + t * activation_bytes_per_token must fit the device's free memory, else the
  start fails (out of memory), costing the start-up and naming the free memory.

The planner's estimate of the knee is exact arithmetic on the model's config
(`kvpilot.tuner.planner.kv_geometry`: bytes per token) times the load's in-flight tokens; the
true knee is that estimate times a log-normal error (sd 0.2, clipped to +-0.35: start-up
profiling and the learned lengths err by about 30 %), so a planner prior cannot win by
construction. Exponents are calibrated on the measured CPU tables
(`data/landscape_chat-tight-capacity.csv`): halving KV at 8 sequences cut capacity 3.7x
(exponent 1.9; each landscape draws 1.6-2.6), and 32 sequences against 16 under the tight
inter-token SLO cut it 0.60x (exponent 0.73; each draws 0.4-1.0).

Every landscape is drawn from its seed alone (model, traffic mix, device, errors): seeds
0-11 are the development set, 400-411 the test set (replayed once, at af3d740: a change
after it needs a fresh set). Spent test sets, each replayed once: 100-111 (before the knee
search and the chunk knee's error), 200-211 (the knee search as frozen in aa353ec) and
300-311 (as frozen in 7606529)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import numpy as np

from kvpilot.tuner.planner.kv_sizing import KvGeometry, kv_geometry
from kvpilot.tuner.planner.model_shape import ModelShape, shape_from_config

DEV_SEEDS = tuple(range(12))
TEST_SEEDS = tuple(range(400, 412))
HEADROOM = 1.25  # the learned rate is replayed 1.25x faster (LearnConfig.headroom)
BLOCK_SIZE = 16
SEQS_RANGE = (1, 512)
BATCHED_RANGE = (512, 16384)
GIB = 1 << 30


def _llama(layers: int, hidden: int, heads: int, kv_heads: int, inter: int, vocab: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": layers,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "intermediate_size": inter,
        "vocab_size": vocab,
        "max_position_embeddings": 8192,
        "torch_dtype": "bfloat16",
    }


_MIXTRAL = {
    **_llama(32, 4096, 32, 8, 14336, 32000),
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
}


@dataclass(frozen=True, slots=True)
class ModelCase:
    """A real model config, served on one device: (name, config, TP, device GiB, itl0, B0)."""

    name: str
    config: dict
    tensor_parallel: int
    device_gib: float  # free memory per GPU after weights and the runtime, before KV
    itl0_s: float  # inter-token latency of a batch of one
    batch_half: float  # the batch at which inter-token latency doubles


MODELS = (
    ModelCase("llama3-8b", _llama(32, 4096, 32, 8, 14336, 128256), 1, 52.0, 0.012, 96.0),
    ModelCase("llama2-7b-mha", _llama(32, 4096, 32, 32, 11008, 32000), 1, 54.0, 0.012, 64.0),
    ModelCase("llama3-70b-tp4", _llama(80, 8192, 64, 8, 28672, 128256), 4, 38.0, 0.028, 128.0),
    ModelCase("mixtral-8x7b-tp2", _MIXTRAL, 2, 30.0, 0.018, 80.0),
)


@dataclass(frozen=True, slots=True)
class TrafficMix:
    """The learned load's shape: mean prompt and output tokens."""

    name: str
    prompt_tokens: int
    output_tokens: int


MIXES = (
    TrafficMix("chat", 512, 192),
    TrafficMix("rag", 3000, 256),
    TrafficMix("code", 1500, 600),
    TrafficMix("summarise", 6000, 300),
    TrafficMix("agent", 200, 80),
)


@dataclass(frozen=True, slots=True)
class Config:
    """One point of the space."""

    kv_bytes: int
    max_num_seqs: int
    batched_tokens: int


@dataclass(frozen=True, slots=True)
class Landscape:
    """One drawn landscape: what the product knows (planner, ranges) and the hidden truth."""

    seed: int
    model: str
    mix: str
    shape: ModelShape
    geometry: KvGeometry
    output_tokens: int
    prompt_tokens: int
    target_rps: float  # the learned rate times the headroom
    need: float  # the batch the target needs
    itl0_s: float
    batch_half: float
    itl_slo_s: float
    seq_bytes: float  # true KV bytes a sequence holds on average
    planner_knee_bytes: int  # the planner's estimate of the KV need
    free_bytes: int  # the start limit: KV plus activations above it fail to start
    activation_bytes_per_token: int
    kv_low: int  # the search range: one request of max_model_len ...
    kv_high: int  # ... to the configured upper end (above the start limit)
    kv_exponent: float
    itl_exponent: float
    deployed: Config  # the stable side's flags before tuning
    chunk_knee_tokens: float  # a prefill chunk below it delays first tokens

    @property
    def name(self) -> str:
        return f"s{self.seed}:{self.model}/{self.mix}"

    def starts(self, c: Config) -> bool:
        """Whether vLLM starts with these flags (the out-of-memory cliff)."""
        return c.kv_bytes + c.batched_tokens * self.activation_bytes_per_token <= self.free_bytes

    def capacity(self, c: Config) -> float:
        """Requests per second the configuration holds at the SLO (0 if it fails to start)."""
        if not self.starts(c):
            return 0.0
        return float(self._capacity(np.float64(c.kv_bytes), c.max_num_seqs, c.batched_tokens))

    def _capacity(self, kv: np.ndarray, seqs: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        stall = 1.0 + 0.08 * np.log2(np.maximum(1.0, tokens / 2048.0))
        b_itl = self.batch_half * (self.itl_slo_s / (self.itl0_s * stall) - 1.0)
        b_itl = np.maximum(b_itl, 0.5)
        batch = np.minimum(seqs, b_itl)
        batch = batch * np.minimum(1.0, b_itl / seqs) ** self.itl_exponent
        b_kv = kv / self.seq_bytes
        batch = batch * np.minimum(1.0, b_kv / np.minimum(seqs, b_itl)) ** self.kv_exponent
        batch = batch * np.minimum(1.0, tokens / self.chunk_knee_tokens) ** 0.3
        itl = self.itl0_s * (1.0 + batch / self.batch_half) * stall
        return batch / (self.output_tokens * itl)

    def least_feasible_blocks(self, margin: float = 1.0) -> int | None:
        """The fewest KV blocks that hold `target * margin` at some seqs and batched tokens
        (every integer max_num_seqs, 64 batched-token levels): the regret's reference."""
        seqs = np.arange(SEQS_RANGE[0], SEQS_RANGE[1] + 1, dtype=np.float64)
        tokens = np.unique(np.round(np.geomspace(*BATCHED_RANGE, 64)))
        s, t = np.meshgrid(seqs, tokens, indexing="ij")
        ok = s <= t  # vLLM refuses max_num_batched_tokens < max_num_seqs
        block = self.geometry.bytes_per_block
        high = (self.free_bytes - t * self.activation_bytes_per_token) // block
        goal = self.target_rps * margin
        ok &= high >= 1
        ok &= self._capacity(np.maximum(high, 1) * block, s, t) >= goal  # high < 1: refused above
        if not ok.any():
            return None
        low = np.zeros_like(high)  # infeasible at low, feasible at high, where ok
        for _ in range(64):
            if (high - low <= 1)[ok].all():
                break
            mid = (low + high) // 2
            good = self._capacity(np.maximum(mid, 0) * block, s, t) >= goal
            high = np.where(ok & good, mid, high)
            low = np.where(ok & ~good, mid, low)
        return int(high[ok].min())

    def blocks(self, c: Config) -> int:
        return c.kv_bytes // self.geometry.bytes_per_block


def draw_landscape(seed: int) -> Landscape:
    """The landscape of one seed: model, mix and every error drawn from it alone."""
    rng = random.Random(seed * 7919 + 17)
    case = MODELS[rng.randrange(len(MODELS))]
    mix = MIXES[rng.randrange(len(MIXES))]
    shape = shape_from_config(case.config)
    geo = kv_geometry(shape, block_size=BLOCK_SIZE, tensor_parallel_size=case.tensor_parallel)
    # The load: the batch its target needs, and an inter-token SLO that leaves room above it.
    need = math.exp(rng.uniform(math.log(6), math.log(120)))
    b_itl = need * rng.uniform(1.3, 4.0)
    itl_slo = case.itl0_s * (1.0 + b_itl / case.batch_half)
    itl_need = case.itl0_s * (1.0 + need / case.batch_half)
    target = need / (mix.output_tokens * itl_need)
    # KV: the planner's arithmetic on in-flight tokens (the prompt and half the answer), and
    # the truth within about 30 % of it.
    in_flight_tokens = mix.prompt_tokens + mix.output_tokens / 2
    planner_seq = in_flight_tokens * geo.bytes_per_token
    error = max(-0.35, min(0.35, rng.gauss(0.0, 0.2)))
    seq_bytes = planner_seq * math.exp(error)
    knee = need * seq_bytes
    # The device: free memory somewhere between 1.6x and 5x the knee (capped by the GPU),
    # and the configured upper end of the range above it: the cliff lies inside the range.
    free = int(min(case.device_gib * GIB, knee * math.exp(rng.uniform(math.log(1.6), math.log(5)))))
    activation = shape.hidden_size * 24 // case.tensor_parallel
    kv_high = int(free * rng.uniform(1.15, 1.6))
    kv_low = (8192 // BLOCK_SIZE + 1) * geo.bytes_per_block  # one request of 8192 tokens
    kv_low = min(kv_low, int(knee / 4))
    deployed = Config(int(0.9 * (free - 4096 * activation)), 128, 4096)
    kv_exponent, itl_exponent = rng.uniform(1.6, 2.6), rng.uniform(0.4, 1.0)
    chunk_knee = 2.0 * mix.prompt_tokens * math.exp(rng.uniform(math.log(0.6), math.log(1.6)))
    return Landscape(
        seed=seed,
        model=case.name,
        mix=mix.name,
        shape=shape,
        geometry=geo,
        output_tokens=mix.output_tokens,
        prompt_tokens=mix.prompt_tokens,
        target_rps=target,
        need=need,
        itl0_s=case.itl0_s,
        batch_half=case.batch_half,
        itl_slo_s=itl_slo,
        seq_bytes=seq_bytes,
        planner_knee_bytes=int(need * planner_seq),
        free_bytes=free,
        activation_bytes_per_token=activation,
        kv_low=max(geo.bytes_per_block * 2, kv_low),
        kv_high=kv_high,
        kv_exponent=kv_exponent,
        itl_exponent=itl_exponent,
        deployed=deployed,
        chunk_knee_tokens=chunk_knee,
    )
