"""promtool unit tests for the generated rules, on the series kvpilot and vLLM really export.

Each input series is one the exposition module renders (or vLLM's recorded payload holds),
picked by its labels, with the labels Prometheus stores; a case chooses only its values over
time, one per scrape. Times are counted in scrapes of the interval the rules were generated
for, and the expected alerts carry the labels of the series they fire on.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from exported_series import (
    Series,
    agent_target,
    kvpilot_series,
    pick,
    up_series,
    vllm_series,
)

from kvpilot.agent.rules.config import RulesConfig
from kvpilot.dashboards.rule_context import Timing
from kvpilot.dashboards.self_watch import SelfWatch

MIB = 1 << 20
Values = Sequence[float | None]  # one per scrape; None: no sample


def _values(values: Values) -> str:
    return " ".join("_" if v is None else format(v, ".12g") for v in values)


def _ramp(start: float, step: float, count: int) -> list[float | None]:
    return [start + step * i for i in range(count)]


class _Case:
    """One promtool test group: series with values, and the alerts expected at some times."""

    def __init__(self, scrape_s: float, alert: str) -> None:
        self.scrape_s = scrape_s
        self.alert = alert
        self.series: list[dict[str, str]] = []
        self.checks: list[dict[str, Any]] = []

    def scrapes(self, seconds: float) -> int:
        return math.ceil(seconds / self.scrape_s)

    def feed(self, series: Series, values: Values) -> None:
        self.series.append({"series": series.promtool(), "values": _values(values)})

    def expect(self, at_s: float, *firing: dict[str, str]) -> None:
        self.checks.append(
            {
                "eval_time": f"{round(at_s)}s",
                "alertname": self.alert,
                "exp_alerts": [{"exp_labels": labels} for labels in firing],
            }
        )

    def group(self) -> dict[str, Any]:
        return {
            "interval": f"{round(self.scrape_s)}s",
            "input_series": self.series,
            "alert_rule_test": self.checks,
        }


def _agent(instance: str, *, kvpool: bool = True) -> tuple[Series, ...]:
    return kvpilot_series(instance, kvpool=kvpool)


def _fragmentation(config: RulesConfig, timing: Timing) -> _Case:
    case = _Case(timing.scrape_interval_s, "VllmKvFragmentationHigh")
    frag = config.fragmentation.kv_blocks
    for_s = timing.for_s(frag.for_s)
    total = case.scrapes(for_s) + 6
    above, below = frag.threshold_ratio + 0.2, frag.threshold_ratio - 0.1
    fired = []
    for instance, kv, allocator in (
        ("a", [above] * total, [above] * total),
        ("b", [below] * total, [frag.threshold_ratio] * total),  # at the threshold: not above
        ("c", [above] * (case.scrapes(for_s) - 2) + [below] * 8, [below] * total),
    ):
        series = _agent(instance)
        kv_series = pick(series, "kvpilot_fragmentation_ratio", source="kv_blocks")
        alloc_series = pick(series, "kvpilot_fragmentation_ratio", source="allocator")
        case.feed(kv_series, kv)
        case.feed(alloc_series, allocator)
        if instance == "a":
            fired = [
                kv_series.alert_labels(severity=frag.severity),
                alloc_series.alert_labels(severity=config.fragmentation.allocator.severity),
            ]
    case.expect(for_s - case.scrape_s)
    case.expect(for_s + 2 * case.scrape_s, *fired)
    return case


def _preemption(config: RulesConfig, timing: Timing) -> _Case:
    case = _Case(timing.scrape_interval_s, "VllmPreemptionSpike")
    spike = config.preemption_spike
    short_s = timing.window_s(spike.window_s)
    quiet = case.scrapes(short_s + timing.window_s(spike.baseline_window_s - short_s))
    for_s = timing.for_s(spike.for_s)
    loud = case.scrapes(short_s + for_s) + 4
    total = quiet + loud
    step = case.scrape_s  # one preemption a second
    spiking = [0.0] * quiet + _ramp(step, step, loud)
    fired = []

    def engine(instance: str, kvpool: bool = True) -> dict[str, Series]:
        series = _agent(instance, kvpool=kvpool)
        counters = [s for s in series if s.name == "kvpilot_preemptions_total"]
        return {s.label("counter"): s for s in counters}

    a = engine("a")  # quiet, then a spike on both counters: the plugin's is preferred
    case.feed(a["kvpool"], spiking)
    case.feed(a["vllm"], spiking)
    fired.append(a["kvpool"].alert_labels(severity=spike.severity))
    b = engine("b")  # a steady rate above the floor: no spike over its baseline
    case.feed(b["kvpool"], _ramp(0, step * 2 * spike.floor_per_s, total))
    c = engine("c")  # the plugin's counter is quiet while vLLM's lagging one jumps
    case.feed(c["kvpool"], [0.0] * total)
    case.feed(c["vllm"], spiking)
    d = engine("d", kvpool=False)  # no plugin: vLLM's counter decides
    case.feed(d["vllm"], spiking)
    fired.append(d["vllm"].alert_labels(severity=spike.severity))
    e = engine("e")  # a fresh server below the floor
    case.feed(e["kvpool"], [None] * quiet + _ramp(0, step * spike.floor_per_s / 2, loud))
    f = engine("f")  # a fresh server above the floor: without a baseline the floor decides
    case.feed(f["kvpool"], [None] * quiet + _ramp(0, step, loud))
    fired.append(f["kvpool"].alert_labels(severity=spike.severity))
    fired = [{k: v for k, v in labels.items() if k != "counter"} for labels in fired]
    start_s = quiet * case.scrape_s
    case.expect(start_s - case.scrape_s)
    case.expect(start_s + short_s + for_s, *fired)
    return case


def _saturation(config: RulesConfig, timing: Timing) -> _Case:
    case = _Case(timing.scrape_interval_s, "VllmKvCacheSaturated")
    sat = config.kv_saturation
    for_s = timing.for_s(sat.for_s)
    total = case.scrapes(for_s) + 6
    fired = []
    for instance, usage, waiting in (
        ("a", 1.0, sat.min_waiting + 2),
        ("b", 1.0, 0),  # full, but nothing waits
        ("c", sat.usage_threshold_ratio - 0.1, sat.min_waiting + 4),  # waiting, with room
    ):
        series = _agent(instance)
        usage_series = pick(series, "kvpilot_kv_usage_ratio")
        case.feed(usage_series, [usage] * total)
        case.feed(pick(series, "kvpilot_requests_waiting"), [waiting] * total)
        if instance == "a":
            fired.append(usage_series.alert_labels(severity=sat.severity))
    case.expect(for_s - case.scrape_s)
    case.expect(for_s + 2 * case.scrape_s, *fired)
    return case


def _stall(config: RulesConfig, timing: Timing) -> _Case:
    case = _Case(timing.scrape_interval_s, "VllmEngineStalled")
    stall = config.engine_stall
    window_s, for_s = timing.window_s(stall.stall_s), timing.for_s(stall.for_s)
    moving = 10
    total = moving + case.scrapes(window_s + for_s) + 6
    fired = []
    for instance, running, waiting, steps in (
        ("a", 2, 1, _ramp(0, 10, moving) + [90.0] * (total - moving)),
        ("b", 0, 0, [50.0] * total),  # idle: still because nothing is asked of it
    ):
        series = vllm_series(f"{instance}:8000")
        running_series = pick(series, "vllm:num_requests_running")
        case.feed(running_series, [running] * total)
        case.feed(pick(series, "vllm:num_requests_waiting"), [waiting] * total)
        case.feed(pick(series, "vllm:iteration_tokens_total_count"), steps)
        if instance == "a":
            fired.append(running_series.alert_labels(severity=stall.severity))
    last_step_s = (moving - 1) * case.scrape_s
    case.expect(last_step_s + window_s - case.scrape_s)
    case.expect(last_step_s + window_s + for_s + 2 * case.scrape_s, *fired)
    return case


def _occupancy(config: RulesConfig, timing: Timing) -> _Case:
    case = _Case(timing.scrape_interval_s, "VllmKvTokenOccupancyLow")
    rule = config.token_occupancy
    for_s = timing.for_s(rule.for_s)
    total = case.scrapes(for_s) + 6
    fired = []
    for instance, free, occupancy in (
        ("a", 100, rule.occupancy_below_ratio - 0.2),  # 90 % of blocks in use, mostly empty
        ("b", 100, rule.occupancy_below_ratio + 0.2),  # in use and well filled
        ("c", 600, rule.occupancy_below_ratio - 0.2),  # mostly empty, but blocks to spare
    ):
        series = _agent(instance)
        case.feed(pick(series, "kvpilot_kvpool_blocks", state="total"), [1000] * total)
        case.feed(pick(series, "kvpilot_kvpool_blocks", state="free"), [free] * total)
        ratio = pick(series, "kvpilot_token_occupancy_ratio")
        case.feed(ratio, [occupancy] * total)
        if instance == "a":
            fired.append(ratio.alert_labels(severity=rule.severity))
    case.expect(for_s - case.scrape_s)
    case.expect(for_s + 2 * case.scrape_s, *fired)
    return case


def _deferred(config: RulesConfig, timing: Timing) -> _Case:
    case = _Case(timing.scrape_interval_s, "VllmRequestsDeferred")
    rule = config.requests_deferred
    window_s, for_s = timing.window_s(rule.deferred_limit_s), timing.for_s(rule.for_s)
    admitted = 10  # scrapes with nothing deferred before the deferral starts
    total = admitted + case.scrapes(window_s + for_s) + 6
    later = total - admitted
    fired = []
    for instance, deferred, running in (
        ("a", [2.0] * later, 30),  # deferred throughout while others run
        ("b", [2.0, 0.0] * (later // 2 + 1), 30),  # deferred ones keep being admitted
        ("c", [2.0] * later, 0),  # nothing runs: the stall rule's case
    ):
        series = _agent(instance)
        deferred_series = pick(series, "kvpilot_requests_deferred")
        case.feed(deferred_series, ([0.0] * admitted + deferred)[:total])
        case.feed(pick(series, "kvpilot_requests_running"), [running] * total)
        if instance == "a":
            fired.append(deferred_series.alert_labels(severity=rule.severity))
    start_s = admitted * case.scrape_s
    case.expect(start_s + window_s - case.scrape_s)
    case.expect(start_s + window_s + for_s + 2 * case.scrape_s, *fired)
    return case


def _growth(config: RulesConfig, timing: Timing) -> _Case:
    case = _Case(timing.scrape_interval_s, "VllmGpuMemoryGrowth")
    growth = config.gpu_memory_growth
    total = case.scrapes(3600)
    per_scrape = growth.slope_threshold_bytes_per_s * 10 * case.scrape_s
    fired = []
    for instance, server_step in (("a", per_scrape), ("b", per_scrape / 20)):
        series = _agent(instance)
        server = pick(series, "kvpilot_gpu_process_memory_bytes", owner="server")
        case.feed(server, _ramp(10 * 1024 * MIB, server_step, total))
        # A neighbour grows fast on both: it is not the server.
        neighbour = pick(series, "kvpilot_gpu_process_memory_bytes", owner="neighbour")
        case.feed(neighbour, _ramp(1024 * MIB, per_scrape * 10, total))
        if instance == "a":
            summed = {k: v for k, v in server.alert_labels().items() if k not in ("pid", "owner")}
            fired.append(summed | {"severity": growth.severity})
    # The minimum growth takes a while at ten times the slope; `for` adds more.
    case.expect(case.scrape_s * case.scrapes(growth.min_growth_bytes / per_scrape) / 2)
    case.expect(3000, *fired)
    return case


def _absent_and_down(watch: SelfWatch, timing: Timing) -> list[_Case]:
    cases = []
    for_s = timing.for_s(watch.absent_for_s)
    total = _Case(timing.scrape_interval_s, "").scrapes(for_s) + 8
    a, b = up_series("kvpilot", agent_target("a")), up_series("kvpilot", agent_target("b"))
    for alert in ("KvpilotAbsent", "KvpilotDown"):
        alone = _Case(timing.scrape_interval_s, alert)
        alone.feed(a, [0.0] * total)
        alone.expect(for_s - alone.scrape_s)
        firing = (
            {"severity": "critical"}
            if alert == "KvpilotAbsent"
            else a.alert_labels(severity="warning")
        )
        alone.expect(for_s + 2 * alone.scrape_s, firing)
        cases.append(alone)
    beside = _Case(timing.scrape_interval_s, "KvpilotDown")
    beside.feed(a, [0.0] * total)
    beside.feed(b, [1.0] * total)
    beside.expect(for_s + 2 * beside.scrape_s, a.alert_labels(severity="warning"))
    beside.checks.append({**beside.checks[-1], "alertname": "KvpilotAbsent", "exp_alerts": []})
    cases.append(beside)
    return cases


def _collector_down(watch: SelfWatch, timing: Timing) -> _Case:
    case = _Case(timing.scrape_interval_s, "KvpilotCollectorDown")
    for_s = timing.for_s(watch.collector_down_for_s)
    total = case.scrapes(for_s) + 8
    a, b = _agent("a"), _agent("b")
    up = {
        (instance, s.label("source")): s
        for instance, series in (("a", a), ("b", b))
        for s in series
        if s.name == "kvpilot_collector_up"
    }
    case.feed(up[("a", "vllm")], [0.0] * total)  # down
    case.feed(up[("a", "kvpool")], [1.0] * total)
    case.feed(up[("a", "nvml")], [0.0] * total)  # no driver here: unavailable on every read
    unavailable = {"source": "nvml", "reason": "unavailable"}
    case.feed(pick(a, "kvpilot_collector_errors_total", **unavailable), _ramp(1, 1, total))
    case.feed(up[("b", "nvml")], [0.0] * total)  # once unavailable, now failing otherwise
    case.feed(pick(b, "kvpilot_collector_errors_total", **unavailable), [1.0] * total)
    case.expect(for_s - case.scrape_s)
    case.expect(
        for_s + 2 * case.scrape_s,
        up[("a", "vllm")].alert_labels(severity="warning"),
        up[("b", "nvml")].alert_labels(severity="warning"),
    )
    return case


def _outbox(watch: SelfWatch, timing: Timing) -> _Case:
    case = _Case(timing.scrape_interval_s, "KvpilotOutboxBacklog")
    for_s = timing.for_s(watch.outbox_backlog_for_s)
    total = case.scrapes(for_s) + 8
    rows = watch.outbox_backlog_rows
    fired = []
    for instance, values in (
        ("a", [rows + 50.0] * total),
        ("b", [rows - 60.0] * total),
        ("c", [rows + 50.0] * (case.scrapes(for_s) - 4) + [0.0] * 12),
    ):
        series = pick(_agent(instance), "kvpilot_outbox_backlog")
        case.feed(series, values)
        if instance == "a":
            fired.append(series.alert_labels(severity="warning"))
    case.expect(for_s - case.scrape_s)
    case.expect(for_s + 2 * case.scrape_s, *fired)
    return case


def _circuit(watch: SelfWatch, timing: Timing) -> _Case:
    case = _Case(timing.scrape_interval_s, "KvpilotRemediationCircuitOpen")
    for_s = timing.for_s(watch.circuit_open_for_s)
    closed, total = 4, 4 + case.scrapes(for_s) + 6
    opened = pick(_agent("a"), "kvpilot_remediation_circuit_open")
    case.feed(opened, [0.0] * closed + [1.0] * (total - closed))
    case.feed(pick(_agent("b"), "kvpilot_remediation_circuit_open"), [0.0] * total)
    open_s = closed * case.scrape_s
    case.expect(open_s + for_s - case.scrape_s)
    case.expect(open_s + for_s + 2 * case.scrape_s, opened.alert_labels(severity="critical"))
    return case


def _failure_counter(
    watch: SelfWatch, timing: Timing, alert: str, name: str, **match: str
) -> _Case:
    """A failure counter that appears, one that moves, and one whose last move is old."""
    case = _Case(timing.scrape_interval_s, alert)
    window_s = timing.window_s(watch.failures_window_s)
    for_s = timing.for_s(0)
    old = case.scrapes(window_s) + 4  # the first failures, older than the window
    total = old + case.scrapes(for_s) + 6
    appears = pick(_agent("a"), name, **match)
    case.feed(appears, [None] * old + [1.0] * (total - old))
    moves = pick(_agent("b"), name, **match)
    case.feed(moves, [1.0] * old + [2.0] * (total - old))
    case.feed(pick(_agent("c"), name, **match), [1.0] * total)
    at_s = old * case.scrape_s
    case.expect(at_s - case.scrape_s)
    firing = [s.alert_labels(severity="warning") for s in (appears, moves)]
    case.expect(at_s + for_s + 2 * case.scrape_s, *firing)
    return case


def _overruns(watch: SelfWatch, timing: Timing) -> _Case:
    case = _Case(timing.scrape_interval_s, "KvpilotTickOverruns")
    for_s = timing.for_s(watch.overrun_for_s)
    total = case.scrapes(timing.window_s(watch.overrun_for_s) + for_s) + 8
    fired = []
    for instance, share in (("a", watch.overrun_ratio * 5), ("b", watch.overrun_ratio / 5)):
        series = _agent(instance)
        case.feed(pick(series, "kvpilot_ticks_total"), _ramp(0, case.scrape_s, total))
        overruns = pick(series, "kvpilot_tick_overruns_total")
        case.feed(overruns, _ramp(0, case.scrape_s * share, total))
        if instance == "a":
            fired.append(overruns.alert_labels(severity="warning"))
    case.expect(for_s - case.scrape_s)
    case.expect((total - 2) * case.scrape_s, *fired)
    return case


def _reload(watch: SelfWatch, timing: Timing) -> _Case:
    case = _Case(timing.scrape_interval_s, "KvpilotConfigReloadFailed")
    for_s = timing.for_s(watch.reload_failed_for_s)
    good, total = 4, 4 + case.scrapes(for_s) + 6
    refused = pick(_agent("a"), "kvpilot_config_last_reload_successful")
    case.feed(refused, [1.0] * good + [0.0] * (total - good))
    case.feed(pick(_agent("b"), "kvpilot_config_last_reload_successful"), [1.0] * total)
    # Refused, then a corrected file reloaded before the `for` ran out.
    fixed = pick(_agent("c"), "kvpilot_config_last_reload_successful")
    case.feed(fixed, [1.0] * good + [0.0] * (case.scrapes(for_s) - 2) + [1.0] * 8)
    refused_s = good * case.scrape_s
    case.expect(refused_s + for_s - case.scrape_s)
    case.expect(refused_s + for_s + 2 * case.scrape_s, refused.alert_labels(severity="warning"))
    return case


def _unattended(watch: SelfWatch, timing: Timing) -> _Case:
    case = _Case(timing.scrape_interval_s, "KvpilotUnattendedCanary")
    for_s = timing.for_s(watch.unattended_canary_for_s)
    attended, total = 4, 4 + case.scrapes(for_s) + 6
    left = pick(_agent("a"), "kvpilot_unattended_canaries")
    case.feed(left, [0.0] * attended + [1.0] * (total - attended))
    case.feed(pick(_agent("b"), "kvpilot_unattended_canaries"), [0.0] * total)
    # Found by a sweep and cleaned up by it: marked for one scrape, then 0.
    swept = pick(_agent("c"), "kvpilot_unattended_canaries")
    case.feed(swept, [0.0] * attended + [1.0] + [0.0] * (total - attended - 1))
    left_s = attended * case.scrape_s
    case.expect(left_s + for_s - case.scrape_s)
    case.expect(left_s + for_s + 2 * case.scrape_s, left.alert_labels(severity="critical"))
    return case


def alert_cases(config: RulesConfig, scrape_interval_s: float) -> dict[str, Any]:
    """promtool's test file for the rules generated at `scrape_interval_s`, beside it."""
    timing = Timing(scrape_interval_s)
    watch = SelfWatch()
    cases = [
        _fragmentation(config, timing),
        _preemption(config, timing),
        _saturation(config, timing),
        _stall(config, timing),
        _occupancy(config, timing),
        _deferred(config, timing),
        _growth(config, timing),
        *_absent_and_down(watch, timing),
        _collector_down(watch, timing),
        _outbox(watch, timing),
        _circuit(watch, timing),
        _failure_counter(
            watch, timing, "KvpilotStateWriteErrors", "kvpilot_state_write_errors_total"
        ),
        _failure_counter(
            watch,
            timing,
            "KvpilotNotificationsGivenUp",
            "kvpilot_notifications_total",
            outcome="given_up",
        ),
        _failure_counter(
            watch,
            timing,
            "KvpilotBackgroundTaskFailed",
            "kvpilot_background_task_failures_total",
        ),
        _overruns(watch, timing),
        _reload(watch, timing),
        _unattended(watch, timing),
    ]
    return {
        "rule_files": ["kvpilot.rules.yaml"],
        # Prometheus evaluates the rules about as often as it scrapes.
        "evaluation_interval": f"{round(scrape_interval_s)}s",
        "tests": [case.group() for case in cases],
    }
