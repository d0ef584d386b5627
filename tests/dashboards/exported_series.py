"""The series kvpilot really exports, rendered by the agent's own exposition module from
sample values, and vLLM's from recorded payloads: the input of the rule and panel tests.

Nothing here names a label: the label sets are those the exposition writes and Prometheus
adds on scraping (`job`, `instance`). A test chooses which exported series to use and the
values they take over time, never their names or labels.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.agent.app.exposition import (
    ServerView,
    SidecarCounters,
    build_registry,
    sidecar_families,
    tuning_families,
)
from kvpilot.agent.config.agent import ListenConfig
from kvpilot.agent.readings.derive import EngineFigures
from kvpilot.agent.readings.snapshot import Snapshot
from kvpilot.agent.runtimes.kubernetes.unattended import UnattendedCanaries
from kvpilot.agent.tick.ticker import TickState
from kvpilot.collectors.fragmentation import kv_blocks_fragmentation
from kvpilot.collectors.gpu_samples import GpuProcess, GpuSample, NvmlSnapshot
from kvpilot.collectors.kvpool.client import (
    AllocatorSample,
    GroupOccupancySample,
    KvBlockSample,
    KvPoolScrape,
)
from kvpilot.collectors.kvpool.ledger_client import LedgerSample
from kvpilot.collectors.vllm_metrics import VllmScrape, parse_vllm_metrics
from kvpilot.dashboards import tuning_metrics
from kvpilot.tuner.trials import trial_from_dict

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
VLLM_PAYLOAD = FIXTURES / "vllm" / "v0_32_under_load.prom"
# A real server with --kv-cache-metrics (block lifetime, idle before eviction), and a GPU
# server's CPU KV offload families, derived from vLLM's source (tests/fixtures/vllm/README.md).
VLLM_KV_CACHE_METRICS_PAYLOAD = FIXTURES / "vllm" / "v0_32_kv_cache_metrics_under_load.prom"
VLLM_CPU_OFFLOAD_PAYLOAD = FIXTURES / "vllm" / "derived_simple_cpu_offload.prom"
VLLM_PAYLOADS = (VLLM_PAYLOAD, VLLM_KV_CACHE_METRICS_PAYLOAD, VLLM_CPU_OFFLOAD_PAYLOAD)
# kube-state-metrics' restart counter: a named external source (its README says how written).
KSM_PAYLOAD = FIXTURES / "kube_state_metrics" / "restarts.prom"
TRIALS = FIXTURES / "tuning_live" / "trials.jsonl"  # a real session, judged
SERVER_PID, NEIGHBOUR_PID = 4100, 5200
AGENT_PORT = ListenConfig().port  # the port Prometheus scrapes kvpilot on by default
GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class Series:
    """One exported series: its metric name and every label, as Prometheus stores them."""

    name: str
    labels: tuple[tuple[str, str], ...]

    def label(self, name: str) -> str:
        return dict(self.labels)[name]

    def promtool(self) -> str:
        """The series in promtool's `input_series` notation."""
        inner = ",".join(f'{k}="{_escape(v)}"' for k, v in self.labels)
        return f"{self.name}{{{inner}}}"

    def alert_labels(self, **extra: str) -> dict[str, str]:
        """The labels an alert over this series carries (the name dropped), plus `extra`."""
        return {**dict(self.labels), **extra}


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _kv_block(model_name: str) -> KvBlockSample:
    return KvBlockSample(
        engine="0",
        model_name=model_name,
        taken_at_s=10.0,
        blocks_total=1023,
        blocks_free=200,
        blocks_free_cached=3,
        blocks_empty=197,
        longest_free_run_blocks=50,
        fragmentation=kv_blocks_fragmentation(200, 50, 1023),
        internal_fragmentation_slots=17,
        internal_fragmentation_ratio=0.02,
        requests_running=33,
        block_size_tokens=32,
        preemptions_total=21,
        last_preemption_wall_s=1_700_000_000.0,
        scheduler_steps_total=900,
        snapshot_age_s=0.01,
        occupancy=(GroupOccupancySample("0", 32, 823, 823 * 20, 20 / 32, None),),
        block_size_step_tokens=32,
    )


def _allocator() -> AllocatorSample:
    return AllocatorSample(
        device="0",
        rank="0",
        reserved_bytes=2 * GIB,
        allocated_bytes=GIB,
        active_bytes=GIB,
        inactive_split_bytes=64 << 20,
        free_in_reserved_bytes=GIB,
        largest_free_block_bytes=512 << 20,
        segments=12,
        fragmentation_ratio=0.5,
    )


def _ledger() -> LedgerSample:
    return LedgerSample(
        device="0",
        rank="0",
        parts=(
            ("kv_cache", "kv_cache_tensors", 50 * GIB),
            ("unattributed", "used minus the attributed parts", GIB),
            ("weights", "vllm_model_memory_usage", 16 * GIB),
        ),
        used_bytes=67 * GIB,
        budget_bytes=66 * GIB,
        drift_bytes=GIB,
        headroom_bytes=14 * GIB,
        unallocated_bytes=13 * GIB,
    )


def _gpu() -> GpuSample:
    processes = (
        GpuProcess(SERVER_PID, SERVER_PID, 24 * GIB, is_server=True),
        GpuProcess(NEIGHBOUR_PID, NEIGHBOUR_PID, 6 * GIB, is_server=False),
    )
    return GpuSample(
        index=0,
        uuid="GPU-0",
        name="H100",
        total_bytes=80 * GIB,
        used_bytes=30 * GIB,
        free_bytes=50 * GIB,
        reserved_bytes=512 << 20,
        utilization_gpu_ratio=0.55,
        utilization_memory_ratio=0.2,
        processes=processes,
        mig_instances=(),
    )


def _state(*, kvpool: bool) -> TickState:
    engines = parse_vllm_metrics(VLLM_PAYLOAD.read_text(), taken_at_s=10.0, wall_time_s=1e9)
    snapshot = Snapshot(
        taken_at_s=10.0,
        wall_time_s=1e9,
        vllm=VllmScrape(10.0, 1e9, engines, "0.32.0"),
        kvpool=KvPoolScrape(
            10.0,
            1e9,
            (_kv_block(engines[0].model_name),),
            (_allocator(),),
            ledgers=(_ledger(),),
        )
        if kvpool
        else None,
        nvml=NvmlSnapshot(10.0, 1e9, "550.54", (_gpu(),)),
        durations_s=(("vllm", 0.004), ("nvml", 0.001), ("kvpool", 0.002)),
    )
    figures = tuple(
        EngineFigures(
            model_name=e.model_name,
            engine=e.engine,
            span_s=30.0,
            preemption_rate_per_s=0.5,
            kvpool_preemption_rate_per_s=0.7 if kvpool else None,
            prefix_cache_hit_ratio=0.3,
            generation_tokens_per_s=120.0,
            iterations_per_s=8.0,
            latency_quantiles_s=(("ttft", 0.5, 0.04), ("inter_token", 0.95, 0.02)),
        )
        for e in engines
    )
    state = TickState(latest=snapshot, figures=figures, ticks_total=5, last_tick_at_s=10.0)
    state.errors_total[("vllm", "timeout")] = 2
    state.errors_total[("nvml", "unavailable")] = 1
    return state


def _counters() -> SidecarCounters:
    return SidecarCounters(
        alerts_by_state=((("VllmKvCacheSaturated", "firing", "warning"), 1),),
        outbox_backlog=3,
        notifications_total=((("webhook", "delivered"), 4), (("webhook", "given_up"), 1)),
        remediations_total=((("vllm", "succeeded"), 1),),
        breakers_open=(("vllm", False),),
        remediation_in_progress=False,
        tick_overruns_total=2,
        task_failures_total=(("delivery", 1),),
        state_write_errors_total=(("disk_full", 1),),
    )


@functools.cache  # deterministic, and the rule cases ask for it once per target
def agent_exposition(*, kvpool: bool = True) -> str:
    """The agent's /metrics text for one stable server, as `kvpilot run` serves it."""
    state = _state(kvpool=kvpool)
    views = (ServerView("vllm", "stable", state, frozenset({SERVER_PID})),)
    trials = [trial_from_dict(json.loads(line)) for line in TRIALS.read_text().splitlines()]
    live = [
        tuning_metrics.LiveFlags("vllm", "--max-num-seqs 16", tuning_metrics.FlagSource.PROMOTED)
    ]
    families = tuning_metrics.tuning_families(trials, live)
    # A canary the pod runtime could not take traffic back from, as the tuner marks it.
    unattended = UnattendedCanaries()
    unattended.mark("serving/vllm")
    own = sidecar_families(_counters, unattended=unattended.series)

    def extra(out: object) -> None:
        own(out)  # type: ignore[arg-type]
        tuning_families(families)(out)  # type: ignore[arg-type]

    return generate_latest(build_registry(lambda: views, extra)).decode()


def scraped(text: str, target: Mapping[str, str]) -> tuple[Series, ...]:
    """The series of an exposition as Prometheus stores them after scraping `target`."""
    out = []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            # Prometheus stores a label with an empty value as no label at all.
            labels = {k: v for k, v in {**sample.labels, **target}.items() if v}
            out.append(Series(sample.name, tuple(sorted(labels.items()))))
    return tuple(out)


def agent_target(host: str) -> str:
    """The `instance` of a kvpilot on `host` at its default port."""
    return f"{host}:{AGENT_PORT}"


def kvpilot_series(host: str = "a", *, kvpool: bool = True) -> tuple[Series, ...]:
    """kvpilot's series on `host` as Prometheus's `kvpilot` job stores them."""
    target = {"job": "kvpilot", "instance": agent_target(host)}
    return scraped(agent_exposition(kvpool=kvpool), target)


def vllm_series(instance: str = "a:8000", payload: Path = VLLM_PAYLOAD) -> tuple[Series, ...]:
    """vLLM's series, from a recorded vLLM 0.32 payload, as the `vllm` job stores them."""
    return scraped(payload.read_text(), {"job": "vllm", "instance": instance})


def in_kubernetes(series: Iterable[Series], *, pod: str, container: str) -> tuple[Series, ...]:
    """`series` as kube-prometheus-stack stores them: the Prometheus Operator's ServiceMonitor
    targets add `namespace`, `service`, `pod`, `container` and `endpoint`, and a Thanos or
    Mimir in front of several clusters shows each Prometheus's `cluster` external label."""
    target = {
        "cluster": "eu-1",
        "namespace": "serving",
        "service": "vllm",
        "pod": pod,
        "container": container,
        "endpoint": container,
    }
    return tuple(_with(s, target) for s in series)


def _with(series: Series, labels: Mapping[str, str]) -> Series:
    return Series(series.name, tuple(sorted({**dict(series.labels), **labels}.items())))


def kube_state_metrics_series() -> tuple[Series, ...]:
    """kube-state-metrics' series as kube-prometheus-stack's job stores them: its own labels
    kept (`honorLabels`), the cluster's external label shown by Thanos or Mimir."""
    target = {"job": "kube-state-metrics", "instance": "10.0.0.9:8080"}
    return tuple(_with(s, {"cluster": "eu-1"}) for s in scraped(KSM_PAYLOAD.read_text(), target))


def up_series(job: str, instance: str) -> Series:
    """Prometheus's own `up` of a target."""
    return Series("up", (("instance", instance), ("job", job)))


def pick(series: Iterable[Series], name: str, **match: str) -> Series:
    """The one exported series named `name` whose labels include `match`; fails loudly."""
    found = [
        s
        for s in series
        if s.name == name and all(dict(s.labels).get(k) == v for k, v in match.items())
    ]
    if len(found) != 1:
        raise LookupError(f"{len(found)} exported series match {name} {match}, not one")
    return found[0]


def label_sets(series: Iterable[Series]) -> dict[str, frozenset[str]]:
    """Every label name each metric name carries on some exported series."""
    out: dict[str, set[str]] = {}
    for s in series:
        out.setdefault(s.name, set()).update(k for k, _ in s.labels)
    return {name: frozenset(labels) for name, labels in out.items()}
