"""The plugin's token-occupancy families, served beside the block-pool families.

`OccupancyCollector` extends the plugin's collector with them, from the same readings in the
same scrape (one snapshot per scrape), so `server.py` keeps only the HTTP side.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client.core import GaugeMetricFamily, Metric

from kvpilot.collectors.kvpool.server import ENGINE_LABELS, EngineReading, KvPoolCollector

GROUP_LABELS = (*ENGINE_LABELS, "kv_group")


def occupancy_families(readings: Sequence[EngineReading]) -> list[Metric]:
    """Per engine and KV group: blocks in use, tokens in them, their ratio; and which block
    sizes the backend accepts."""
    if not readings:
        return []
    ratio = GaugeMetricFamily(
        "kvpool_token_occupancy_ratio",
        "Tokens held / (KV blocks in use x block size), per KV group; free cached blocks are "
        "not in use; absent while no block is in use.",
        labels=list(GROUP_LABELS),
    )
    in_use = GaugeMetricFamily(
        "kvpool_group_blocks_in_use",
        "Distinct KV blocks held by requests, per KV group (the null block excluded).",
        labels=list(GROUP_LABELS),
    )
    tokens = GaugeMetricFamily(
        "kvpool_group_tokens_in_use",
        "Tokens whose KV is written in the blocks in use, per KV group.",
        labels=list(GROUP_LABELS),
    )
    group_block_size = GaugeMetricFamily(
        "kvpool_group_block_size_tokens",
        "Tokens per block of the KV group.",
        labels=list(GROUP_LABELS),
    )
    step = GaugeMetricFamily(
        "kvpool_block_size_step_tokens",
        "The backend accepts block sizes that are multiples of this (CPU 32, CUDA 16).",
        labels=list(ENGINE_LABELS),
    )
    fixed = GaugeMetricFamily(
        "kvpool_block_size_fixed",
        "1 when the model fixes the block size (MLA, hybrid), with the reason.",
        labels=[*ENGINE_LABELS, "reason"],
    )
    for reading in readings:
        snap = reading.snapshot
        if snap is None:
            continue
        labels = [reading.engine, reading.model_name]
        for group in snap.occupancy:
            per_group = [*labels, str(group.group)]
            in_use.add_metric(per_group, group.blocks_in_use)
            tokens.add_metric(per_group, group.tokens)
            group_block_size.add_metric(per_group, group.block_size_tokens)
            if group.ratio is not None:
                ratio.add_metric(per_group, group.ratio)
        choice = snap.block_size_choice
        if choice is not None and choice.step_tokens is not None:
            step.add_metric(labels, choice.step_tokens)
        if choice is not None and choice.fixed_reason is not None:
            fixed.add_metric([*labels, choice.fixed_reason], 1)
    return [ratio, in_use, tokens, group_block_size, step, fixed]


class OccupancyCollector(KvPoolCollector):
    """The plugin's collector plus the token-occupancy families of the same readings."""

    def _engine_families(self, readings: Sequence[EngineReading]) -> list[Metric]:
        return [*super()._engine_families(readings), *occupancy_families(readings)]
