"""Recording rules per model and per namespace: the few series a fleet view or a federating
Prometheus reads instead of every pod's.

Names follow Prometheus's `level:metric:operations` convention. They group by `namespace`
(the scrape target's, absent on a Prometheus outside Kubernetes, where all is one group)
and `model_name`, so replicas of one model add up whatever their pods are called.
"""

from __future__ import annotations

from typing import Any

PER_MODEL = "namespace, model_name"
PER_NAMESPACE = "namespace"


def _rule(level: str, metric: str, operation: str, expr: str) -> dict[str, Any]:
    level_name = level.replace(", ", "_")
    return {
        "record": f"{level_name}:{metric}:{operation}",
        "expr": f"{operation} by ({level}) ({expr})",
    }


def aggregate_rules(preemption_rate: str, server_gpu_memory: str) -> list[dict[str, Any]]:
    """Per model: KV usage (its highest and mean), requests running and waiting, and
    preemptions per second; per namespace: requests, preemptions, the servers' GPU memory and
    kvpilot's firing alerts. `preemption_rate` and `server_gpu_memory` are the recording
    rules these build on."""
    rules = [
        _rule(PER_MODEL, "kvpilot_kv_usage_ratio", "max", "kvpilot_kv_usage_ratio"),
        _rule(PER_MODEL, "kvpilot_kv_usage_ratio", "avg", "kvpilot_kv_usage_ratio"),
    ]
    for level in (PER_MODEL, PER_NAMESPACE):
        rules += [
            _rule(level, "kvpilot_requests_running", "sum", "kvpilot_requests_running"),
            _rule(level, "kvpilot_requests_waiting", "sum", "kvpilot_requests_waiting"),
            _rule(level, "kvpilot_preemption_rate_per_second", "sum", preemption_rate),
        ]
    rules += [
        _rule(PER_NAMESPACE, "kvpilot_gpu_server_memory_bytes", "sum", server_gpu_memory),
        _rule(PER_NAMESPACE, "kvpilot_alerts_firing", "sum", 'kvpilot_alerts{state="firing"}'),
    ]
    return rules
