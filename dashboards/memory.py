"""The *kvpilot / Memory* dashboard: GPU, KV cache, fragmentation, scheduling and latency."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as dashboard_builders
from grafana_foundation_sdk.models.dashboard import Dashboard, DashboardCursorSync

from kvpilot.dashboards.annotations import annotation_queries
from kvpilot.dashboards.overview import stat_row
from kvpilot.dashboards.panels import (
    BYTES,
    COUNT,
    ENGINE,
    GPU,
    INSTANCE,
    PER_SECOND,
    RATIO,
    SECONDS,
    VLLM_ENGINE,
    Item,
    Query,
    datasource_variable,
    query_variable,
    scope_variables,
    timeseries_panel,
)
from kvpilot.dashboards.vllm_signals import vllm_signals_row

UID = "kvpilot-memory"
TITLE = "kvpilot / Memory"
# Panels that need the CUDA caching allocator: empty where vLLM runs without CUDA.
ALLOCATOR_PANELS = frozenset({"Allocator memory"})


def _gpu_row() -> list[Item]:
    return [
        dashboard_builders.Row("GPU memory (NVML)"),
        timeseries_panel(
            "GPU memory: used, free, reserved",
            "Per GPU, from NVML. Reserved is the driver's share (NVML's v2 memory call).",
            [
                Query(
                    f'kvpilot_gpu_memory_bytes{{{GPU}, state=~"used|free|reserved"}}',
                    "GPU {{gpu}} {{state}} ({{instance}})",
                )
            ],
            unit=BYTES,
        ),
        timeseries_panel(
            "vLLM against its neighbours",
            "GPU memory of the vLLM server's processes and of every other process on the same "
            "GPU (time-slicing neighbours).",
            [
                Query(
                    "sum by (instance, gpu, owner, server) "
                    f"(kvpilot_gpu_process_memory_bytes{{{GPU}}})",
                    "GPU {{gpu}} {{owner}} {{server}} ({{instance}})",
                )
            ],
            unit=BYTES,
        ),
    ]


def _kv_row(fragmentation_threshold_ratio: float) -> list[Item]:
    blocks = f"kvpilot_kvpool_blocks{{{ENGINE}"
    by_engine = "sum by (instance, model_name, engine)"
    return [
        dashboard_builders.Row("KV cache"),
        timeseries_panel(
            "KV blocks: used, free, cached",
            "From the engine's block pool (kvpool plugin). Cached blocks are free blocks that "
            "still hold a prefix; the null block is never counted.",
            [
                Query(
                    f'{by_engine} ({blocks}, state="total"}}) '
                    f'- {by_engine} ({blocks}, state="free"}})',
                    "used {{model_name}}/{{engine}}",
                ),
                Query(f'{blocks}, state="free"}}', "free {{model_name}}/{{engine}}"),
                Query(f'{blocks}, state="free_cached"}}', "cached {{model_name}}/{{engine}}"),
            ],
            unit=COUNT,
        ),
        timeseries_panel(
            "KV cache usage",
            "vLLM's KV-cache usage ratio.",
            [Query(f"kvpilot_kv_usage_ratio{{{ENGINE}}}", "{{model_name}}/{{engine}}")],
            unit=RATIO,
            max_value=1,
        ),
        timeseries_panel(
            "Fragmentation rate",
            "1 - largest contiguous free / total free, per source: kv_blocks (block ids in the "
            "KV pool, absent while too few blocks are free) and allocator (the CUDA caching "
            "allocator, per device and rank). The line is the alert threshold.",
            [
                Query(
                    f"kvpilot_fragmentation_ratio{{{ENGINE}}}",
                    "{{source}} {{model_name}}/{{engine}} {{device}} {{rank}}",
                )
            ],
            unit=RATIO,
            max_value=1,
            threshold=fragmentation_threshold_ratio,
        ),
        timeseries_panel(
            "Internal fragmentation",
            "Token slots reserved but unused in the last block of each running request.",
            [
                Query(
                    f"kvpilot_internal_fragmentation_slots{{{ENGINE}}}",
                    "{{model_name}}/{{engine}}",
                )
            ],
            unit=COUNT,
        ),
    ]


def _allocator_row() -> list[Item]:
    return [
        dashboard_builders.Row("CUDA caching allocator"),
        timeseries_panel(
            "Allocator memory",
            "The CUDA caching allocator in the process owning each device (GPU only).",
            [
                Query(
                    f"kvpilot_allocator_bytes{{{INSTANCE}}}",
                    "{{state}} device {{device}} rank {{rank}}",
                )
            ],
            unit=BYTES,
            width=24,
        ),
    ]


def _ledger_row() -> list[Item]:
    return [
        dashboard_builders.Row("Memory ledger"),
        timeseries_panel(
            "Where the memory went",
            "The kvpool plugin's ledger, read inside the engine: weights, CUDA graphs, the CUDA "
            "context, the KV cache, allocator slack, and what no source names (unattributed); "
            "stacked they make the device's used memory (CPU: the engine process's PSS).",
            [
                Query(
                    f"kvpilot_memory_ledger_bytes{{{INSTANCE}}}",
                    "{{part}} ({{source}}) device {{device}}",
                )
            ],
            unit=BYTES,
            min_value=None,  # unattributed is negative while a part is not yet resident
        ),
        timeseries_panel(
            "KV use and drift from vLLM's budget",
            "KV bytes in blocks held by requests; used memory against the budget vLLM "
            "computed at start-up (drift), the headroom it leaves, and free device memory.",
            [
                Query(
                    f"kvpilot_memory_figure_bytes{{{INSTANCE}}}",
                    "{{figure}} device {{device}}",
                )
            ],
            unit=BYTES,
            min_value=None,  # drift is negative under budget
        ),
    ]


def _scheduling_row() -> list[Item]:
    return [
        dashboard_builders.Row("Scheduling"),
        timeseries_panel(
            "Preemption rate",
            'Preemptions per second: counter="kvpool" is counted where the scheduler '
            'preempts; counter="vllm" is vLLM\'s own, which lags.',
            [
                Query(
                    f"rate(kvpilot_preemptions_total{{{ENGINE}}}[$__rate_interval])",
                    "{{counter}} {{model_name}}/{{engine}}",
                )
            ],
            unit=PER_SECOND,
        ),
        timeseries_panel(
            "Requests running and waiting",
            "The running batch and the queue.",
            [
                Query(f"kvpilot_requests_running{{{ENGINE}}}", "running {{model_name}}/{{engine}}"),
                Query(f"kvpilot_requests_waiting{{{ENGINE}}}", "waiting {{model_name}}/{{engine}}"),
            ],
            unit=COUNT,
        ),
    ]


def _latency_panel(title: str, metric: str, vllm_histogram: str) -> Item:
    return timeseries_panel(
        title,
        "Quantiles over the agent's window (per instance), and p99 from vLLM's own histogram "
        "over every replica of the model.",
        [
            Query(
                f'kvpilot_latency_seconds{{{ENGINE}, metric="{metric}"}}',
                "p{{percentile}} {{model_name}}/{{engine}} ({{instance}})",
            ),
            Query(
                "histogram_quantile(0.99, sum by (le, model_name) "
                f"(rate({vllm_histogram}_bucket{{{VLLM_ENGINE}}}[$__rate_interval])))",
                "p99 {{model_name}} (vLLM histogram)",
            ),
        ],
        unit=SECONDS,
    )


def _latency_row() -> list[Item]:
    return [
        dashboard_builders.Row("Latency"),
        _latency_panel("Time to first token", "ttft", "vllm:time_to_first_token_seconds"),
        _latency_panel("Inter-token latency", "inter_token", "vllm:inter_token_latency_seconds"),
    ]


def _agent_row() -> list[Item]:
    return [
        dashboard_builders.Row("kvpilot"),
        timeseries_panel(
            "Collector health",
            "1 when the source's last read succeeded.",
            [Query(f"kvpilot_collector_up{{{INSTANCE}}}", "{{source}} ({{instance}})")],
            unit=COUNT,
            max_value=1,
            width=24,
            height=6,
        ),
    ]


def memory_dashboard(*, fragmentation_threshold_ratio: float = 0.30) -> Dashboard:
    """The Memory dashboard; the threshold line is the fragmentation rule's."""
    builder = (
        dashboard_builders.Dashboard(TITLE)
        .uid(UID)
        .description("GPU and KV-cache memory of vLLM servers watched by kvpilot.")
        .tags(["kvpilot", "vllm", "memory"])
        .editable()
        .tooltip(DashboardCursorSync.CROSSHAIR)
        .refresh("10s")
        .time("now-1h", "now")
        .timezone("browser")
        .with_variable(datasource_variable())
    )
    for variable in scope_variables("kvpilot_build_info"):
        builder = builder.with_variable(variable)
    builder = (
        builder.with_variable(
            query_variable(
                "model", "Model", f"label_values(kvpilot_kv_usage_ratio{{{INSTANCE}}}, model_name)"
            )
        )
        .with_variable(
            query_variable(
                "engine",
                "Engine",
                f'label_values(kvpilot_kv_usage_ratio{{{INSTANCE}, model_name=~"$model"}}, engine)',
            )
        )
        .with_variable(
            query_variable(
                "gpu", "GPU", f"label_values(kvpilot_gpu_memory_bytes{{{INSTANCE}}}, gpu)"
            )
        )
    )
    for annotation in annotation_queries():
        builder = builder.annotation(annotation)
    rows = (
        stat_row()
        + _gpu_row()
        + _kv_row(fragmentation_threshold_ratio)
        + _allocator_row()
        + _ledger_row()
        + _scheduling_row()
        + vllm_signals_row()
        + _latency_row()
        + _agent_row()
    )
    # Grafana keys panels by id: give each a stable one in layout order.
    for panel_id, item in enumerate(rows, start=1):
        if isinstance(item, dashboard_builders.Row):
            builder = builder.with_row(item.id(panel_id))
        else:
            builder = builder.with_panel(item.id(panel_id))
    return builder.build()
