"""Preemption spike: the rate over a short window above a floor and above its own baseline.

The counter is the kvpool plugin's (engine-side, no lag) where that engine has one, else
vLLM's `vllm:num_preemptions_total` (which lags until the victim produces output again).
The short-window rate is the counter's increase over `window_s` divided by `window_s`.
The baseline is the rate over `baseline_window_s` before the short window; without such
history (a fresh server, a fresh agent) the floor alone decides. The capacity-leak signature
(KV usage high while few requests run) travels with the condition, typed, to the
remediation ladder; the `capacity_leak` annotation says it to people. So does thrash:
of the requests that finished in the window (`vllm:request_num_preemptions`, preemptions
per finished request), the share preempted more than once says whether the same requests
are evicted again and again (the KV cache is too small for the admitted batch: admit fewer)
or a burst was spread over many requests once each.
"""

from __future__ import annotations

from kvpilot.agent.model import Condition
from kvpilot.agent.rules.base import ConditionMaker, RuleContext
from kvpilot.agent.rules.config import PreemptionSpikeConfig
from kvpilot.collectors.histogram import Histogram
from kvpilot.collectors.kvpool.client import KvBlockSample
from kvpilot.collectors.vllm_metrics import EngineSample
from kvpilot.collectors.window import RollingWindow

ALERTNAME = "VllmPreemptionSpike"
FIELD = "preemptions_total"
RUNBOOK = (
    "The KV cache is too small for the load: the scheduler evicts running requests and "
    "recomputes them, so latency climbs. Compare the rate with the baseline; if a tuned "
    "configuration has been validated, promote it; if KV usage is high while few requests "
    "run, suspect a capacity leak and restart; otherwise run the tuner (gpu_memory_utilization, "
    "max_num_seqs, max_num_batched_tokens) or shed load."
)

# The preemption counter is read from the kvpool plugin's window when it has one, else vLLM's.
CounterWindow = RollingWindow[EngineSample] | RollingWindow[KvBlockSample]
# Thrash: at least this share of the window's finished requests preempted more than once.
# A burst evicts each victim once; a batch too large for the cache evicts the same requests
# again after every recompute, and one in five doing so is already that pattern.
THRASH_REPEAT_SHARE_RATIO = 0.2


def repeat_preempted_share(finished: Histogram | None) -> float | None:
    """The share of finished requests preempted more than once; None without finished
    requests or without vLLM's `le="1"` bucket."""
    if finished is None or finished.count <= 0:
        return None
    at_most_once = next((n for le, n in finished.buckets if le == 1.0), None)
    if at_most_once is None:
        return None
    return (finished.count - at_most_once) / finished.count


def baseline_rate(
    window: CounterWindow,
    key: tuple[str, str],
    *,
    window_s: float,
    baseline_window_s: float,
) -> float | None:
    """The counter's rate over the baseline span, which ends where the short window starts:
    at the first value of the short window, so that the spans share that point."""
    newest_s = window.newest_known_at_s(key, FIELD)
    latest = window.latest(key)
    if newest_s is None or latest is None:
        return None
    start_s = latest.taken_at_s - baseline_window_s
    span = window.increase_between(key, FIELD, start_s, newest_s - window_s)
    # A baseline shorter than the short window is noise: leave the decision to the floor.
    if span is None or span[0] < window_s:
        return None
    seconds, increase = span
    return increase / seconds


class PreemptionSpikeRule:
    """Per engine: short-window rate above `floor_per_s` and `baseline_multiple` x baseline."""

    name = "preemption_spike"

    def __init__(self, config: PreemptionSpikeConfig) -> None:
        self.config = config
        self._maker = ConditionMaker.of(
            config, rule=self.name, alertname=ALERTNAME, runbook=RUNBOOK
        )

    def evaluate(self, ctx: RuleContext) -> list[Condition]:
        return self._maker.per_engine(ctx, self._engine)

    def _counter_window(self, ctx: RuleContext, sample: EngineSample) -> tuple[CounterWindow, str]:
        latest = ctx.kvpool_window.latest(sample.key)
        if latest is not None and getattr(latest, "preemptions_total", None) is not None:
            return ctx.kvpool_window, "kvpool"
        return ctx.vllm_window, "vllm"

    def _engine(self, ctx: RuleContext, sample: EngineSample) -> Condition:
        cfg = self.config
        target = {"model_name": sample.model_name, "engine": sample.engine}
        where = f"engine {sample.engine} of {ctx.instance.name}"
        window, counter = self._counter_window(ctx, sample)
        increase = window.increase(sample.key, FIELD, cfg.window_s)
        # Divided by the whole window, not the time covered: a fresh agent's first seconds
        # must not turn one preemption into a spike.
        rate = None if increase is None else increase / cfg.window_s
        leak = self._capacity_leak(sample)
        finished = ctx.vllm_window.histogram_over(sample.key, "request_preemptions", cfg.window_s)
        share = repeat_preempted_share(finished)
        thrash = None if share is None else share >= THRASH_REPEAT_SHARE_RATIO
        # The annotations say it to people; the remediator reads the typed facts.
        extra = {
            "counter": counter,
            "capacity_leak": _leak_text(leak),
            "thrash": _thrash_text(finished, share),
        }
        if rate is None:
            reason = f"fewer than two {counter} preemption counter readings in {cfg.window_s:g} s"
            summary = f"preemption rate unknown on {where}: {reason}"
            return self._maker.condition(
                ctx,
                target,
                active=None,
                value=None,
                summary=summary,
                description=summary,
                reason=reason,
                extra=extra,
                capacity_leak=leak,
                thrash=thrash,
            )
        baseline = baseline_rate(
            window, sample.key, window_s=cfg.window_s, baseline_window_s=cfg.baseline_window_s
        )
        above_floor = rate > cfg.floor_per_s
        above_baseline = baseline is None or rate > cfg.baseline_multiple * baseline
        active = above_floor and above_baseline
        baseline_text = (
            "no baseline yet (the floor alone decides)"
            if baseline is None
            else f"baseline {baseline:.3f}/s over the {cfg.baseline_window_s:g} s before, "
            f"limit {cfg.baseline_multiple:g}x = {cfg.baseline_multiple * baseline:.3f}/s"
        )
        verdict = "spike" if active else "no spike"
        summary = (
            f"{verdict}: {rate:.3f} preemptions/s over {cfg.window_s:g} s on {where} "
            f"(floor {cfg.floor_per_s:g}/s)"
        )
        description = (
            f"{summary}; {baseline_text}; counter: {counter}; "
            f"capacity-leak signature: {_leak_text(leak)}; thrash: {extra['thrash']}; "
            f"action: {cfg.action}."
        )
        if baseline is not None:
            extra["baseline_per_s"] = f"{baseline:.6g}"
        return self._maker.condition(
            ctx,
            target,
            active=active,
            value=rate,
            summary=summary,
            description=description,
            extra=extra,
            capacity_leak=leak,
            thrash=thrash,
        )

    def _capacity_leak(self, sample: EngineSample) -> bool | None:
        """Whether KV usage is high while few requests run; None without the figures."""
        usage, running = sample.kv_usage_ratio, sample.requests_running
        if usage is None or running is None:
            return None
        return (
            usage >= self.config.capacity_leak_usage_ratio
            and running <= self.config.capacity_leak_max_running
        )


def _leak_text(leak: bool | None) -> str:
    return "unknown" if leak is None else str(leak).lower()


def _thrash_text(finished: Histogram | None, share: float | None) -> str:
    if finished is None or share is None:
        return "unknown (no request finished in the window, or no per-request preemption counts)"
    verdict = "true" if share >= THRASH_REPEAT_SHARE_RATIO else "false"
    return (
        f"{verdict}: {share:.0%} of {finished.count:g} finished requests preempted more than "
        f"once, {finished.sum / finished.count:.2f} preemptions per finished request "
        f"(thrash from {THRASH_REPEAT_SHARE_RATIO:.0%})"
    )
