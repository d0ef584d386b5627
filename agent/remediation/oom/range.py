"""The planner's range for the memory knob an instance's argv turns, for the OOM guard.

The KV budget's floor is one request of max_model_len (from the model's config.json); its
ceiling the memory available now (where the server's memory is the host's: no GPU seen)
and the configured `max_kv_cache_memory_bytes`. A model the planner cannot read is a reason.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

from kvpilot.agent.config.remediation import OomConfig
from kvpilot.agent.model_files import find_model_config
from kvpilot.agent.remediation.oom.guard import RangeFor
from kvpilot.agent.remediation.oom.step import NoStep, memory_knob
from kvpilot.collectors.vllm_argv import flag_value, parse_server_argv
from kvpilot.tuner.planner.preflight import KnobRange, kv_bytes_range, utilization_range


def planner_range(
    config: OomConfig,
    *,
    model_config: Path | None = None,
    available_bytes: Callable[[], int | None] = lambda: None,
) -> RangeFor:
    """`range_for(name, argv)`: the knob's range, or why the planner cannot give one."""

    def range_for(name: str, argv: Sequence[str]) -> KnobRange | str:
        setting = memory_knob(argv)
        if isinstance(setting, NoStep):
            return setting.reason
        if setting.knob == "gpu_memory_utilization":
            return utilization_range()
        try:
            found = find_model_config(
                parse_server_argv(argv).model,
                configured=model_config,
                revision=flag_value(argv, "--revision"),
                environ=os.environ,
                home=Path.home(),
            )
            return kv_bytes_range(
                found,
                block_size=int(flag_value(argv, "--block-size") or 16),
                max_model_len=int(flag_value(argv, "--max-model-len") or 0) or None,
                dtype=flag_value(argv, "--dtype") or "auto",
                available_bytes=available_bytes(),
                ceiling_bytes=config.max_kv_cache_memory_bytes,
            )
        except ValueError as exc:  # no config.json, the planner's errors, a malformed flag
            return f"{name}: {exc}"

    return range_for
