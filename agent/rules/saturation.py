"""KV cache saturation: usage near 1 while requests wait for room.

Admission rejections (`vllm:admission_rejections_total`, a queue limit refusing requests)
rising over the last `REJECTIONS_WINDOW_S` travel with the condition, typed for the
remediation ladder and as the `admission_rejections` annotation for people: while the cache
is saturated they say load is turned away, not only queued.
"""

from __future__ import annotations

from kvpilot.agent.model import Condition
from kvpilot.agent.rules.base import ConditionMaker, RuleContext, fmt_ratio
from kvpilot.agent.rules.config import KvSaturationConfig
from kvpilot.collectors.vllm_metrics import EngineSample

ALERTNAME = "VllmKvCacheSaturated"
# The span the rejections' increase is read over: the preemption rule's default window.
REJECTIONS_WINDOW_S = 30.0
RUNBOOK = (
    "The KV cache is full and requests queue for it: time to first token grows and "
    "preemptions follow. Check the load against capacity; give the cache more memory "
    "(gpu_memory_utilization, a smaller max_model_len, an fp8 KV cache) or add replicas."
)


class KvSaturationRule:
    """Per engine: usage at or above `usage_threshold_ratio` with `min_waiting` requests waiting."""

    name = "kv_saturation"

    def __init__(self, config: KvSaturationConfig) -> None:
        self.config = config
        self._maker = ConditionMaker.of(
            config, rule=self.name, alertname=ALERTNAME, runbook=RUNBOOK
        )

    def evaluate(self, ctx: RuleContext) -> list[Condition]:
        return self._maker.per_engine(ctx, self._engine)

    def _engine(self, ctx: RuleContext, sample: EngineSample) -> Condition:
        cfg = self.config
        target = {"model_name": sample.model_name, "engine": sample.engine}
        where = f"engine {sample.engine} of {ctx.instance.name}"
        usage, waiting = sample.kv_usage_ratio, sample.requests_waiting
        if usage is None or waiting is None:
            missing = "KV cache usage" if usage is None else "the waiting-request gauge"
            reason = f"vLLM did not export {missing}"
            summary = f"KV saturation unknown on {where}: {reason}"
            return self._maker.condition(
                ctx,
                target,
                active=None,
                value=None,
                summary=summary,
                description=summary,
                reason=reason,
            )
        active = usage >= cfg.usage_threshold_ratio and waiting >= cfg.min_waiting
        rejected = ctx.vllm_window.increase(
            sample.key, "admission_rejections_total", REJECTIONS_WINDOW_S
        )
        refused = None if rejected is None else rejected > 0
        rejections = (
            "unknown (fewer than two readings of vllm:admission_rejections_total)"
            if rejected is None
            else f"{rejected:g} requests refused by a queue limit in {REJECTIONS_WINDOW_S:g} s"
        )
        verdict = "saturated" if active else "not saturated"
        summary = (
            f"KV cache {verdict} on {where}: usage {fmt_ratio(usage)} "
            f"(threshold {fmt_ratio(cfg.usage_threshold_ratio)}), {waiting} waiting "
            f"(threshold {cfg.min_waiting})"
        )
        description = (
            f"{summary}; {sample.requests_running} running; {rejections}. Fires after "
            f"{cfg.for_s:g} s; action: {cfg.action}."
        )
        return self._maker.condition(
            ctx,
            target,
            active=active,
            value=usage,
            summary=summary,
            description=description,
            extra={"admission_rejections": rejections},
            admission_refused=refused,
        )
