"""A snapshot as JSON-ready data and as rich tables (for `collect --once` and the live view)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from kvpilot.agent.readings.derive import EngineFigures
from kvpilot.agent.readings.snapshot import Snapshot
from kvpilot.agent.tick.calibration import EngineCalibration
from kvpilot.collectors.errors import SourceError
from kvpilot.collectors.gpu_samples import NvmlSnapshot
from kvpilot.collectors.kvpool.client import KvBlockSample, KvPoolScrape
from kvpilot.collectors.vllm_metrics import VllmScrape

_HISTOGRAM_FIELDS = ("ttft", "inter_token_latency", "e2e_latency", "queue_time")


def to_data(
    snapshot: Snapshot,
    figures: tuple[EngineFigures, ...],
    calibrations: tuple[EngineCalibration, ...] = (),
) -> dict[str, Any]:
    """Plain data for `--json`: sources as they were read, plus the window's figures."""
    return {
        "planner": [_jsonable(dataclasses.asdict(c)) for c in calibrations],
        "taken_at_wall_s": snapshot.wall_time_s,
        "vllm": _source_data(snapshot.vllm, drop=_HISTOGRAM_FIELDS),
        "kvpool": None if snapshot.kvpool is None else _source_data(snapshot.kvpool),
        "nvml": _source_data(snapshot.nvml),
        "figures": [_jsonable(dataclasses.asdict(f)) for f in figures],
        "durations_s": dict(snapshot.durations_s),
    }


def _source_data(value: object, drop: tuple[str, ...] = ()) -> dict[str, Any]:
    if isinstance(value, SourceError):
        return {"status": "error", "kind": value.kind, "message": value.message}
    data = _jsonable(dataclasses.asdict(value))  # type: ignore[call-overload]  # a dataclass here
    for engine in data.get("engines", ()):
        for name in drop:
            engine.pop(name, None)
    return {"status": "ok", **data}


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no inf; "inf" is what Prometheus's le says too
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


# --- rich ---------------------------------------------------------------------------------


def _fmt(value: float | int | None, unit: str = "", digits: int = 0) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}{unit}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def _gib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**30:.2f}"


def _problem(name: str, error: SourceError) -> Text:
    return Text(
        f"{name}: {'unavailable' if error.kind == 'unavailable' else error.kind} ({error.message})",
        style="yellow",
    )


def render(
    snapshot: Snapshot,
    figures: tuple[EngineFigures, ...],
    calibrations: tuple[EngineCalibration, ...] = (),
) -> RenderableType:
    """Every source of one snapshot as tables; a failed source as one line with its reason."""
    parts: list[RenderableType] = []
    parts.append(_nvml(snapshot.nvml))
    if isinstance(snapshot.vllm, SourceError):
        parts.append(_problem("vllm", snapshot.vllm))
    else:
        parts.append(_engines(snapshot.vllm, snapshot.kvpool))
        parts.append(_latency(figures))
    if isinstance(snapshot.kvpool, SourceError):
        parts.append(_problem("kvpool", snapshot.kvpool))
    elif snapshot.kvpool is None:
        parts.append(Text("kvpool: not configured (--kvpool-url)", style="dim"))
    for item in calibrations:
        where = f"planner (engine {item.engine})"
        if item.calibration is None:
            parts.append(Text(f"{where}: no comparison ({item.error})", style="yellow"))
        else:
            warn = bool(item.calibration.warning)
            parts.append(
                Text(f"{where}: {item.calibration.summary}", style="yellow" if warn else "")
            )
    return Group(*parts)


def _nvml(nvml: NvmlSnapshot | SourceError) -> RenderableType:
    if isinstance(nvml, SourceError):
        return _problem("nvml", nvml)
    table = Table(title="GPU memory (NVML, GiB)", title_justify="left")
    for column in ("gpu", "name", "total", "used", "free", "reserved", "vLLM", "others", "util"):
        table.add_column(column, justify="right")
    for gpu in nvml.gpus:
        util = gpu.utilization_gpu_ratio
        table.add_row(
            str(gpu.index),
            gpu.name or "-",
            _gib(gpu.total_bytes),
            _gib(gpu.used_bytes),
            _gib(gpu.free_bytes),
            _gib(gpu.reserved_bytes),
            _gib(gpu.server_used_bytes()),
            _gib(gpu.neighbour_used_bytes()),
            "-" if util is None else f"{util:.0%}",
        )
        for mig in gpu.mig_instances:
            table.add_row(
                f"{gpu.index}/mig{mig.mig_index}",
                "MIG",
                _gib(mig.total_bytes),
                _gib(mig.used_bytes),
                _gib(mig.free_bytes),
                "-",
                "-",
                "-",
                "-",
            )
    return table


def _engines(vllm: VllmScrape, kvpool: KvPoolScrape | SourceError | None) -> RenderableType:
    pool: dict[tuple[str, str], KvBlockSample] = {}
    if isinstance(kvpool, KvPoolScrape):
        pool = {(e.model_name, e.engine): e for e in kvpool.engines}
        # The plugin may not know the served model name: match by engine alone then.
        pool |= {("", e.engine): e for e in kvpool.engines}
    version = f" vLLM {vllm.vllm_version}" if vllm.vllm_version else ""
    table = Table(title=f"KV cache and scheduler{version}", title_justify="left")
    columns = (
        "model",
        "engine",
        "usage",
        "blocks",
        "free",
        "cached",
        "longest run",
        "frag (kv_blocks)",
        "running",
        "waiting",
        "preempt vllm",
        "preempt kvpool",
    )
    for column in columns:
        table.add_column(column, justify="right")
    if not vllm.engines:
        table.add_row(*("-" for _ in columns))
    for e in vllm.engines:
        p = pool.get((e.model_name, e.engine)) or pool.get(("", e.engine))
        table.add_row(
            e.model_name,
            e.engine,
            _fmt(_pct(e.kv_usage_ratio), "%", 1),
            _fmt(e.blocks_total),
            _fmt(p.blocks_free if p else e.blocks_free),
            _fmt(p.blocks_free_cached if p else None),
            _fmt(p.longest_free_run_blocks if p else None),
            _fragmentation(p),
            _fmt(e.requests_running),
            _fmt(e.requests_waiting),
            _fmt(e.preemptions_total),
            _fmt(p.preemptions_total if p else None),
        )
    return table


def _pct(ratio: float | None) -> float | None:
    return None if ratio is None else ratio * 100


def _fragmentation(sample: KvBlockSample | None) -> str:
    if sample is None or sample.fragmentation is None:
        return "-"
    if sample.fragmentation.ratio is None:
        return f"unknown ({sample.fragmentation.reason})"
    return f"{sample.fragmentation.ratio:.3f}"


def _latency(figures: tuple[EngineFigures, ...]) -> RenderableType:
    table = Table(title="Latency (ms) and rates", title_justify="left")
    for column in ("engine", "window", "metric", "p50", "p95", "p99"):
        table.add_column(column, justify="right")
    for f in figures:
        window = "since start" if f.span_s is None else f"{f.span_s:.0f} s"
        by_metric: dict[str, dict[float, float | None]] = {}
        for metric, q, value in f.latency_quantiles_s:
            by_metric.setdefault(metric, {})[q] = value
        for metric, values in by_metric.items():
            table.add_row(
                f.engine,
                window,
                metric,
                _ms(values.get(0.5)),
                _ms(values.get(0.95)),
                _ms(values.get(0.99)),
            )
    rates = Table(show_header=True, title_justify="left")
    for column in (
        "engine",
        "preempt/s vllm",
        "preempt/s kvpool",
        "tokens/s",
        "steps/s",
        "prefix hit",
    ):
        rates.add_column(column, justify="right")
    for f in figures:
        rates.add_row(
            f.engine,
            _fmt(f.preemption_rate_per_s, digits=2),
            _fmt(f.kvpool_preemption_rate_per_s, digits=2),
            _fmt(f.generation_tokens_per_s, digits=1),
            _fmt(f.iterations_per_s, digits=1),
            _fmt(_pct(f.prefix_cache_hit_ratio), "%", 1),
        )
    return Group(table, rates)
