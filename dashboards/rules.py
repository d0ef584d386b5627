"""Prometheus recording and alerting rules equivalent to kvpilot's own, plus self-watch rules.

The rule settings arrive as an object shaped like the agent's `RulesConfig` (described here
by Protocols, so this layer never imports the agent). The alerts carry the names the agent
uses; Prometheus evaluates them on the series the agent and vLLM export:

* `VllmKvFragmentationHigh`: `kvpilot_fragmentation_ratio` above the threshold, per source.
* `VllmPreemptionSpike`: the short-window rate of the plugin's counter (vLLM's where the engine
  has no plugin) above the floor and above a multiple of the baseline taken over the span
  before the short window; without a baseline the floor alone decides.
* `VllmKvCacheSaturated`: KV usage at or above the threshold while requests wait.
* `VllmEngineStalled`: vLLM's iteration counter unchanged for `stall_s` while requests are
  present throughout (vLLM's own series: the agent re-exports only rates).
* `VllmKvTokenOccupancyLow`: the plugin's token occupancy below its bound while block usage is
  above its own (capacity lost to partly filled blocks).
* `VllmRequestsDeferred`: vLLM's deferred-request count never 0 over the limit while requests
  run (partial starvation, which moves the iteration counter).
* `VllmGpuMemoryGrowth`: the least-squares slope (`deriv`) of the server's GPU memory over the
  window, with the growth over the window (`delta`) at least the minimum.

`VllmGpuNeighbourPressure` needs the server's `gpu_memory_utilization`, which only the agent
knows; it stays the agent's alone. The self-watch rules alert on kvpilot itself: no target
up, one target down, a collector down, the outbox, the circuit breaker, its failure counters
and a refused reload. Windows hold at least four scrapes, and every alert waits at least two
(`Timing`). Per-model and per-namespace recording rules (`aggregates`) sum the fleet up.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import yaml

from kvpilot.dashboards.aggregates import aggregate_rules
from kvpilot.dashboards.rule_context import (
    RUNBOOK_URL_BASE,
    SCRAPE_INTERVAL_S,
    WHERE,
    AlertContext,
    Timing,
    duration,
    number,
)
from kvpilot.dashboards.self_watch import SelfWatch, self_watch_rules


# Read-only members (properties): the agent's config models are frozen.
class _Rule(Protocol):
    @property
    def enabled(self) -> bool: ...
    @property
    def for_s(self) -> float: ...
    @property
    def severity(self) -> str: ...
    @property
    def labels(self) -> Mapping[str, str]: ...


class _FragmentationSource(_Rule, Protocol):
    @property
    def threshold_ratio(self) -> float: ...


class _Fragmentation(Protocol):
    @property
    def kv_blocks(self) -> _FragmentationSource: ...
    @property
    def allocator(self) -> _FragmentationSource: ...


class _PreemptionSpike(_Rule, Protocol):
    @property
    def window_s(self) -> float: ...
    @property
    def baseline_window_s(self) -> float: ...
    @property
    def floor_per_s(self) -> float: ...
    @property
    def baseline_multiple(self) -> float: ...


class _KvSaturation(_Rule, Protocol):
    @property
    def usage_threshold_ratio(self) -> float: ...
    @property
    def min_waiting(self) -> int: ...


class _EngineStall(_Rule, Protocol):
    @property
    def stall_s(self) -> float: ...


class _TokenOccupancy(_Rule, Protocol):
    @property
    def usage_above_ratio(self) -> float: ...
    @property
    def occupancy_below_ratio(self) -> float: ...


class _RequestsDeferred(_Rule, Protocol):
    @property
    def deferred_limit_s(self) -> float: ...
    @property
    def min_running(self) -> int: ...


class _GpuMemoryGrowth(_Rule, Protocol):
    @property
    def window_s(self) -> float: ...
    @property
    def slope_threshold_bytes_per_s(self) -> float: ...
    @property
    def min_growth_bytes(self) -> int: ...


class RuleSettings(Protocol):
    """The part of the agent's `RulesConfig` these rules are generated from."""

    @property
    def fragmentation(self) -> _Fragmentation: ...
    @property
    def preemption_spike(self) -> _PreemptionSpike: ...
    @property
    def kv_saturation(self) -> _KvSaturation: ...
    @property
    def engine_stall(self) -> _EngineStall: ...
    @property
    def token_occupancy(self) -> _TokenOccupancy: ...
    @property
    def requests_deferred(self) -> _RequestsDeferred: ...
    @property
    def gpu_memory_growth(self) -> _GpuMemoryGrowth: ...


@dataclass(frozen=True, slots=True)
class RuleGroups:
    """Generated rule groups, ready to be written as a rules file or a PrometheusRule."""

    groups: tuple[dict[str, Any], ...]
    runbooks: Mapping[str, str] = field(default_factory=dict)

    def rules_file(self) -> str:
        """The plain Prometheus rules file (`rule_files:`)."""
        return dump_yaml({"groups": list(self.groups)})

    def prometheus_rule(
        self,
        *,
        name: str = "kvpilot",
        namespace: str | None = None,
        labels: Mapping[str, str] | None = None,
    ) -> str:
        """The same groups as a prometheus-operator `PrometheusRule` manifest; `labels` are
        added to its own (`release: <name>` is what kube-prometheus-stack's `ruleSelector`
        selects by default)."""
        metadata: dict[str, Any] = {
            "name": name,
            "labels": {
                "app.kubernetes.io/name": "kvpilot",
                "app.kubernetes.io/part-of": "kvpilot",
                **dict(labels or {}),
            },
        }
        if namespace is not None:
            metadata["namespace"] = namespace
        manifest = {
            "apiVersion": "monitoring.coreos.com/v1",
            "kind": "PrometheusRule",
            "metadata": metadata,
            "spec": {"groups": list(self.groups)},
        }
        return dump_yaml(manifest)


class _Dumper(yaml.SafeDumper):
    """Block style for multi-line strings, so generated manifests stay readable."""


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _represent_str)


def dump_yaml(data: Any) -> str:
    """YAML in the order given, multi-line strings as literal blocks."""
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, width=100, allow_unicode=True)


# The preferred preemption counter per engine: the plugin's, else vLLM's.
PREEMPTION_RATE = "kvpilot:preemption_rate_per_second:short"
PREEMPTION_BASELINE = "kvpilot:preemption_rate_per_second:baseline"
SERVER_GPU_MEMORY = "kvpilot:gpu_server_memory_bytes"
# An engine on kvpilot's series (one agent may watch several servers) and on vLLM's own.
ENGINE_KEY = "instance, job, server, model_name, engine"
VLLM_ENGINE_KEY = "instance, job, model_name, engine"


def _labels(rule: _Rule) -> dict[str, str]:
    return {**dict(rule.labels), "severity": rule.severity}


def _alert(
    ctx: AlertContext,
    name: str,
    expr: str,
    rule: _Rule,
    summary: str,
    labels: Mapping[str, str] | None = None,
    variant: str | None = None,
) -> dict[str, Any]:
    return {
        "alert": name,
        "expr": expr,
        "for": duration(ctx.timing.for_s(rule.for_s)),
        "labels": {**_labels(rule), **(labels or {})},
        "annotations": ctx.annotations(name, summary, variant=variant),
    }


def _preemption_recording(cfg: _PreemptionSpike, timing: Timing) -> list[dict[str, Any]]:
    short_s = timing.window_s(cfg.window_s)
    short = duration(short_s)
    baseline = duration(timing.window_s(cfg.baseline_window_s - short_s))

    def preferred(range_and_offset: str) -> str:
        # `or` matches on every label but `counter`: vLLM's counts where the plugin's is absent.
        rates = [
            f'max without (counter) (rate(kvpilot_preemptions_total{{counter="{counter}"}}'
            f"[{range_and_offset}))"
            for counter in ("kvpool", "vllm")
        ]
        return " or ".join(rates)

    return [
        {"record": PREEMPTION_RATE, "expr": preferred(f"{short}]")},
        # The baseline span ends where the short window starts.
        {"record": PREEMPTION_BASELINE, "expr": preferred(f"{baseline}] offset {short}")},
    ]


def _engine_alerts(settings: RuleSettings, ctx: AlertContext) -> list[dict[str, Any]]:
    rules: list[dict[str, Any]] = []
    frag = settings.fragmentation
    for source, cfg in (("kv_blocks", frag.kv_blocks), ("allocator", frag.allocator)):
        if not cfg.enabled:
            continue
        rules.append(
            _alert(
                ctx,
                "VllmKvFragmentationHigh",
                f'kvpilot_fragmentation_ratio{{source="{source}"}} > {number(cfg.threshold_ratio)}',
                cfg,
                f"{source} fragmentation {{{{ $value | humanizePercentage }}}} above "
                f"{cfg.threshold_ratio:g} on {WHERE}"
                # Paged attention takes any free block: no restart brings the KV value down.
                + ("; a restart cannot fix the KV-pool value" if source == "kv_blocks" else ""),
                # The series carries it too; as a rule label it keeps the two rules apart.
                labels={"source": source},
                variant=source,
            )
        )
    spike = settings.preemption_spike
    if spike.enabled:
        rules.append(
            _alert(
                ctx,
                "VllmPreemptionSpike",
                f"{PREEMPTION_RATE} > {number(spike.floor_per_s)} unless on ({ENGINE_KEY}) "
                f"{PREEMPTION_RATE} <= {number(spike.baseline_multiple)} * {PREEMPTION_BASELINE}",
                spike,
                f"{{{{ $value | humanize }}}} preemptions/s over "
                f"{duration(ctx.timing.window_s(spike.window_s))} on "
                f"{WHERE} engine {{{{ $labels.engine }}}}",
            )
        )
    sat = settings.kv_saturation
    if sat.enabled:
        rules.append(
            _alert(
                ctx,
                "VllmKvCacheSaturated",
                f"kvpilot_kv_usage_ratio >= {number(sat.usage_threshold_ratio)} "
                f"and on ({ENGINE_KEY}) "
                f"kvpilot_requests_waiting >= {sat.min_waiting}",
                sat,
                "KV cache {{ $value | humanizePercentage }} full with requests waiting on "
                f"{WHERE} engine {{{{ $labels.engine }}}}",
            )
        )
    stall = settings.engine_stall
    if stall.enabled:
        window = duration(ctx.timing.window_s(stall.stall_s))
        rules.append(
            _alert(
                ctx,
                "VllmEngineStalled",
                f"(min_over_time(vllm:num_requests_running[{window}]) "
                f"+ min_over_time(vllm:num_requests_waiting[{window}])) > 0 "
                f"and on ({VLLM_ENGINE_KEY}) "
                f"changes(vllm:iteration_tokens_total_count[{window}]) == 0",
                stall,
                f"no engine step for {window} with {{{{ $value }}}} requests present on "
                f"{WHERE} engine {{{{ $labels.engine }}}}",
            )
        )
    rules.extend(_capacity_and_starvation_alerts(settings, ctx))
    growth = settings.gpu_memory_growth
    if growth.enabled:
        window = duration(ctx.timing.window_s(growth.window_s))
        rules.append(
            _alert(
                ctx,
                "VllmGpuMemoryGrowth",
                f"deriv({SERVER_GPU_MEMORY}[{window}]) "
                f"> {number(growth.slope_threshold_bytes_per_s)} "
                f"and on (instance, job, gpu, server) "
                f"delta({SERVER_GPU_MEMORY}[{window}]) >= {growth.min_growth_bytes}",
                growth,
                "GPU memory of server {{ $labels.server }} on GPU {{ $labels.gpu }} of "
                f"{WHERE} grows {{{{ $value | humanize1024 }}}}B/s",
            )
        )
    return rules


def _capacity_and_starvation_alerts(
    settings: RuleSettings, ctx: AlertContext
) -> list[dict[str, Any]]:
    """Low token occupancy under high block usage; requests deferred while others run."""
    rules: list[dict[str, Any]] = []
    occupancy = settings.token_occupancy
    if occupancy.enabled:
        usage = (
            '1 - sum without (state) (kvpilot_kvpool_blocks{state="free"}) '
            '/ sum without (state) (kvpilot_kvpool_blocks{state="total"})'
        )
        rules.append(
            _alert(
                ctx,
                "VllmKvTokenOccupancyLow",
                f"kvpilot_token_occupancy_ratio < {number(occupancy.occupancy_below_ratio)} "
                f"and on ({ENGINE_KEY}) ({usage}) > {number(occupancy.usage_above_ratio)}",
                occupancy,
                "KV blocks hold tokens in {{ $value | humanizePercentage }} of their slots "
                f"with the pool mostly in use on {WHERE} engine "
                "{{ $labels.engine }}: a smaller --block-size gives capacity back",
            )
        )
    deferred = settings.requests_deferred
    if deferred.enabled:
        window = duration(ctx.timing.window_s(deferred.deferred_limit_s))
        rules.append(
            _alert(
                ctx,
                "VllmRequestsDeferred",
                f"min_over_time(kvpilot_requests_deferred[{window}]) > 0 "
                f"and on ({ENGINE_KEY}) "
                f"min_over_time(kvpilot_requests_running[{window}]) >= {deferred.min_running}",
                deferred,
                f"{{{{ $value }}}} requests deferred for {window} while others run on "
                f"{WHERE} engine {{{{ $labels.engine }}}}",
            )
        )
    return rules


def build_rules(
    settings: RuleSettings,
    *,
    runbooks: Mapping[str, str] | None = None,
    self_watch: SelfWatch | None = None,
    evaluation_interval_s: float | None = None,
    scrape_interval_s: float = SCRAPE_INTERVAL_S,
    runbook_url_base: str = RUNBOOK_URL_BASE,
) -> RuleGroups:
    """Recording and alerting rules; without an interval the groups use Prometheus's global one.

    Windows and `for` durations are at least four and two scrapes of `scrape_interval_s`.
    """
    runbooks = dict(runbooks or {})
    ctx = AlertContext(Timing(scrape_interval_s), runbooks, runbook_url_base)
    interval = (
        {} if evaluation_interval_s is None else {"interval": duration(evaluation_interval_s)}
    )
    recording = [
        *_preemption_recording(settings.preemption_spike, ctx.timing),
        {
            "record": SERVER_GPU_MEMORY,
            # `without`: the target's labels (namespace, pod from prometheus-operator) stay.
            "expr": 'sum without (pid, owner) (kvpilot_gpu_process_memory_bytes{owner="server"})',
        },
    ]
    groups = (
        {"name": "kvpilot.recording", **interval, "rules": recording},
        {
            "name": "kvpilot.aggregates",
            **interval,
            "rules": aggregate_rules(PREEMPTION_RATE, SERVER_GPU_MEMORY),
        },
        {"name": "kvpilot.alerts", **interval, "rules": _engine_alerts(settings, ctx)},
        {
            "name": "kvpilot.self",
            **interval,
            "rules": self_watch_rules(self_watch or SelfWatch(), ctx),
        },
    )
    return RuleGroups(groups=groups, runbooks=runbooks)
