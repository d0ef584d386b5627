"""Which workload a tuning run replays, and why: a trace file when one is configured, the
workload learned from the server once its window holds `learn.min_requests`, else the
configured one. The reason is a sentence for people; `served` is the study fingerprint's
workload part (a learned workload's coarse key, so ordinary drift continues the study)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvpilot.agent.config.tuning import TuningConfig, TuningWorkload
from kvpilot.agent.tuning.server import TunedServer
from kvpilot.collectors.vllm_argv import flag_value
from kvpilot.tuner.load.generator import LengthDist, TraceWorkload, Workload
from kvpilot.tuner.load.learned import WorkloadShape, coarse_key, learned_workload
from kvpilot.tuner.measure.traces import TraceError, load_trace, workload_hash

Source = Literal["learned", "configured", "trace"]


@dataclass(frozen=True, slots=True)
class WorkloadChoice:
    """The workload a run replays, where it came from and why."""

    workload: Workload
    source: Source
    reason: str
    key: str | None = None  # the learned shape's coarse key
    shape: WorkloadShape | None = None
    headroom: float = 1.0  # the learned rate is replayed this many times faster

    def served(self) -> str:
        """The study fingerprint's workload part."""
        if self.source == "learned" and self.key is not None:
            # The burst factor is the configuration's, not the traffic's: bursts are another
            # load, so another study (plain Poisson keeps the key alone, as before).
            burst = getattr(self.workload, "burst_factor", 1.0)
            served = "learned:" + self.key + (f";burst={burst:g}" if burst != 1.0 else "")
            # Headroom is the configuration's too: a faster replay asks more of a candidate.
            return served + (f";headroom={self.headroom:g}" if self.headroom != 1.0 else "")
        return workload_hash(self.workload)

    def describe(self) -> str:
        return f"workload: {self.source} ({self.reason})"


def configured_workload(w: TuningWorkload) -> Workload:
    """The `tuning.workload` section's fixed-length, closed-loop workload."""
    return Workload(
        w.requests, LengthDist.fixed(w.prompt_len), LengthDist.fixed(w.output_len), w.concurrency
    )


def trace_workload(path: str, seed: int = 0) -> TraceWorkload:
    """The trace file's requests at their arrival times; ValueError (TraceError) naming the
    file when it cannot be read."""
    trace = load_trace(path)
    arrivals = tuple((r.arrival_s, r.prompt_tokens, r.output_tokens) for r in trace.requests)
    n, one = len(arrivals), LengthDist.fixed(1)  # the lengths are the trace's own
    if trace.duration_s > 0:
        rate = n / trace.duration_s
        return TraceWorkload(n, one, one, rate_rps=rate, seed=seed, arrivals=arrivals)
    return TraceWorkload(n, one, one, concurrency=n, seed=seed, arrivals=arrivals)


def choose_workload(
    tuning: TuningConfig,
    shape: WorkloadShape | None,
    *,
    max_model_len: int | None = None,
    no_shape: str = "nothing has been observed yet",
) -> WorkloadChoice:
    """The workload a run replays. `no_shape`: why there is no shape, when there is none."""
    w = tuning.workload
    if w.trace is not None:
        try:
            traced = trace_workload(w.trace, tuning.seed)
        except TraceError as exc:
            raise ValueError(f"tuning.workload.trace: {exc}") from None
        return WorkloadChoice(traced, "trace", f"the trace file {w.trace} is configured")
    configured = configured_workload(w)
    learn = tuning.learn
    if not learn.enabled:
        return WorkloadChoice(configured, "configured", "learning is off (tuning.learn.enabled)")
    if shape is None:
        return WorkloadChoice(configured, "configured", f"no learned workload: {no_shape}")
    over = f"{shape.requests} requests over {shape.window_s:.0f} s"
    if shape.requests < learn.min_requests:
        return WorkloadChoice(
            configured,
            "configured",
            f"the window holds {over}, below the floor of {learn.min_requests}",
            shape=shape,
        )
    try:
        learned = learned_workload(
            shape,
            requests=w.requests,
            burst_factor=learn.burst_factor,
            seed=tuning.seed,
            max_model_len=max_model_len,
            headroom=learn.headroom,
        )
    except ValueError as exc:
        return WorkloadChoice(configured, "configured", f"not learned: {exc}", shape=shape)
    key = coarse_key(shape)
    faster = f", replayed at {learn.headroom:g}x its rate" if learn.headroom != 1.0 else ""
    held = shape.kv_blocks_per_running
    kv = f"; {held:.3g} KV blocks a running request" if held is not None else ""
    reason = f"learned from {over}: {key}{faster}{kv}"
    return WorkloadChoice(learned, "learned", reason, key, shape, learn.headroom)


def window_choice(
    tuning: TuningConfig, tuned: TunedServer | None, shape: WorkloadShape | None
) -> WorkloadChoice | None:
    """`kvpilot run`'s choice under `tuning` for its `tuned` server from the window's `shape`
    now; None where there is no tuned server or its configuration cannot say (studies then
    use their default, which reports the error)."""
    if tuned is None:
        return None
    try:
        limit = flag_value(tuned.argv, "--max-model-len")
        return choose_workload(
            tuning,
            shape,
            max_model_len=int(limit) if limit else None,
            no_shape="the window has seen no finished request yet",
        )
    except ValueError:  # an unreadable trace file, a malformed --max-model-len
        return None
