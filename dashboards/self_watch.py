"""Rules that watch kvpilot itself: no target up, one target down, a collector down, the
outbox, the circuit breaker, its failure counters, a refused reload and a canary left serving
with nobody attending it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpilot.dashboards.rule_context import WHERE, AlertContext, duration, number


@dataclass(frozen=True, slots=True)
class SelfWatch:
    """Thresholds of the rules that watch kvpilot itself."""

    job: str = "kvpilot"
    absent_for_s: float = 300.0
    down_for_s: float = 300.0
    collector_down_for_s: float = 300.0
    outbox_backlog_rows: int = 100
    outbox_backlog_for_s: float = 900.0
    circuit_open_for_s: float = 0.0
    failures_window_s: float = 600.0  # an error counter that moved within it alerts
    overrun_ratio: float = 0.1  # of ticks
    overrun_for_s: float = 600.0
    reload_failed_for_s: float = 300.0
    unattended_canary_for_s: float = 0.0  # its share of live traffic is at stake now


def _moved(counter: str, window: str) -> str:
    """A counter that rose within `window`, or appeared within it (its first sample is
    already at least 1, which `increase` alone does not see)."""
    return f"increase({counter}[{window}]) > 0 or ({counter} unless {counter} offset {window})"


def self_watch_rules(watch: SelfWatch, ctx: AlertContext) -> list[dict[str, Any]]:
    """The self-watch alerts, timed and annotated by `ctx`."""
    timing = ctx.timing

    def rule(
        name: str, expr: str, for_s: float, severity: str, summary: str, description: str
    ) -> dict[str, Any]:
        return {
            "alert": name,
            "expr": expr,
            "for": duration(timing.for_s(for_s)),
            "labels": {"severity": severity},
            "annotations": ctx.annotations(name, summary, description),
        }

    failures = duration(timing.window_s(watch.failures_window_s))
    unavailable = duration(timing.window_s(watch.collector_down_for_s))
    overruns = duration(timing.window_s(watch.overrun_for_s))
    return [
        rule(
            "KvpilotAbsent",
            f'absent(up{{job="{watch.job}"}} == 1)',
            watch.absent_for_s,
            "critical",
            f'No kvpilot target of job "{watch.job}" is up',
            "Nothing watches vLLM's memory: no alert, remediation or tuning runs.",
        ),
        rule(
            "KvpilotDown",
            f'up{{job="{watch.job}"}} == 0',
            watch.down_for_s,
            "warning",
            f"kvpilot on {WHERE} is not scraped",
            "Prometheus cannot scrape this kvpilot: the vLLM server beside it is not watched.",
        ),
        rule(
            "KvpilotCollectorDown",
            # A source that is not on this machine (NVML without a driver) counts
            # `unavailable` on every read: it is not down. An old `unavailable` is forgotten.
            "kvpilot_collector_up == 0 unless on (instance, job, server, source) "
            f'increase(kvpilot_collector_errors_total{{reason="unavailable"}}[{unavailable}]) > 0',
            watch.collector_down_for_s,
            "warning",
            "kvpilot cannot read {{ $labels.source }} of server {{ $labels.server }} "
            f"on {WHERE}",
            "The source's reads fail (see kvpilot_collector_errors_total by reason); rules "
            "that need it see unknown, never healthy.",
        ),
        rule(
            "KvpilotOutboxBacklog",
            f"kvpilot_outbox_backlog > {watch.outbox_backlog_rows}",
            watch.outbox_backlog_for_s,
            "warning",
            f"{{{{ $value }}}} notifications wait for delivery on {WHERE}",
            "A notification receiver is failing; kvpilot retries with backoff.",
        ),
        rule(
            "KvpilotRemediationCircuitOpen",
            "kvpilot_remediation_circuit_open == 1",
            watch.circuit_open_for_s,
            "critical",
            f"kvpilot stopped remediating server {{{{ $labels.server }}}} on {WHERE}",
            "Restarts did not keep the condition away, so the circuit breaker opened. "
            "A person must look.",
        ),
        rule(
            "KvpilotStateWriteErrors",
            _moved("kvpilot_state_write_errors_total", failures),
            0.0,
            "warning",
            f"kvpilot on {WHERE} cannot write its state ({{{{ $labels.reason }}}})",
            "Alert states, the outbox and trials are written to the state database; "
            "what a failed tick decided is retried on the next one.",
        ),
        rule(
            "KvpilotNotificationsGivenUp",
            _moved('kvpilot_notifications_total{outcome="given_up"}', failures),
            0.0,
            "warning",
            f"kvpilot on {WHERE} gave up notifications to {{{{ $labels.notifier }}}}",
            "Deliveries failed past their retry budget: those notifications were lost.",
        ),
        rule(
            "KvpilotBackgroundTaskFailed",
            _moved("kvpilot_background_task_failures_total", failures),
            0.0,
            "warning",
            f"kvpilot's {{{{ $labels.task }}}} task failed on {WHERE}",
            "A background task ended with an error; its traceback is in kvpilot's log.",
        ),
        rule(
            "KvpilotTickOverruns",
            f"rate(kvpilot_tick_overruns_total[{overruns}]) "
            f"> {number(watch.overrun_ratio)} * rate(kvpilot_ticks_total[{overruns}])",
            watch.overrun_for_s,
            "warning",
            f"kvpilot's ticks on {WHERE} overrun their interval",
            "Reading the sources takes longer than the tick interval: rules see older data.",
        ),
        rule(
            "KvpilotConfigReloadFailed",
            "kvpilot_config_last_reload_successful == 0",
            watch.reload_failed_for_s,
            "warning",
            f"kvpilot on {WHERE} refused its reloaded configuration",
            "The file kvpilot reads is invalid: it runs on the configuration it had, and "
            "would not start on the file as it is.",
        ),
        rule(
            "KvpilotUnattendedCanary",
            "kvpilot_unattended_canaries > 0",
            watch.unattended_canary_for_s,
            "critical",
            "A canary of {{ $labels.deployment }} serves with nobody attending it "
            f"(kvpilot on {WHERE})",
            "kvpilot found a canary no trial owns, or could not take the canary's share of "
            "live traffic back: it keeps serving that share until it is cleaned up.",
        ),
    ]
