"""vLLM's own memory signals beyond usage and preemption counts: why requests wait, how often
a finished request was preempted, how long KV blocks live and idle before eviction
(`--kv-cache-metrics`), the sleep state, and CPU KV offload (SimpleCPUOffloadConnector)."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as dashboard_builders

from kvpilot.dashboards.panels import (
    COUNT,
    PER_SECOND,
    SECONDS,
    VLLM_ENGINE,
    Item,
    Query,
    timeseries_panel,
)

# Panels empty unless vLLM runs with the option or connector that exports their families.
NEEDS_KV_CACHE_METRICS = frozenset({"KV block lifetime and idle before eviction"})
NEEDS_CPU_OFFLOAD = frozenset({"CPU KV offload"})
# vLLM 0.32's families these panels read (checked against vLLM's source by the tests).
FAMILIES = (
    "vllm:num_requests_waiting_by_reason",
    "vllm:request_num_preemptions",
    "vllm:kv_block_lifetime_seconds",
    "vllm:kv_block_idle_before_evict_seconds",
    "vllm:engine_sleep_state",
    "vllm:simple_kv_offload_load_blocks_total",
    "vllm:simple_kv_offload_save_outcomes_total",
)
_BY_MODEL = "sum by (model_name)"


def _rate(family: str, suffix: str) -> str:
    return f"rate({family}_{suffix}{{{VLLM_ENGINE}}}[$__rate_interval])"


def _quantile(q: float, family: str) -> str:
    return f"histogram_quantile({q}, sum by (le, model_name) ({_rate(family, 'bucket')}))"


def _residency(family: str, name: str) -> list[Query]:
    return [
        Query(_quantile(0.5, family), f"{name} p50 {{{{model_name}}}}"),
        Query(_quantile(0.99, family), f"{name} p99 {{{{model_name}}}}"),
    ]


def vllm_signals_row() -> list[Item]:
    lifetime = "vllm:kv_block_lifetime_seconds"
    idle = "vllm:kv_block_idle_before_evict_seconds"
    preemptions = "vllm:request_num_preemptions"
    return [
        dashboard_builders.Row("vLLM memory signals"),
        timeseries_panel(
            "Waiting requests by reason",
            "capacity: waiting for KV blocks or batch room; deferred: held back by a transient "
            "constraint (LoRA budget, KV transfer). They sum to vLLM's waiting count.",
            [
                Query(
                    f"vllm:num_requests_waiting_by_reason{{{VLLM_ENGINE}}}",
                    "{{reason}} {{model_name}}/{{engine}}",
                )
            ],
            unit=COUNT,
        ),
        timeseries_panel(
            "Preemptions per finished request",
            "How many times requests that finished were preempted on the way: the mean, and "
            "p99 from vLLM's histogram. Above 0 the KV cache is too small for the batch.",
            [
                Query(
                    f"{_BY_MODEL} ({_rate(preemptions, 'sum')}) "
                    f"/ {_BY_MODEL} ({_rate(preemptions, 'count')})",
                    "mean {{model_name}}",
                ),
                Query(_quantile(0.99, preemptions), "p99 {{model_name}}"),
            ],
            unit=COUNT,
        ),
        timeseries_panel(
            "KV block lifetime and idle before eviction",
            "From allocation to eviction, and idle before eviction, of sampled KV blocks "
            "(vLLM with --kv-cache-metrics; --kv-cache-metrics-sample sets the share). Short "
            "idle times mean cached prefixes are evicted before they can be reused.",
            [*_residency(lifetime, "lifetime"), *_residency(idle, "idle")],
            unit=SECONDS,
        ),
        timeseries_panel(
            "Engine sleep state",
            "1 on the engine's state: awake, weights_offloaded (sleep level 1) or discard_all "
            "(level 2). A sleeping engine holds no KV cache.",
            [
                Query(
                    f"vllm:engine_sleep_state{{{VLLM_ENGINE}}}",
                    "{{sleep_state}} {{model_name}}/{{engine}}",
                )
            ],
            unit=COUNT,
            max_value=1,
        ),
        timeseries_panel(
            "CPU KV offload",
            "SimpleCPUOffloadConnector (a GPU server with CPU KV offload): blocks restored "
            "from CPU memory per second (prefill avoided), and stores per second by outcome.",
            [
                Query(
                    f"{_BY_MODEL} ({_rate('vllm:simple_kv_offload_load_blocks', 'total')})",
                    "restored {{model_name}}",
                ),
                Query(
                    "sum by (model_name, outcome) "
                    f"({_rate('vllm:simple_kv_offload_save_outcomes', 'total')})",
                    "stored: {{outcome}} {{model_name}}",
                ),
            ],
            unit=PER_SECOND,
            width=24,
        ),
    ]
