"""The agent's own `/metrics`: kvpilot_* families built from the latest tick.

This is the only place in the agent that uses prometheus-client. Families are rebuilt from
the latest snapshot on every scrape, so series whose labels disappeared (an engine gone, a
GPU process exited) vanish with them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Literal, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

import kvpilot
from kvpilot.agent.mode import Mode
from kvpilot.agent.readings.derive import EngineFigures
from kvpilot.agent.readings.snapshot import SOURCES
from kvpilot.agent.runtimes.kubernetes.unattended import UNATTENDED
from kvpilot.agent.tick.ticker import TickState
from kvpilot.agent.tick.views import ServerView, SidecarCounters
from kvpilot.collectors.dcgm import DcgmSnapshot
from kvpilot.collectors.errors import SourceError
from kvpilot.collectors.gpu_samples import GpuProcess, GpuSample, NvmlSnapshot
from kvpilot.collectors.kvpool.client import KvPoolScrape
from kvpilot.collectors.vllm_metrics import VllmScrape
from kvpilot.dashboards import tuning_metrics
from kvpilot.dashboards.metric_catalog import CATALOG

ClientFamily = GaugeMetricFamily | CounterMetricFamily | InfoMetricFamily


VllmFamilies = Literal["include", "exclude"]


class _Families:
    """Families declared in the catalog, created on first use, in catalog order; with
    `vllm_families="exclude"`, the series the catalog marks as vLLM's own are left out."""

    def __init__(self, vllm_families: VllmFamilies = "include") -> None:
        self._made: dict[str, ClientFamily] = {}
        self._drop_vllm = vllm_families == "exclude"

    def add(self, name: str, labels: Iterable[str], value: float | None) -> None:
        if value is None:
            return  # unknown stays absent; never a substituted zero
        labels = list(labels)
        if self._is_dropped(name, labels):
            return
        family = self._family(name)
        assert not isinstance(family, InfoMetricFamily)
        family.add_metric(labels, value)

    def info(self, name: str, labels: Iterable[str], values: dict[str, str]) -> None:
        labels = list(labels)
        if self._is_dropped(name, labels):
            return
        family = self._family(name)
        assert isinstance(family, InfoMetricFamily)
        family.add_metric(labels, values)

    def _is_dropped(self, name: str, labels: list[str]) -> bool:
        if not self._drop_vllm:
            return False
        spec = CATALOG[name]
        if spec.vllm_copy == "vllm_counter":
            return labels[spec.labels.index("counter")] == "vllm"
        return spec.vllm_copy == "family"

    def _family(self, name: str) -> ClientFamily:
        if name not in self._made:
            spec = CATALOG[name]
            base = spec.base_name
            labels = list(spec.labels)
            if spec.kind == "info":  # the info's own keys are values, not family labels
                labels = [label for label in labels if label != "version"]
            kinds = {"gauge": GaugeMetricFamily, "counter": CounterMetricFamily}
            maker = kinds.get(spec.kind, InfoMetricFamily)
            if spec.kind == "info" and "version" not in spec.labels:
                # An info whose every key is a label: a gauge of 1, as the text format has it.
                maker, base = GaugeMetricFamily, name
            self._made[name] = maker(base, spec.help, labels=labels)
        return self._made[name]

    def __iter__(self) -> Iterator[ClientFamily]:
        return iter(self._made.values())


class ReloadOutcome(Protocol):
    """What the exposition reads of the reloader: whether the latest reload was applied."""

    @property
    def last_successful(self) -> bool: ...


class AgentCollector(Collector):
    """A prometheus-client collector over the latest tick of every watched server.

    GPU families come from the first server's snapshot: the agent takes one NVML reading
    per tick and every server's snapshot holds that same reading.
    """

    def __init__(
        self,
        servers: Callable[[], Sequence[ServerView]],
        extra: Callable[[_Families], None] | None = None,
        vllm_families: VllmFamilies = "include",
    ) -> None:
        self._servers = servers
        self._extra = extra
        self._vllm_families = vllm_families

    def collect(self) -> Iterator[ClientFamily]:
        out = _Families(self._vllm_families)
        out.info("kvpilot_build_info", (), {"version": kvpilot.__version__})
        servers = list(self._servers())
        out.add("kvpilot_ticks_total", (), max((v.state.ticks_total for v in servers), default=0))
        for view in servers:
            _server(out, view)
        _gpus(out, servers)
        if self._extra is not None:
            self._extra(out)
        yield from out


def _gpus(out: _Families, servers: Sequence[ServerView]) -> None:
    snapshot = servers[0].state.latest if servers else None
    if snapshot is not None and isinstance(snapshot.dcgm, DcgmSnapshot):
        _dcgm(out, snapshot.dcgm)
    if snapshot is None or not isinstance(snapshot.nvml, NvmlSnapshot):
        return
    owners = {pid: view.server for view in servers for pid in view.pids}
    for gpu in snapshot.nvml.gpus:
        _gpu(out, gpu, owners)


def _server(out: _Families, view: ServerView) -> None:
    state, server = view.state, view.labels
    for (source, reason), count in sorted(state.errors_total.items()):
        out.add("kvpilot_collector_errors_total", (*server, source, reason), count)
    snapshot = state.latest
    if snapshot is not None:
        for source in SOURCES:
            value = getattr(snapshot, source)
            if value is None:
                continue  # not configured
            up = 0.0 if isinstance(value, SourceError) else 1.0
            out.add("kvpilot_collector_up", (*server, source), up)
            duration = snapshot.duration_s(source)
            out.add("kvpilot_collector_scrape_duration_seconds", (*server, source), duration)
        if isinstance(snapshot.vllm, VllmScrape):
            _vllm(out, server, snapshot.vllm)
        if isinstance(snapshot.kvpool, KvPoolScrape):
            _kvpool(out, server, snapshot.kvpool)
    for figures in state.figures:
        _figures(out, server, figures)
    for item in state.calibrations:
        if item.calibration is None:
            continue
        key = (*server, item.model_name, item.engine)
        ratio = item.calibration.blocks_ratio
        out.add("kvpilot_planner_kv_blocks_predicted", key, item.calibration.predicted_num_blocks)
        out.add(
            "kvpilot_planner_kv_blocks_difference_ratio",
            key,
            None if ratio is None else ratio - 1.0,
        )


def _vllm(out: _Families, server: tuple[str, str], scrape: VllmScrape) -> None:
    if scrape.vllm_version:
        out.info("kvpilot_vllm_info", server, {"version": scrape.vllm_version})
    for e in scrape.engines:
        key = (*server, e.model_name, e.engine)
        out.add("kvpilot_kv_usage_ratio", key, e.kv_usage_ratio)
        out.add("kvpilot_kv_blocks", (*key, "capacity"), e.blocks_total)
        out.add("kvpilot_kv_blocks", (*key, "free"), e.blocks_free)
        out.add("kvpilot_kv_block_size_tokens", key, e.block_size)
        out.add("kvpilot_requests_running", key, e.requests_running)
        out.add("kvpilot_requests_waiting", key, e.requests_waiting)
        out.add("kvpilot_requests_deferred", key, e.requests_deferred)
        out.add("kvpilot_admission_rejections_total", key, e.admission_rejections_total)
        out.add("kvpilot_request_preemptions_total", key, e.request_preemptions_sum)
        out.add("kvpilot_preemptions_total", (*key, "vllm"), e.preemptions_total)


def _kvpool(out: _Families, server: tuple[str, str], scrape: KvPoolScrape) -> None:
    for e in scrape.engines:
        key = (*server, e.model_name, e.engine)
        for state, value in (
            ("total", e.blocks_total),
            ("free", e.blocks_free),
            ("free_cached", e.blocks_free_cached),
            ("empty", e.blocks_empty),
        ):
            out.add("kvpilot_kvpool_blocks", (*key, state), value)
        out.add("kvpilot_kvpool_longest_free_run_blocks", key, e.longest_free_run_blocks)
        ratio = e.fragmentation.ratio if e.fragmentation is not None else None
        out.add("kvpilot_fragmentation_ratio", (*key, "kv_blocks", "", ""), ratio)
        out.add("kvpilot_internal_fragmentation_slots", key, e.internal_fragmentation_slots)
        for group in e.occupancy:
            out.add("kvpilot_token_occupancy_ratio", (*key, group.kv_group), group.ratio)
        out.add("kvpilot_preemptions_total", (*key, "kvpool"), e.preemptions_total)
        out.add("kvpilot_last_preemption_timestamp_seconds", key, e.last_preemption_wall_s)
    for a in scrape.allocators:
        key = (*server, a.device, a.rank)
        out.add(
            "kvpilot_fragmentation_ratio",
            (*server, "", "", "allocator", a.device, a.rank),
            a.fragmentation_ratio,
        )
        for state, value in (
            ("reserved", a.reserved_bytes),
            ("allocated", a.allocated_bytes),
            ("inactive_split", a.inactive_split_bytes),
            ("free_in_reserved", a.free_in_reserved_bytes),
            ("largest_free_block", a.largest_free_block_bytes),
        ):
            out.add("kvpilot_allocator_bytes", (*key, state), value)
    for ledger in scrape.ledgers:
        key = (*server, ledger.device, ledger.rank)
        for part, source, size in ledger.parts:
            out.add("kvpilot_memory_ledger_bytes", (*key, part, source), size)
        figures: tuple[tuple[str, float | None], ...] = (
            ("used", ledger.used_bytes),
            ("kv_used", ledger.kv_used_bytes),
            ("budget", ledger.budget_bytes),
            ("drift", ledger.drift_bytes),
            ("headroom", ledger.headroom_bytes),
            ("unallocated", ledger.unallocated_bytes),
        )
        for figure, amount in figures:
            out.add("kvpilot_memory_figure_bytes", (*key, figure), amount)


def _dcgm(out: _Families, dcgm: DcgmSnapshot) -> None:
    for gpu in dcgm.gpus:
        key = (gpu.gpu, gpu.uuid, gpu.mig_instance, "dcgm_exporter")
        for state, value in (
            ("total", gpu.total_bytes),
            ("used", gpu.used_bytes),
            ("free", gpu.free_bytes),
            ("reserved", gpu.reserved_bytes),
        ):
            out.add("kvpilot_gpu_device_memory_bytes", (*key, state), value)


def process_owner(process: GpuProcess) -> str:
    """`server`, `neighbour`, or `unknown` for a host PID this PID namespace cannot see (a
    container sharing the GPU but not the host's PIDs): it may well be the server's own."""
    if process.is_server:
        return "server"
    return "unknown" if process.container_pid is None else "neighbour"


def _gpu(out: _Families, gpu: GpuSample, owners: Mapping[int, str]) -> None:
    key = (str(gpu.index), gpu.uuid or "")
    for state, value in (
        ("total", gpu.total_bytes),
        ("used", gpu.used_bytes),
        ("free", gpu.free_bytes),
        ("reserved", gpu.reserved_bytes),
    ):
        out.add("kvpilot_gpu_memory_bytes", (*key, state), value)
    out.add("kvpilot_gpu_utilization_ratio", (*key, "sm"), gpu.utilization_gpu_ratio)
    out.add("kvpilot_gpu_utilization_ratio", (*key, "memory"), gpu.utilization_memory_ratio)
    for process in gpu.processes or ():
        owner = process_owner(process)
        server = owners.get(process.container_pid or -1, "") if process.is_server else ""
        labels = (*key, str(process.host_pid), owner, server)
        out.add("kvpilot_gpu_process_memory_bytes", labels, process.used_bytes)
    for mig in gpu.mig_instances:
        mig_key = (str(gpu.index), str(mig.mig_index), mig.uuid or "")
        for state, value in (
            ("total", mig.total_bytes),
            ("used", mig.used_bytes),
            ("free", mig.free_bytes),
        ):
            out.add("kvpilot_mig_memory_bytes", (*mig_key, state), value)


def _figures(out: _Families, server: tuple[str, str], f: EngineFigures) -> None:
    key = (*server, f.model_name, f.engine)
    out.add("kvpilot_preemption_rate_per_second", (*key, "vllm"), f.preemption_rate_per_s)
    out.add("kvpilot_preemption_rate_per_second", (*key, "kvpool"), f.kvpool_preemption_rate_per_s)
    out.add("kvpilot_prefix_cache_hit_ratio", key, f.prefix_cache_hit_ratio)
    out.add("kvpilot_generation_tokens_per_second", key, f.generation_tokens_per_s)
    out.add("kvpilot_iterations_per_second", key, f.iterations_per_s)
    for metric, q, value in f.latency_quantiles_s:
        # Not `quantile`: that label belongs to summaries, and this is a gauge.
        out.add("kvpilot_latency_seconds", (*key, metric, f"{q * 100:g}"), value)


def sidecar_families(
    counters: Callable[[], SidecarCounters],
    reloads: ReloadOutcome | None = None,
    unattended: Callable[[], Iterable[tuple[str, float]]] = UNATTENDED.series,
) -> Callable[[_Families], None]:
    """The sidecar loop's own families: alerts, outbox, notifications, remediation, reloads,
    and the canaries left serving with nobody attending them (per Deployment)."""

    def add(out: _Families) -> None:
        c = counters()
        for (alertname, state, severity), count in c.alerts_by_state:
            out.add("kvpilot_alerts", (alertname, state, severity), count)
        out.add("kvpilot_outbox_backlog", (), c.outbox_backlog)
        for (notifier, outcome), count in c.notifications_total:
            out.add("kvpilot_notifications_total", (notifier, outcome), count)
        for (server, outcome), count in c.remediations_total:
            out.add("kvpilot_remediations_total", (server, outcome), count)
        for server, is_open in c.breakers_open:
            out.add("kvpilot_remediation_circuit_open", (server,), 1.0 if is_open else 0.0)
        out.add("kvpilot_remediation_in_progress", (), 1.0 if c.remediation_in_progress else 0.0)
        in_force, source = c.mode
        for mode in Mode:  # a state set: 1 for the mode in force, 0 for the others
            out.add("kvpilot_mode", (mode.value, source), 1.0 if mode.value == in_force else 0.0)
        out.add("kvpilot_tick_overruns_total", (), c.tick_overruns_total)
        for task, count in c.task_failures_total:
            out.add("kvpilot_background_task_failures_total", (task,), count)
        for reason, count in c.state_write_errors_total:
            out.add("kvpilot_state_write_errors_total", (reason,), count)
        # Without a reloader, the configuration kvpilot started with is the one loaded: 1.
        reloaded = reloads is None or reloads.last_successful
        out.add("kvpilot_config_last_reload_successful", (), 1.0 if reloaded else 0.0)
        for deployment, canaries in unattended():
            out.add("kvpilot_unattended_canaries", (deployment,), canaries)

    return add


def tuning_families(families: Sequence[tuning_metrics.Family]) -> Callable[[_Families], None]:
    """The tuner's families (trials, best goodput, live flags) as the agent exports them."""

    def add(out: _Families) -> None:
        for family in families:
            spec = family.spec
            for sample in family.samples:
                labels = dict(sample.labels)
                out.add(spec.name, [labels.get(name, "") for name in spec.labels], sample.value)

    return add


def build_registry(
    servers: Callable[[], Sequence[ServerView]],
    extra: Callable[[_Families], None] | None = None,
    *,
    vllm_families: VllmFamilies = "include",
) -> CollectorRegistry:
    """A private registry holding only the agent's collector (no process/platform noise);
    `vllm_families` is the configuration's `exposition.vllm_families`."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(AgentCollector(servers, extra, vllm_families))
    return registry


def single_server(state: TickState, server: str = "vllm") -> Callable[[], Sequence[ServerView]]:
    """The view of `kvpilot run` without a configuration: one stable server."""
    views = (ServerView(server, "stable", state),)
    return lambda: views
