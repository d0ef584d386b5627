"""GPU memory rules from NVML: the server's growth (a leak slope) and neighbour pressure.

A memory domain is a GPU, or each MIG instance of a GPU that has them. The server's
processes in a domain are those NVML marks as the server's (and, when the instance lists its
PIDs, among them); every other process is a neighbour. Weights and the KV pool are allocated
at start-up and stay, so growth of the server's total after that is growth beyond them.
Where NVML sees nothing of the server (not visible in the pod, or its PIDs unmappable), the
rules read dcgm-exporter's memory of the pod's GPUs through Prometheus when it is set up: the
device's memory, not the server's process's, so the growth rule watches the device and the
pressure rule, which must tell the server from its neighbours, says unknown. With neither,
both say unknown with the reason, never nothing.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

from kvpilot.agent.model import Condition
from kvpilot.agent.rules.base import ConditionMaker, RuleContext, fmt_bytes, source_error_text
from kvpilot.agent.rules.config import GpuMemoryGrowthConfig, GpuNeighbourPressureConfig
from kvpilot.collectors.dcgm import DcgmGpu, DcgmSnapshot
from kvpilot.collectors.errors import SourceError
from kvpilot.collectors.gpu_samples import GpuProcess, NvmlSnapshot
from kvpilot.collectors.vllm_metrics import VllmScrape

GROWTH_ALERTNAME = "VllmGpuMemoryGrowth"
PRESSURE_ALERTNAME = "VllmGpuNeighbourPressure"
GROWTH_RUNBOOK = (
    "The vLLM process keeps taking GPU memory after start-up, beyond its weights and KV "
    "pool: a leak (custom logits processors, LoRA adapters, growing CUDA graph pools). "
    "Compare with the allocator figures; a drained restart returns the memory, and the "
    "slope says how long until the next OOM."
)
PRESSURE_RUNBOOK = (
    "Other processes on this GPU hold memory the server needs to start again: a restart now "
    "would fail with 'Free memory on device ... is less than desired GPU memory "
    "utilization'. Move or stop the neighbours, or lower gpu_memory_utilization, before "
    "any restart; kvpilot's restart pre-flight blocks restarts meanwhile."
)


@dataclass(frozen=True, slots=True)
class Domain:
    """One memory domain as the rules see it."""

    gpu: str
    total_bytes: int | None
    free_bytes: int | None
    reserved_bytes: int | None
    processes: tuple[GpuProcess, ...] | None


def domains(nvml: NvmlSnapshot) -> Iterator[Domain]:
    """The GPUs, with a MIG-enabled GPU replaced by its instances."""
    for gpu in nvml.gpus:
        if gpu.mig_instances:
            for mig in gpu.mig_instances:
                yield Domain(
                    gpu=f"{gpu.index}/mig{mig.mig_index}",
                    total_bytes=mig.total_bytes,
                    free_bytes=mig.free_bytes,
                    reserved_bytes=None,
                    processes=mig.processes,
                )
        else:
            yield Domain(
                gpu=str(gpu.index),
                total_bytes=gpu.total_bytes,
                free_bytes=gpu.free_bytes,
                reserved_bytes=gpu.reserved_bytes,
                processes=gpu.processes,
            )


UNMAPPED_PIDS_REASON = (
    "NVML lists GPU processes whose host PIDs this container cannot map to its own "
    "(the PID namespace is not shared), so the server's own GPU memory is unknown; "
    "the device's memory is still exported"
)


NO_DCGM = (
    "and no dcgm-exporter is read for the device's memory (set gpu.dcgm_prometheus_url to a "
    "Prometheus that scrapes it)"
)


def _unmapped(snapshot: NvmlSnapshot) -> bool:
    """Whether some GPU process NVML lists is not visible in this PID namespace."""
    return any(
        p.container_pid is None for domain in domains(snapshot) for p in domain.processes or ()
    )


def split_processes(
    processes: tuple[GpuProcess, ...], pids: frozenset[int]
) -> tuple[list[GpuProcess], list[GpuProcess]]:
    """(the server's processes, the neighbours)."""
    mine: list[GpuProcess] = []
    others: list[GpuProcess] = []
    for process in processes:
        ours = process.is_server and (not pids or process.container_pid in pids)
        (mine if ours else others).append(process)
    return mine, others


def used_sum(processes: list[GpuProcess]) -> int | None:
    """Total used bytes; None when any process's figure is unknown."""
    if any(p.used_bytes is None for p in processes):
        return None
    return sum(p.used_bytes or 0 for p in processes)


def slope_per_s(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (t, value) points; at least two distinct times."""
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_v = sum(v for _, v in points) / n
    var_t = sum((t - mean_t) ** 2 for t, _ in points)
    cov = sum((t - mean_t) * (v - mean_v) for t, v in points)
    return cov / var_t


class _NvmlRule:
    """Shared walk over the domains where the instance's server runs."""

    name: str

    def __init__(self, maker: ConditionMaker) -> None:
        self._maker = maker

    def evaluate(self, ctx: RuleContext) -> list[Condition]:
        nvml = ctx.snapshot.nvml
        if isinstance(nvml, SourceError):
            if nvml.kind == "unavailable":
                return self._from_dcgm(ctx, f"NVML is not visible here ({nvml.message})")
            return self._maker.unknown_all(ctx, source_error_text(nvml))
        out = []
        for domain in domains(nvml):
            if domain.processes is None:
                if self._maker.was_seen(ctx, {"gpu": domain.gpu}):
                    out.append(self._unknown(ctx, domain.gpu, "NVML could not list the processes"))
                continue
            mine, others = split_processes(domain.processes, ctx.instance.pids)
            if mine:
                out.append(self._domain(ctx, domain, mine, others, nvml.taken_at_s))
        if not out and _unmapped(nvml):
            # In a container that sees the GPU but not the host's PID namespace, the server's
            # processes are among those NVML lists: dcgm's device memory, else unknown.
            return self._from_dcgm(ctx, UNMAPPED_PIDS_REASON)
        self._maker.forget_except(ctx, out)
        return out

    def _from_dcgm(self, ctx: RuleContext, why_not_nvml: str) -> list[Condition]:
        """The pod's GPUs as dcgm-exporter reports them; unknown with the reason if it cannot."""
        dcgm = ctx.snapshot.dcgm
        if dcgm is None:
            return self._maker.unknown_all(ctx, f"{why_not_nvml}, {NO_DCGM}")
        if isinstance(dcgm, SourceError):
            reason = f"{why_not_nvml}; dcgm-exporter through Prometheus: {source_error_text(dcgm)}"
            return self._maker.unknown_all(ctx, reason)
        if not dcgm.gpus:
            reason = (
                f"{why_not_nvml}; dcgm-exporter reports no GPU allocated to pod "
                f"{dcgm.namespace}/{dcgm.pod} (is its Kubernetes pod mapping on?)"
            )
            return self._maker.unknown_all(ctx, reason)
        out = [self._device(ctx, gpu, dcgm) for gpu in dcgm.gpus]
        self._maker.forget_except(ctx, out)
        return out

    def _device(self, ctx: RuleContext, gpu: DcgmGpu, dcgm: DcgmSnapshot) -> Condition:
        raise NotImplementedError

    def _domain(
        self,
        ctx: RuleContext,
        domain: Domain,
        mine: list[GpuProcess],
        others: list[GpuProcess],
        taken_at_s: float,
    ) -> Condition:
        raise NotImplementedError

    def _unknown(self, ctx: RuleContext, gpu: str, reason: str) -> Condition:
        summary = f"{self._maker.alertname} unknown on GPU {gpu} of {ctx.instance.name}: "
        return self._maker.condition(
            ctx,
            {"gpu": gpu},
            active=None,
            value=None,
            summary=summary + reason,
            description=summary + reason,
            reason=reason,
        )


class GpuMemoryGrowthRule(_NvmlRule):
    """The server's GPU memory slope over `window_s` above the threshold, and enough growth."""

    name = "gpu_memory_growth"

    def __init__(self, config: GpuMemoryGrowthConfig) -> None:
        super().__init__(
            ConditionMaker.of(
                config, rule=self.name, alertname=GROWTH_ALERTNAME, runbook=GROWTH_RUNBOOK
            )
        )
        self.config = config
        # (instance, gpu) -> (the server's host PIDs, (taken_at_s, used_bytes) readings).
        self._history: dict[tuple[str, str], tuple[frozenset[int], deque[tuple[float, int]]]] = {}

    def _domain(
        self,
        ctx: RuleContext,
        domain: Domain,
        mine: list[GpuProcess],
        others: list[GpuProcess],
        taken_at_s: float,
    ) -> Condition:
        used = used_sum(mine)
        if used is None:
            return self._unknown(ctx, domain.gpu, "NVML does not report per-process memory here")
        pids = frozenset(p.host_pid for p in mine)
        return self._slope(
            ctx,
            domain.gpu,
            pids,
            used,
            taken_at_s,
            what="server GPU memory",
            now=f"now {fmt_bytes(used)} in {len(mine)} server processes",
        )

    def _device(self, ctx: RuleContext, gpu: DcgmGpu, dcgm: DcgmSnapshot) -> Condition:
        if gpu.used_bytes is None:
            return self._unknown(ctx, gpu.key, "dcgm-exporter gives no DCGM_FI_DEV_FB_USED here")
        return self._slope(
            ctx,
            gpu.key,
            frozenset({-1}),  # not the server's PIDs: a history of its own
            gpu.used_bytes,
            dcgm.taken_at_s,
            what="GPU device memory (dcgm-exporter, the whole device, not the process)",
            now=f"now {fmt_bytes(gpu.used_bytes)} used on pod {dcgm.namespace}/{dcgm.pod}'s GPU",
        )

    def _slope(
        self,
        ctx: RuleContext,
        gpu: str,
        identity: frozenset[int],
        used: int,
        taken_at_s: float,
        *,
        what: str,
        now: str,
    ) -> Condition:
        """The slope of `used` over the window; a new `identity` (a new server) starts afresh."""
        cfg = self.config
        key = (ctx.instance.name, gpu)
        known = self._history.get(key)
        if known is None or known[0] != identity:
            known = self._history[key] = (identity, deque())  # a new server starts a new history
        history = known[1]
        if not history or history[-1][0] < taken_at_s:
            history.append((taken_at_s, used))
        while history and history[0][0] < taken_at_s - cfg.window_s:
            history.popleft()
        covered_s = history[-1][0] - history[0][0]
        needed_s = cfg.window_s * cfg.min_coverage_ratio
        if covered_s < needed_s or len(history) < 2:
            reason = f"collecting history: {covered_s:g} s of the {needed_s:g} s needed"
            return self._unknown(ctx, gpu, reason)
        points = [(t, float(v)) for t, v in history]
        slope = slope_per_s(points)
        growth = history[-1][1] - history[0][1]
        active = slope > cfg.slope_threshold_bytes_per_s and growth >= cfg.min_growth_bytes
        verdict = "growing" if active else "steady"
        limit = fmt_bytes(cfg.slope_threshold_bytes_per_s * 60)
        summary = (
            f"{what} {verdict} on GPU {gpu} of {ctx.instance.name}: "
            f"{fmt_bytes(slope * 60)}/min (threshold {limit}/min), "
            f"{fmt_bytes(growth)} over {covered_s:g} s "
            f"(threshold {fmt_bytes(cfg.min_growth_bytes)})"
        )
        description = f"{summary}; {now}. Fires after {cfg.for_s:g} s; action: {cfg.action}."
        return self._maker.condition(
            ctx,
            {"gpu": gpu},
            active=active,
            value=slope,
            summary=summary,
            description=description,
        )


class GpuNeighbourPressureRule(_NvmlRule):
    """Memory left after the server stops is short of what it needs to start again."""

    name = "gpu_neighbour_pressure"

    def __init__(self, config: GpuNeighbourPressureConfig) -> None:
        super().__init__(
            ConditionMaker.of(
                config, rule=self.name, alertname=PRESSURE_ALERTNAME, runbook=PRESSURE_RUNBOOK
            )
        )
        self.config = config

    def _domain(
        self,
        ctx: RuleContext,
        domain: Domain,
        mine: list[GpuProcess],
        others: list[GpuProcess],
        taken_at_s: float,
    ) -> Condition:
        cfg = self.config
        mine_bytes, others_bytes = used_sum(mine), used_sum(others)
        if domain.total_bytes is None:
            return self._unknown(ctx, domain.gpu, "NVML did not report the GPU's total memory")
        # What would be free once the server is gone: today's free plus what it holds; else
        # the total less the neighbours and the driver's reserve.
        if domain.free_bytes is not None and mine_bytes is not None:
            left_bytes = domain.free_bytes + mine_bytes
        elif others_bytes is not None:
            left_bytes = domain.total_bytes - (domain.reserved_bytes or 0) - others_bytes
        else:
            return self._unknown(ctx, domain.gpu, "NVML does not report per-process memory here")
        utilization = _gpu_memory_utilization(ctx)
        if utilization is not None:
            need_bytes = math.ceil(domain.total_bytes * utilization)
            need_text = f"gpu_memory_utilization {utilization:g} x total"
        elif mine_bytes is not None:
            need_bytes, need_text = mine_bytes, "what the server holds now"
        else:
            reason = "neither gpu_memory_utilization nor the server's own usage is known"
            return self._unknown(ctx, domain.gpu, reason)
        limit_bytes = need_bytes * (1 + cfg.margin_ratio)
        active = left_bytes < limit_bytes
        verdict = "short" if active else "enough"
        summary = (
            f"{verdict} GPU memory to restart on GPU {domain.gpu} of {ctx.instance.name}: "
            f"{fmt_bytes(left_bytes)} would be free, needs {fmt_bytes(need_bytes)} "
            f"({need_text}) + {cfg.margin_ratio:.0%} margin"
        )
        neighbours = "unknown" if others_bytes is None else fmt_bytes(others_bytes)
        description = (
            f"{summary}; {len(others)} other processes hold {neighbours}. Fires after "
            f"{cfg.for_s:g} s; action: {cfg.action}."
        )
        return self._maker.condition(
            ctx,
            {"gpu": domain.gpu},
            active=active,
            value=left_bytes / need_bytes if need_bytes else None,
            summary=summary,
            description=description,
        )

    def _device(self, ctx: RuleContext, gpu: DcgmGpu, dcgm: DcgmSnapshot) -> Condition:
        # Device memory cannot tell the server's share from a neighbour's on a shared GPU.
        reason = (
            "dcgm-exporter gives the device's memory, not each process's, so the server's "
            "share cannot be told from its neighbours'"
        )
        return self._unknown(ctx, gpu.key, reason)


def _gpu_memory_utilization(ctx: RuleContext) -> float | None:
    """The server's `gpu_memory_utilization` from `vllm:cache_config_info`, if it said."""
    scrape = ctx.snapshot.vllm
    if not isinstance(scrape, VllmScrape):
        return None
    for sample in scrape.engines:
        text = dict(sample.cache_config).get("gpu_memory_utilization")
        if text is None:
            continue
        try:
            value = float(text)
        except ValueError:
            continue
        if 0 < value <= 1:
            return value
    return None
