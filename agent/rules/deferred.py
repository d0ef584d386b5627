"""Partial starvation: requests deferred past a limit while others run.

A scheduler that stops admitting some requests still steps for the others, so the iteration
counter moves and the stall rule sees progress; only vLLM's
`num_requests_waiting_by_reason{reason="deferred"}` shows it. The gauge counts requests, it
does not age them: a deferred count that never fell to 0 over `deferred_limit_s` while at
least `min_running` requests ran is read as a request deferred that long. Admission
rejections (`vllm:admission_rejections_total`) over the same span travel in the text: a
queue limit refusing requests meanwhile says the queue is backing up behind them.
"""

from __future__ import annotations

from kvpilot.agent.model import Condition
from kvpilot.agent.rules.base import ConditionMaker, RuleContext
from kvpilot.agent.rules.config import RequestsDeferredConfig
from kvpilot.collectors.vllm_metrics import EngineSample

ALERTNAME = "VllmRequestsDeferred"
RUNBOOK = (
    "Some requests have waited deferred (held back by a transient constraint: LoRA budget, "
    "KV transfer, a blocked status) for longer than the limit while other requests run: the "
    "scheduler stopped admitting them, and only a restart recovers it. Check the engine "
    "log for the constraint; a drained restart brings the deferred requests back."
)


def _starving(sample: EngineSample, min_running: int) -> bool | None:
    """Deferred requests while others run; None when vLLM did not say."""
    if sample.requests_deferred is None or sample.requests_running is None:
        return None
    return sample.requests_deferred > 0 and sample.requests_running >= min_running


class RequestsDeferredRule:
    """Per engine: some request deferred for `deferred_limit_s` while others run."""

    name = "requests_deferred"

    def __init__(self, config: RequestsDeferredConfig) -> None:
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
        now = _starving(sample, cfg.min_running)
        if now is None:
            reason = "vLLM did not export num_requests_waiting_by_reason or the running gauge"
            return self._unknown(ctx, target, where, reason)
        if not now:
            summary = f"no request deferred while others run on {where}"
            return self._verdict(ctx, target, False, 0.0, summary, summary)
        older_first = ctx.vllm_window.newest_first(sample.key)
        newest = ctx.vllm_window.latest(sample.key)
        if newest is not None and newest.taken_at_s == sample.taken_at_s:
            next(older_first)  # the sample itself
        start_s, reached_oldest = sample.taken_at_s, True
        for older in older_first:
            if not _starving(older, cfg.min_running):
                reached_oldest = False
                break
            start_s = older.taken_at_s
        deferred_s = sample.taken_at_s - start_s
        if reached_oldest and deferred_s < cfg.deferred_limit_s:
            reason = (
                f"requests deferred in all {deferred_s:g} s observed so far, and the start "
                f"not seen (needs {cfg.deferred_limit_s:g} s)"
            )
            return self._unknown(ctx, target, where, reason)
        active = deferred_s >= cfg.deferred_limit_s
        summary = (
            f"{sample.requests_deferred} requests deferred for {deferred_s:g} s on {where} "
            f"while {sample.requests_running} run (limit {cfg.deferred_limit_s:g} s)"
        )
        rejected = ctx.vllm_window.increase(sample.key, "admission_rejections_total", deferred_s)
        detail = f"; {rejected:g} requests refused by a queue limit meanwhile" if rejected else ""
        description = f"{summary}{detail}; action: {cfg.action}."
        return self._verdict(ctx, target, active, deferred_s, summary, description)

    def _verdict(
        self,
        ctx: RuleContext,
        target: dict[str, str],
        active: bool,
        value: float,
        summary: str,
        description: str,
    ) -> Condition:
        return self._maker.condition(
            ctx, target, active=active, value=value, summary=summary, description=description
        )

    def _unknown(
        self, ctx: RuleContext, target: dict[str, str], where: str, reason: str
    ) -> Condition:
        summary = f"deferred requests unknown on {where}: {reason}"
        return self._maker.condition(
            ctx,
            target,
            active=None,
            value=None,
            summary=summary,
            description=summary,
            reason=reason,
        )
