"""Every metric family the agent exports, in one table: name, type, labels, meaning.

`exposition.py` builds families from this table (and refuses a name that is not in it);
the README's metric table is generated from it (`kvpilot metrics-table`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvpilot.dashboards import tuning_metrics

Kind = Literal["gauge", "counter", "info"]

# `server` is the vLLM instance's name in kvpilot's configuration, `role` stable or canary.
SERVER = ("server", "role")
ENGINE = (*SERVER, "model_name", "engine")
GPU = ("gpu", "uuid")


@dataclass(frozen=True, slots=True)
class MetricSpec:
    name: str
    kind: Kind
    labels: tuple[str, ...]
    help: str


_SPECS: tuple[MetricSpec, ...] = (
    # The agent itself.
    MetricSpec("kvpilot_build_info", "info", ("version",), "kvpilot's version."),
    MetricSpec(
        "kvpilot_collector_up",
        "gauge",
        (*SERVER, "source"),
        "1 when the source's last read succeeded, 0 when it failed (see errors_total).",
    ),
    MetricSpec(
        "kvpilot_collector_scrape_duration_seconds",
        "gauge",
        (*SERVER, "source"),
        "Time the source's last read took.",
    ),
    MetricSpec(
        "kvpilot_collector_errors_total",
        "counter",
        (*SERVER, "source", "reason"),
        "Failed reads by source and reason (refused, timeout, http_status, not_metrics, "
        "parse_error, stats_disabled, unavailable, error) and NVML call errors.",
    ),
    MetricSpec("kvpilot_ticks_total", "counter", (), "Collection ticks the agent has completed."),
    # The sidecar loop.
    MetricSpec(
        "kvpilot_alerts",
        "gauge",
        ("alertname", "state", "severity"),
        "Alerts the agent tracks, by state (pending, firing, resolved).",
    ),
    MetricSpec(
        "kvpilot_outbox_backlog",
        "gauge",
        (),
        "Notifications waiting in the outbox for delivery (queued or retrying).",
    ),
    MetricSpec(
        "kvpilot_notifications_total",
        "counter",
        ("notifier", "outcome"),
        "Notification deliveries by notifier and outcome (delivered, retry, deferred, given_up).",
    ),
    MetricSpec(
        "kvpilot_remediations_total",
        "counter",
        ("server", "outcome"),
        "Remediations that ended, by server and outcome (succeeded, failed, skipped, vetoed, "
        "dry_run, ...).",
    ),
    MetricSpec(
        "kvpilot_remediation_circuit_open",
        "gauge",
        ("server",),
        "1 while the server's restart circuit breaker is open (restarts stopped, paged).",
    ),
    MetricSpec(
        "kvpilot_remediation_in_progress",
        "gauge",
        (),
        "1 while a remediation (drain, restart, verify) is running.",
    ),
    # vLLM /metrics, per engine.
    MetricSpec("kvpilot_vllm_info", "info", (*SERVER, "version"), "The vLLM server's version."),
    MetricSpec("kvpilot_kv_usage_ratio", "gauge", ENGINE, "KV-cache usage, 0..1 (vLLM's figure)."),
    MetricSpec(
        "kvpilot_kv_blocks",
        "gauge",
        (*ENGINE, "state"),
        "KV blocks by state: capacity and free (from vLLM: num_gpu_blocks less the null block, "
        "and the usage ratio).",
    ),
    MetricSpec("kvpilot_kv_block_size_tokens", "gauge", ENGINE, "Tokens per KV block."),
    MetricSpec("kvpilot_requests_running", "gauge", ENGINE, "Requests in the running batch."),
    MetricSpec("kvpilot_requests_waiting", "gauge", ENGINE, "Requests waiting to be scheduled."),
    MetricSpec(
        "kvpilot_preemptions_total",
        "counter",
        (*ENGINE, "counter"),
        'Preemptions: counter="vllm" is vLLM\'s own (it lags until the victim produces '
        'output again), counter="kvpool" is the plugin\'s, counted where the scheduler preempts.',
    ),
    MetricSpec(
        "kvpilot_preemption_rate_per_second",
        "gauge",
        (*ENGINE, "counter"),
        "Preemptions per second over the agent's rate window.",
    ),
    MetricSpec(
        "kvpilot_prefix_cache_hit_ratio",
        "gauge",
        ENGINE,
        "Prefix-cache hits over queries in the agent's rate window.",
    ),
    MetricSpec(
        "kvpilot_generation_tokens_per_second",
        "gauge",
        ENGINE,
        "Output tokens per second over the agent's rate window.",
    ),
    MetricSpec(
        "kvpilot_iterations_per_second",
        "gauge",
        ENGINE,
        "Engine steps per second over the rate window: the progress heartbeat.",
    ),
    MetricSpec(
        "kvpilot_latency_seconds",
        "gauge",
        (*ENGINE, "metric", "percentile"),
        "Latency percentiles (50, 95, 99) over the agent's window from vLLM's histograms: "
        "metric is ttft, inter_token, e2e or queue.",
    ),
    # The memory planner against the live server.
    MetricSpec(
        "kvpilot_planner_kv_blocks_predicted",
        "gauge",
        ENGINE,
        "KV blocks the memory planner predicts for the server's own cache settings.",
    ),
    MetricSpec(
        "kvpilot_planner_kv_blocks_difference_ratio",
        "gauge",
        ENGINE,
        "Blocks the server reports over the planner's prediction, minus 1 (0: they agree; "
        "below 0: less memory than planned, e.g. activation peak, CUDA graphs, a neighbour).",
    ),
    # kvpool, the in-engine plugin.
    MetricSpec(
        "kvpilot_kvpool_blocks",
        "gauge",
        (*ENGINE, "state"),
        "KV blocks counted in the engine's block pool: state is total, free, free_cached, "
        "empty (block 0, the null block, never counted).",
    ),
    MetricSpec(
        "kvpilot_kvpool_longest_free_run_blocks",
        "gauge",
        ENGINE,
        "The longest run of consecutive free block ids.",
    ),
    MetricSpec(
        "kvpilot_fragmentation_ratio",
        "gauge",
        (*ENGINE, "source", "device", "rank"),
        "1 - largest contiguous free / total free. source=kv_blocks: block ids in the KV pool "
        "(absent while fewer than max(16, 2 % of total) blocks are free); source=allocator: "
        "the CUDA caching allocator's reserved segments, per device and worker rank.",
    ),
    MetricSpec(
        "kvpilot_internal_fragmentation_slots",
        "gauge",
        ENGINE,
        "Token slots reserved but unused in the last block of each running request.",
    ),
    MetricSpec(
        "kvpilot_last_preemption_timestamp_seconds",
        "gauge",
        ENGINE,
        "Wall time of the latest preemption, taken in the engine.",
    ),
    MetricSpec(
        "kvpilot_allocator_bytes",
        "gauge",
        (*SERVER, "device", "rank", "state"),
        "CUDA caching allocator in the process owning the device: state is reserved, "
        "allocated, inactive_split, free_in_reserved, largest_free_block.",
    ),
    # NVML.
    MetricSpec(
        "kvpilot_gpu_memory_bytes",
        "gauge",
        (*GPU, "state"),
        "GPU memory by state: total, used, free, reserved (reserved needs NVML's v2 call).",
    ),
    MetricSpec(
        "kvpilot_gpu_utilization_ratio",
        "gauge",
        (*GPU, "unit"),
        "GPU utilisation over NVML's last sample period: unit is sm or memory.",
    ),
    MetricSpec(
        "kvpilot_gpu_process_memory_bytes",
        "gauge",
        (*GPU, "pid", "owner", "server"),
        "Memory of each compute process on the GPU: owner is server (a process of the vLLM "
        "server named by the server label) or neighbour.",
    ),
    MetricSpec(
        "kvpilot_mig_memory_bytes",
        "gauge",
        ("gpu", "mig", "uuid", "state"),
        "MIG instance memory by state: total, used, free.",
    ),
)

# The tuning families are defined once, beside the Tuning dashboard that reads them.
_SPECS += tuple(
    MetricSpec(spec.name, spec.kind, spec.labels, spec.help) for spec in tuning_metrics.SPECS
)

CATALOG: dict[str, MetricSpec] = {spec.name: spec for spec in _SPECS}


def markdown_table() -> str:
    """The README's table of every metric."""
    rows = ["| metric | type | labels | meaning |", "|---|---|---|---|"]
    for spec in _SPECS:
        labels = ", ".join(f"`{label}`" for label in spec.labels) or "-"
        rows.append(f"| `{spec.name}` | {spec.kind} | {labels} | {spec.help} |")
    return "\n".join(rows)


TABLE_START, TABLE_END = "<!-- metric-table:start -->", "<!-- metric-table:end -->"


def replace_table(text: str) -> str:
    """`text` with the table between the metric-table markers regenerated."""
    head, _, rest = text.partition(TABLE_START)
    _, _, tail = rest.partition(TABLE_END)
    return f"{head}{TABLE_START}\n{markdown_table()}\n{TABLE_END}{tail}"
