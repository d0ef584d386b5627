"""Engine stall: requests waiting or running while the iteration counter does not move.

vLLM's `/health` stays 200 while the engine is wedged; progress is the only liveness. The
stall lasts from the first sample of the newest run of readings in which the counter kept
its value and requests were present. A run that reaches back to the oldest reading in the
window, shorter than `stall_s`, is unknown: the progress before it was not seen.
"""

from __future__ import annotations

from kvpilot.agent.model import Condition
from kvpilot.agent.rules.base import ConditionMaker, RuleContext
from kvpilot.agent.rules.config import EngineStallConfig
from kvpilot.collectors.vllm_metrics import EngineSample

ALERTNAME = "VllmEngineStalled"
RUNBOOK = (
    "Requests are queued or running but the engine takes no steps; /health still answers "
    "200. Look at the engine-core process (CPU, a stuck collective, a hung GPU kernel with "
    "py-spy or nvidia-smi) and its log; a drained restart recovers it."
)


def _load(sample: EngineSample) -> int | None:
    if sample.requests_running is None or sample.requests_waiting is None:
        return None
    return sample.requests_running + sample.requests_waiting


class EngineStallRule:
    """Per engine: load present and `iterations_total` unchanged for `stall_s`."""

    name = "engine_stall"

    def __init__(self, config: EngineStallConfig) -> None:
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
        load = _load(sample)
        if sample.iterations_total is None or load is None:
            missing = "the iteration counter" if load is not None else "the request gauges"
            return self._unknown(ctx, target, where, f"vLLM did not export {missing}")
        if load == 0:
            return self._judge(ctx, target, where, 0.0, load)
        older_first = ctx.vllm_window.newest_first(sample.key)  # no copy of the window
        newest = ctx.vllm_window.latest(sample.key)
        if newest is not None and newest.taken_at_s == sample.taken_at_s:
            next(older_first)  # the sample itself
        start_s, reached_oldest = sample.taken_at_s, True
        for older in older_first:
            if older.iterations_total != sample.iterations_total or not _load(older):
                reached_oldest = False
                break
            start_s = older.taken_at_s
        stalled_s = sample.taken_at_s - start_s
        if reached_oldest and stalled_s < cfg.stall_s:
            reason = (
                f"no progress in the {stalled_s:g} s observed so far, and none seen before "
                f"(needs {cfg.stall_s:g} s)"
            )
            return self._unknown(ctx, target, where, reason)
        return self._judge(ctx, target, where, stalled_s, load)

    def _judge(
        self,
        ctx: RuleContext,
        target: dict[str, str],
        where: str,
        stalled_s: float,
        load: int,
    ) -> Condition:
        cfg = self.config
        active = stalled_s >= cfg.stall_s
        summary = (
            f"engine stalled on {where}: no step for {stalled_s:g} s with {load} requests "
            f"waiting or running (threshold {cfg.stall_s:g} s)"
            if active
            else f"engine progressing on {where} ({load} requests waiting or running)"
        )
        description = f"{summary}; action: {cfg.action}."
        return self._maker.condition(
            ctx,
            target,
            active=active,
            value=stalled_s,
            summary=summary,
            description=description,
        )

    def _unknown(
        self,
        ctx: RuleContext,
        target: dict[str, str],
        where: str,
        reason: str,
    ) -> Condition:
        summary = f"engine stall unknown on {where}: {reason}"
        return self._maker.condition(
            ctx,
            target,
            active=None,
            value=None,
            summary=summary,
            description=summary,
            reason=reason,
        )
