"""Every metric family kvpilot exports, in one table: name, type, labels, meaning.

The agent's `/metrics` (`kvpilot.agent.app.exposition`) builds its families from this table
and refuses a name that is not in it; the tuner's families (`tuning_metrics`) take their specs
from it, for `/metrics` and for the OpenMetrics history alike; the dashboards and alert rules
read only names found here (tests/dashboards/test_build.py); the README's metric table is
generated from it (`kvpilot metrics-table`). It lives with the dashboards, below the agent, so
that both the agent and the dashboards can read it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

FamilyKind = Literal["gauge", "counter", "info"]
# Whether a family restates vLLM's own /metrics (as read, or as a rate or percentile over
# it), which a Prometheus that scrapes vLLM already has: `family` for every series,
# `vllm_counter` for its series labelled counter="vllm" (the others are the plugin's).
VllmCopy = Literal["none", "family", "vllm_counter"]

# `server` is the vLLM instance's name in kvpilot's configuration, `role` stable or canary.
SERVER = ("server", "role")
ENGINE = (*SERVER, "model_name", "engine")
GPU = ("gpu", "uuid")

_NAME = re.compile(r"kvpilot_[a-z0-9_]+")


@dataclass(frozen=True, slots=True)
class FamilySpec:
    """One family: its name as Prometheus stores the samples, kind, label names and help.

    Info families are gauges of 1 whose labels carry the values; a `version` label is the
    info's own key rather than a label of the family (`kvpilot_build_info`).
    """

    name: str
    kind: FamilyKind
    labels: tuple[str, ...]
    help: str
    vllm_copy: VllmCopy = "none"

    def __post_init__(self) -> None:
        problems = []
        if not _NAME.fullmatch(self.name):
            problems.append("not kvpilot_ followed by lower-case letters, digits and _")
        if (self.kind == "counter") != self.name.endswith("_total"):
            problems.append("counters, and only counters, end in _total")
        if self.kind == "info" and not self.name.endswith("_info"):
            problems.append("an info ends in _info")
        if len(set(self.labels)) != len(self.labels):
            problems.append(f"repeated labels {self.labels}")
        if not self.help.endswith("."):
            problems.append("the help is a sentence ending in a full stop")
        if self.vllm_copy == "vllm_counter" and "counter" not in self.labels:
            problems.append("vllm_copy='vllm_counter' needs a counter label")
        if problems:
            raise ValueError(f"metric {self.name!r}: {'; '.join(problems)}")

    @property
    def base_name(self) -> str:
        """The name without the `_total` / `_info` suffix its kind adds (OpenMetrics, and
        prometheus-client's family constructors)."""
        if self.kind == "counter":
            return self.name.removesuffix("_total")
        if self.kind == "info":
            return self.name.removesuffix("_info")
        return self.name


SPECS: tuple[FamilySpec, ...] = (
    # The agent itself.
    FamilySpec("kvpilot_build_info", "info", ("version",), "kvpilot's version."),
    FamilySpec(
        "kvpilot_collector_up",
        "gauge",
        (*SERVER, "source"),
        "1 when the source's last read succeeded, 0 when it failed (see errors_total).",
    ),
    FamilySpec(
        "kvpilot_collector_scrape_duration_seconds",
        "gauge",
        (*SERVER, "source"),
        "Time the source's last read took.",
    ),
    FamilySpec(
        "kvpilot_collector_errors_total",
        "counter",
        (*SERVER, "source", "reason"),
        "Failed reads by source and reason (refused, timeout, too_large, too_many_samples, "
        "http_status, not_metrics, parse_error, stats_disabled, unavailable, error), NVML "
        "call errors, and values refused at the edge, each made unknown (non_finite, "
        "out_of_range, negative, not_integer, duplicate_series, contradictory).",
    ),
    FamilySpec("kvpilot_ticks_total", "counter", (), "Collection ticks the agent has completed."),
    # The sidecar loop.
    FamilySpec(
        "kvpilot_alerts",
        "gauge",
        ("alertname", "state", "severity"),
        "Alerts the agent tracks, by state (pending, firing, resolved).",
    ),
    FamilySpec(
        "kvpilot_outbox_backlog",
        "gauge",
        (),
        "Notifications waiting in the outbox for delivery (queued or retrying).",
    ),
    FamilySpec(
        "kvpilot_notifications_total",
        "counter",
        ("notifier", "outcome"),
        "Notification deliveries by notifier and outcome (delivered, retry, deferred, given_up, "
        "dropped: past the outbox's bound).",
    ),
    FamilySpec(
        "kvpilot_remediations_total",
        "counter",
        ("server", "outcome"),
        "Remediations that ended, by server and outcome (succeeded, failed, skipped, vetoed, "
        "dry_run, ...).",
    ),
    FamilySpec(
        "kvpilot_remediation_circuit_open",
        "gauge",
        ("server",),
        "1 while the server's restart circuit breaker is open (restarts stopped, paged).",
    ),
    FamilySpec(
        "kvpilot_mode",
        "gauge",
        ("mode", "source"),
        "The live switch: 1 for the mode in force (paused, dry-run, armed), 0 for the others; "
        "source: the layer that set it (deployment, namespace, api, config).",
    ),
    FamilySpec(
        "kvpilot_remediation_in_progress",
        "gauge",
        (),
        "1 while a remediation (drain, restart, verify) is running.",
    ),
    FamilySpec(
        "kvpilot_tick_overruns_total",
        "counter",
        (),
        "Ticks that took longer than the interval (the next one waited; none piled up).",
    ),
    FamilySpec(
        "kvpilot_background_task_failures_total",
        "counter",
        ("task",),
        "Background tasks (delivery, remediation, start-up) that ended with an error; "
        "each is logged with its traceback.",
    ),
    FamilySpec(
        "kvpilot_state_write_errors_total",
        "counter",
        ("reason",),
        "Writes to the state database that failed (disk_full, read_only, io_error, busy, "
        "corrupt, ...); what a failed tick decided is retried on the next one.",
    ),
    FamilySpec(
        "kvpilot_config_last_reload_successful",
        "gauge",
        (),
        "1 when the latest configuration reload (SIGHUP or POST /-/reload) was applied, 0 "
        "when it was refused (kvpilot runs on the configuration it had).",
    ),
    FamilySpec(
        "kvpilot_unattended_canaries",
        "gauge",
        ("deployment",),
        "Canaries of the stable Deployment (namespace/name) that keep serving with no trial "
        "attending them: one no trial owns, or one whose traffic could not be pulled back "
        "(paged). 0 once cleaned up.",
    ),
    # vLLM /metrics, per engine.
    FamilySpec(
        "kvpilot_vllm_info",
        "info",
        (*SERVER, "version"),
        "The vLLM server's version.",
        vllm_copy="family",
    ),
    FamilySpec(
        "kvpilot_kv_usage_ratio",
        "gauge",
        ENGINE,
        "KV-cache usage, 0..1 (vLLM's figure).",
        vllm_copy="family",
    ),
    FamilySpec(
        "kvpilot_kv_blocks",
        "gauge",
        (*ENGINE, "state"),
        "KV blocks by state: capacity and free (from vLLM: num_gpu_blocks less the null block, "
        "and the usage ratio).",
        vllm_copy="family",
    ),
    FamilySpec(
        "kvpilot_kv_block_size_tokens", "gauge", ENGINE, "Tokens per KV block.", vllm_copy="family"
    ),
    FamilySpec(
        "kvpilot_requests_running",
        "gauge",
        ENGINE,
        "Requests in the running batch.",
        vllm_copy="family",
    ),
    FamilySpec(
        "kvpilot_requests_waiting",
        "gauge",
        ENGINE,
        "Requests waiting to be scheduled.",
        vllm_copy="family",
    ),
    FamilySpec(
        "kvpilot_requests_deferred",
        "gauge",
        ENGINE,
        "Waiting requests held back by a transient constraint (LoRA budget, KV transfer): "
        'vllm:num_requests_waiting_by_reason{reason="deferred"}.',
        vllm_copy="family",
    ),
    FamilySpec(
        "kvpilot_admission_rejections_total",
        "counter",
        ENGINE,
        "Requests refused by a queue limit (vllm:admission_rejections, every reason; counted "
        'in the API server without an engine label, so on engine="0").',
        vllm_copy="family",
    ),
    FamilySpec(
        "kvpilot_request_preemptions_total",
        "counter",
        ENGINE,
        "Preemptions of finished requests (the sum of vllm:request_num_preemptions): per "
        "finished request, the thrash each request saw.",
        vllm_copy="family",
    ),
    FamilySpec(
        "kvpilot_preemptions_total",
        "counter",
        (*ENGINE, "counter"),
        'Preemptions: counter="vllm" is vLLM\'s own (it lags until the victim produces '
        'output again), counter="kvpool" is the plugin\'s, counted where the scheduler preempts.',
        vllm_copy="vllm_counter",
    ),
    FamilySpec(
        "kvpilot_preemption_rate_per_second",
        "gauge",
        (*ENGINE, "counter"),
        "Preemptions per second over the agent's rate window.",
        vllm_copy="vllm_counter",
    ),
    FamilySpec(
        "kvpilot_prefix_cache_hit_ratio",
        "gauge",
        ENGINE,
        "Prefix-cache hits over queries in the agent's rate window.",
        vllm_copy="family",
    ),
    FamilySpec(
        "kvpilot_generation_tokens_per_second",
        "gauge",
        ENGINE,
        "Output tokens per second over the agent's rate window.",
        vllm_copy="family",
    ),
    FamilySpec(
        "kvpilot_iterations_per_second",
        "gauge",
        ENGINE,
        "Engine steps per second over the rate window: the progress heartbeat.",
        vllm_copy="family",
    ),
    FamilySpec(
        "kvpilot_latency_seconds",
        "gauge",
        (*ENGINE, "metric", "percentile"),
        "Latency percentiles (50, 95, 99) over the agent's window from vLLM's histograms: "
        "metric is ttft, inter_token, e2e or queue.",
        vllm_copy="family",
    ),
    # The memory planner against the live server.
    FamilySpec(
        "kvpilot_planner_kv_blocks_predicted",
        "gauge",
        ENGINE,
        "KV blocks the memory planner predicts for the server's own cache settings.",
    ),
    FamilySpec(
        "kvpilot_planner_kv_blocks_difference_ratio",
        "gauge",
        ENGINE,
        "Blocks the server reports over the planner's prediction, minus 1 (0: they agree; "
        "below 0: less memory than planned, e.g. activation peak, CUDA graphs, a neighbour).",
    ),
    # kvpool, the in-engine plugin.
    FamilySpec(
        "kvpilot_kvpool_blocks",
        "gauge",
        (*ENGINE, "state"),
        "KV blocks counted in the engine's block pool: state is total, free, free_cached, "
        "empty (block 0, the null block, never counted).",
    ),
    FamilySpec(
        "kvpilot_kvpool_longest_free_run_blocks",
        "gauge",
        ENGINE,
        "The longest run of consecutive free block ids.",
    ),
    FamilySpec(
        "kvpilot_fragmentation_ratio",
        "gauge",
        (*ENGINE, "source", "device", "rank"),
        "1 - largest contiguous free / total free. source=kv_blocks: block ids in the KV pool "
        "(absent while fewer than max(16, 2 % of total) blocks are free); source=allocator: "
        "the CUDA caching allocator's reserved segments, per device and worker rank.",
    ),
    FamilySpec(
        "kvpilot_internal_fragmentation_slots",
        "gauge",
        ENGINE,
        "Token slots reserved but unused in the last block of each running request.",
    ),
    FamilySpec(
        "kvpilot_token_occupancy_ratio",
        "gauge",
        (*ENGINE, "kv_group"),
        "Tokens held / (KV blocks in use x block size), per KV group, from the plugin at a "
        "step boundary (free cached blocks are not in use); absent while no block is in use.",
    ),
    FamilySpec(
        "kvpilot_last_preemption_timestamp_seconds",
        "gauge",
        ENGINE,
        "Wall time of the latest preemption, taken in the engine.",
    ),
    FamilySpec(
        "kvpilot_allocator_bytes",
        "gauge",
        (*SERVER, "device", "rank", "state"),
        "CUDA caching allocator in the process owning the device: state is reserved, "
        "allocated, inactive_split, free_in_reserved, largest_free_block.",
    ),
    FamilySpec(
        "kvpilot_memory_ledger_bytes",
        "gauge",
        (*SERVER, "device", "rank", "part", "source"),
        "Memory ledger from the kvpool plugin: disjoint parts of the device's used memory "
        "(CPU: the engine process's PSS), weights, cuda_graphs, cuda_context, kv_cache, "
        "allocator_slack and unattributed (used minus the others), each with its source.",
    ),
    FamilySpec(
        "kvpilot_memory_figure_bytes",
        "gauge",
        (*SERVER, "device", "rank", "figure"),
        "Memory ledger figures: used, kv_used (blocks held by requests), budget (vLLM's "
        "requested memory), drift (used minus budget), headroom (capacity minus budget), "
        "unallocated (free on the device).",
    ),
    # NVML.
    FamilySpec(
        "kvpilot_gpu_memory_bytes",
        "gauge",
        (*GPU, "state"),
        "GPU memory by state: total, used, free, reserved (reserved needs NVML's v2 call).",
    ),
    FamilySpec(
        "kvpilot_gpu_utilization_ratio",
        "gauge",
        (*GPU, "unit"),
        "GPU utilisation over NVML's last sample period: unit is sm or memory.",
    ),
    FamilySpec(
        "kvpilot_gpu_process_memory_bytes",
        "gauge",
        (*GPU, "pid", "owner", "server"),
        "Memory of each compute process on the GPU: owner is server (a process of the vLLM "
        "server named by the server label), neighbour, or unknown (a host PID this container "
        "cannot map: perhaps the server's own).",
    ),
    FamilySpec(
        "kvpilot_mig_memory_bytes",
        "gauge",
        ("gpu", "mig", "uuid", "state"),
        "MIG instance memory by state: total, used, free.",
    ),
    # dcgm-exporter, through Prometheus, where NVML is not visible.
    FamilySpec(
        "kvpilot_gpu_device_memory_bytes",
        "gauge",
        (*GPU, "mig", "source", "state"),
        "Device memory of the GPUs dcgm-exporter maps to this pod (source dcgm_exporter, "
        "read through Prometheus) by state: total, used, free, reserved. The whole device's "
        "memory, not the vLLM process's: on a shared GPU it includes the neighbours'.",
    ),
    # The tuner: trials, the best result, the live flags (rendered by tuning_metrics, which
    # also writes them as OpenMetrics history for a backfill).
    FamilySpec(
        "kvpilot_tuning_trial_goodput_tokens_per_second",
        "gauge",
        ("trial", "state", "verdict"),
        "Goodput under the SLO of each finished trial (kept for infeasible trials).",
    ),
    FamilySpec(
        "kvpilot_tuning_trial_preemption_rate_per_second",
        "gauge",
        ("trial",),
        "Preemptions per second over each finished trial's measurement window.",
    ),
    FamilySpec(
        "kvpilot_tuning_trial_info",
        "info",
        ("trial", "state", "verdict", "flags", "reason"),
        "Each trial's flags, state, canary verdict and reason.",
    ),
    FamilySpec(
        "kvpilot_tuning_best_goodput_tokens_per_second",
        "gauge",
        (),
        "The best goodput of a feasible trial so far.",
    ),
    FamilySpec(
        "kvpilot_tuning_trials_total", "counter", ("state",), "Trials finished, by final state."
    ),
    FamilySpec(
        "kvpilot_live_flags_info",
        "info",
        ("server", "flags", "source"),
        "The flags each stable server runs with: configured, or promoted by the tuner.",
    ),
    FamilySpec(
        "kvpilot_canary_metric",
        "gauge",
        ("trial", "metric", "side", "stat"),
        "A judged metric of a trial's canary and of its baseline (median of samples).",
    ),
)


def _index(specs: tuple[FamilySpec, ...]) -> Mapping[str, FamilySpec]:
    index = {spec.name: spec for spec in specs}
    if len(index) != len(specs):
        repeated = sorted({s.name for s in specs if sum(t.name == s.name for t in specs) > 1})
        raise ValueError(f"metric names listed twice: {repeated}")
    return MappingProxyType(index)


CATALOG: Mapping[str, FamilySpec] = _index(SPECS)


def specs(*names: str) -> tuple[FamilySpec, ...]:
    """The catalog's specs of `names`, in that order; a name not in the catalog raises."""
    missing = [name for name in names if name not in CATALOG]
    if missing:
        raise KeyError(f"not in the metric catalog: {missing}")
    return tuple(CATALOG[name] for name in names)


def markdown_table() -> str:
    """The README's table of every metric."""
    rows = ["| metric | type | labels | meaning |", "|---|---|---|---|"]
    marks = {
        "none": "",
        "family": " (vLLM's own)",
        "vllm_counter": ' (counter="vllm": vLLM\'s own)',
    }
    for spec in SPECS:
        labels = ", ".join(f"`{label}`" for label in spec.labels) or "-"
        meaning = f"{spec.help}{marks[spec.vllm_copy]}"
        rows.append(f"| `{spec.name}` | {spec.kind} | {labels} | {meaning} |")
    return "\n".join(rows)


TABLE_START, TABLE_END = "<!-- metric-table:start -->", "<!-- metric-table:end -->"


def replace_table(text: str) -> str:
    """`text` with the table between the metric-table markers regenerated."""
    head, _, rest = text.partition(TABLE_START)
    _, _, tail = rest.partition(TABLE_END)
    return f"{head}{TABLE_START}\n{markdown_table()}\n{TABLE_END}{tail}"
