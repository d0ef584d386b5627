"""Low token occupancy: blocks mostly in use while the tokens in them fill few of their slots.

Block usage counts a block as used however little of it a request wrote; token occupancy is
tokens / (blocks in use x block size), per KV group, from the kvpool plugin (free cached
blocks are not in use). High usage with low occupancy means capacity lost to partly filled
tail blocks: a smaller `--block-size` gives it back. The alert names a size the backend
accepts. A restart with the same flags changes nothing, so the rule only alerts.
"""

from __future__ import annotations

from kvpilot.agent.model import Condition
from kvpilot.agent.rules.base import ConditionMaker, RuleContext, fmt_ratio, source_error_text
from kvpilot.agent.rules.config import TokenOccupancyConfig
from kvpilot.collectors.errors import SourceError
from kvpilot.collectors.kvpool.client import GroupOccupancySample, KvBlockSample

ALERTNAME = "VllmKvTokenOccupancyLow"
RUNBOOK = (
    "Most KV blocks are in use but the tokens in them fill few of their slots: short "
    "requests leave their last block mostly empty, so the pool admits fewer requests than "
    "its memory could hold. Restart with a smaller --block-size the attention backend "
    "accepts (CPU: multiples of 32, vLLM's default there is 128; most CUDA backends: "
    "multiples of 16); MLA and hybrid models fix the size, so give them a larger KV budget "
    "instead. A restart with the same flags does not help."
)


def recommended_block_size(current: int, step: int) -> int | None:
    """Half the current size, on the backend's step and at least one step; None when the
    current size is already the smallest the backend takes."""
    smaller = max(step, (current // 2) // step * step)
    return smaller if smaller < current else None


def recommendation(sample: KvBlockSample, group: GroupOccupancySample) -> str:
    """What to change, in words that name a block size the backend accepts."""
    current, step = group.block_size_tokens, sample.block_size_step_tokens
    if sample.block_size_fixed_reason:
        return (
            f"the block size cannot change here ({sample.block_size_fixed_reason}): give the "
            "KV cache more memory instead"
        )
    if current is None or step is None:
        return (
            "restart with a smaller --block-size the attention backend accepts (the plugin "
            "did not say which sizes it takes)"
        )
    smaller = recommended_block_size(current, step)
    if smaller is None:
        return (
            f"--block-size {current} is already the smallest this backend accepts (multiples "
            f"of {step}): give the KV cache more memory instead"
        )
    return (
        f"restart with --block-size {smaller} (this backend accepts multiples of {step}): "
        "smaller tail blocks leave fewer slots empty"
    )


class TokenOccupancyRule:
    """Per engine and KV group: block usage above a bound while token occupancy is below one."""

    name = "token_occupancy"

    def __init__(self, config: TokenOccupancyConfig) -> None:
        self.config = config
        self._maker = ConditionMaker.of(
            config, rule=self.name, alertname=ALERTNAME, runbook=RUNBOOK
        )

    def evaluate(self, ctx: RuleContext) -> list[Condition]:
        scrape = ctx.snapshot.kvpool
        if scrape is None:
            return []
        if isinstance(scrape, SourceError):
            return self._maker.unknown_all(ctx, source_error_text(scrape))
        out = [
            self._group(ctx, sample, group)
            for sample in scrape.engines
            for group in sample.occupancy
        ]
        self._maker.forget_except(ctx, out)
        return out

    def _group(
        self, ctx: RuleContext, sample: KvBlockSample, group: GroupOccupancySample
    ) -> Condition:
        cfg = self.config
        target = {
            "model_name": sample.model_name,
            "engine": sample.engine,
            "kv_group": group.kv_group,
        }
        where = f"KV group {group.kv_group} of engine {sample.engine} on {ctx.instance.name}"
        total, free = sample.blocks_total, sample.blocks_free
        usage = (total - free) / total if total and free is not None else None
        if usage is None:
            return self._unknown(ctx, target, where, "the plugin did not report the block counts")
        if usage <= cfg.usage_above_ratio:
            # Plenty of free blocks: occupancy costs no capacity yet, known or not.
            summary = (
                f"token occupancy not costing capacity on {where}: block usage "
                f"{fmt_ratio(usage)} at or below {fmt_ratio(cfg.usage_above_ratio)}"
            )
            return self._verdict(ctx, target, False, group.ratio, summary, summary)
        if group.ratio is None:
            return self._unknown(ctx, target, where, group.reason or "no token count")
        active = group.ratio < cfg.occupancy_below_ratio
        relation = "below" if active else "at or above"
        summary = (
            f"token occupancy {fmt_ratio(group.ratio)} {relation} "
            f"{fmt_ratio(cfg.occupancy_below_ratio)} with block usage {fmt_ratio(usage)} on "
            f"{where}"
        )
        detail = (
            f"{group.tokens} tokens in {group.blocks_in_use} blocks of "
            f"{group.block_size_tokens} tokens"
        )
        description = f"{summary}: {detail}."
        if active:
            description += f" Recommendation: {recommendation(sample, group)}."
        description += f" Fires after {cfg.for_s:g} s; action: {cfg.action}."
        return self._verdict(ctx, target, active, group.ratio, summary, description)

    def _verdict(
        self,
        ctx: RuleContext,
        target: dict[str, str],
        active: bool,
        value: float | None,
        summary: str,
        description: str,
    ) -> Condition:
        return self._maker.condition(
            ctx,
            target,
            active=active,
            value=value,
            summary=summary,
            description=description,
            extra={"threshold": fmt_ratio(self.config.occupancy_below_ratio)},
        )

    def _unknown(
        self, ctx: RuleContext, target: dict[str, str], where: str, reason: str
    ) -> Condition:
        summary = f"token occupancy unknown on {where}: {reason}"
        return self._maker.condition(
            ctx,
            target,
            active=None,
            value=None,
            summary=summary,
            description=summary,
            reason=reason,
        )
