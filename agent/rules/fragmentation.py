"""Fragmentation above a threshold, per source: the KV block pool and the CUDA allocator.

Both come from the kvpool plugin. `kv_blocks` honours the guard: while too few blocks are
free the rate is unknown, and so is the condition. Without a plugin configured there is
nothing to evaluate and the rule says nothing.
"""

from __future__ import annotations

from typing import Literal

from kvpilot.agent.model import Condition
from kvpilot.agent.rules.base import ConditionMaker, RuleContext, fmt_ratio, source_error_text
from kvpilot.agent.rules.config import FragmentationSourceConfig
from kvpilot.collectors.errors import SourceError
from kvpilot.collectors.fragmentation import NO_FREE_BYTES
from kvpilot.collectors.kvpool.client import AllocatorSample, KvBlockSample

ALERTNAME = "VllmKvFragmentationHigh"
FragmentationSource = Literal["kv_blocks", "allocator"]
RUNBOOKS = {
    "kv_blocks": "The KV block pool's free list is scattered: paged attention takes any free "
    "block, so requests are still admitted and no capacity is lost; locality and KV offload "
    "copies suffer. A restart cannot fix this value: it resets the figure and the load "
    "scatters the free list again, so it is alert-only unless configured. Capacity lost to "
    "partly filled blocks is VllmKvTokenOccupancyLow's. vLLM 0.32's CPU KV offload keeps its "
    "host buffers in a paged block pool too, so no host arena where contiguity costs memory "
    "is exposed to rate.",
    "allocator": "The CUDA caching allocator holds free memory in pieces too small to use: "
    "runtime OOMs happen here. A drained restart gives the allocator contiguous memory back; "
    "if it returns quickly, lower max_num_seqs or max_num_batched_tokens, or leave more "
    "headroom (lower gpu_memory_utilization).",
}


class FragmentationRule:
    """`1 - largest contiguous free / total free` of one pool above `threshold_ratio`."""

    def __init__(self, source: FragmentationSource, config: FragmentationSourceConfig) -> None:
        self.name = f"fragmentation_{source}"
        self.source = source
        self.config = config
        self._maker = ConditionMaker.of(
            config, rule=self.name, alertname=ALERTNAME, runbook=RUNBOOKS[source]
        )

    def evaluate(self, ctx: RuleContext) -> list[Condition]:
        scrape = ctx.snapshot.kvpool
        if scrape is None:
            return []
        if isinstance(scrape, SourceError):
            return self._maker.unknown_all(ctx, source_error_text(scrape))
        if self.source == "kv_blocks":
            out = [self._kv_blocks(ctx, sample) for sample in scrape.engines]
        else:
            out = [self._allocator(ctx, sample) for sample in scrape.allocators]
        self._maker.forget_except(ctx, out)
        return out

    def _kv_blocks(self, ctx: RuleContext, sample: KvBlockSample) -> Condition:
        target = {
            "model_name": sample.model_name,
            "engine": sample.engine,
            "source": "kv_blocks",
        }
        where = f"engine {sample.engine} of {ctx.instance.name}"
        frag = sample.fragmentation
        if frag is None or frag.ratio is None:
            reason = (
                frag.reason
                if frag is not None and frag.reason
                else "the plugin did not report the block counts"
            )
            return self._unknown(ctx, target, where, reason)
        detail = (
            f"longest free run {frag.longest_free_run} of {frag.free} free blocks "
            f"({frag.total} in the pool)"
        )
        return self._judge(ctx, target, where, frag.ratio, detail)

    def _allocator(self, ctx: RuleContext, sample: AllocatorSample) -> Condition:
        target = {"device": sample.device, "rank": sample.rank, "source": "allocator"}
        where = f"device {sample.device} (rank {sample.rank}) of {ctx.instance.name}"
        ratio = sample.fragmentation_ratio
        if ratio is None:
            reason = (
                NO_FREE_BYTES
                if sample.free_in_reserved_bytes == 0
                else "the plugin did not report the allocator's fragmentation"
            )
            return self._unknown(ctx, target, where, reason)
        detail = (
            f"largest free block {sample.largest_free_block_bytes} of "
            f"{sample.free_in_reserved_bytes} free bytes in {sample.reserved_bytes} reserved"
        )
        return self._judge(ctx, target, where, ratio, detail)

    def _judge(
        self, ctx: RuleContext, target: dict[str, str], where: str, ratio: float, detail: str
    ) -> Condition:
        threshold = self.config.threshold_ratio
        active = ratio > threshold
        relation = "above" if active else "at or below"
        summary = (
            f"{self.source} fragmentation {fmt_ratio(ratio)} {relation} "
            f"{fmt_ratio(threshold)} on {where}"
        )
        description = (
            f"{summary}: {detail}. Fires after {self.config.for_s:g} s above the threshold; "
            f"action: {self.config.action}."
        )
        if self.source == "kv_blocks":
            description += (
                " A restart cannot fix the KV-pool value: paged attention takes any free "
                "block, and the load scatters the free list again."
            )
        return self._maker.condition(
            ctx,
            target,
            active=active,
            value=ratio,
            summary=summary,
            description=description,
            extra={"threshold": fmt_ratio(threshold)},
        )

    def _unknown(
        self, ctx: RuleContext, target: dict[str, str], where: str, reason: str
    ) -> Condition:
        summary = f"{self.source} fragmentation unknown on {where}: {reason}"
        return self._maker.condition(
            ctx,
            target,
            active=None,
            value=None,
            summary=summary,
            description=summary,
            reason=reason,
        )
