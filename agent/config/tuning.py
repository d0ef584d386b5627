"""The `tuning:` section: what a tuning run tries, under which load and SLO, and when.

`kvpilot tune` reads it (its options override single fields); `kvpilot run` also tunes on
`schedule`, a crontab line in UTC, never while a remediation is in progress.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from kvpilot.agent.strict_model import StrictModel
from kvpilot.tuner.judge.sequential import DEFAULT_WINDOWS

# The judge's minimum samples per metric (tuner.judge.vocabulary.MetricSpec.min_samples): one
# per interval.
MIN_ANALYSIS_INTERVALS = 5


class TuningWorkload(StrictModel):
    """The load generator's workload, replayed against baseline and canary alike."""

    requests: int = Field(64, ge=1, description="Requests per measurement window.")
    concurrency: int = Field(16, ge=1, description="Requests in flight at once.")
    prompt_len: int = Field(384, ge=1, description="Prompt tokens per request.")
    output_len: int = Field(64, ge=1, description="Output tokens per request.")
    trace: str | None = Field(
        None,
        min_length=1,
        description="A trace file (CSV or JSON Lines: arrival_s, prompt_tokens, output_tokens) "
        "replayed at its arrival times instead; wins over the learned workload.",
    )


class LearnConfig(StrictModel):
    """The workload learned from the stable server's own /metrics (tuner/load/learned.py)."""

    enabled: bool = Field(
        True, description="Replay the learned workload once the window holds min_requests."
    )
    window_s: float = Field(
        3600, ge=10, le=7 * 86400, description="How far back the learned workload looks."
    )
    min_requests: int = Field(
        200,
        ge=1,
        description="Finished requests the window needs before its workload is used; "
        "below it the configured workload is.",
    )
    burst_factor: float = Field(
        1.0,
        ge=1.0,
        le=100.0,
        description="1: Poisson arrivals at the observed rate; b > 1: bursts of b requests "
        "on average, at the same mean rate.",
    )
    headroom: float = Field(
        1.25,
        ge=1.0,
        le=10.0,
        description="The learned rate is replayed this many times faster: a configuration "
        "must hold the SLO with room above the traffic seen, not only at it.",
    )


class TuningSlo(StrictModel):
    """The SLO goodput is counted under; a trial that breaks it is infeasible."""

    ttft_p95_s: float = Field(5.0, gt=0, description="Time to first token, 95th percentile.")
    inter_token_p95_s: float = Field(0.5, gt=0, description="Inter-token gap, 95th percentile.")


class ExtraKnob(StrictModel):
    """A vLLM flag searched beside the memory knob and --max-num-seqs."""

    name: Literal[
        "max_num_batched_tokens", "block_size", "kv_cache_dtype", "enable_prefix_caching"
    ] = Field(description="The engine argument, as vLLM names it.")
    low: float | None = Field(None, description="Lower end (numeric knobs); default built in.")
    high: float | None = Field(None, description="Upper end (numeric knobs); default built in.")
    choices: tuple[int | str | bool, ...] = Field(
        (), description="The values to try (choice knobs); default built in."
    )


class CanaryGateway(StrictModel):
    """The Gateway API objects a weighted canary goes through."""

    httproute: str = Field("vllm", min_length=1, description="The HTTPRoute that fronts the model.")
    stable_service: str = Field(
        "vllm", min_length=1, description="The route's backend Service of the stable pods."
    )
    canary_service: str = Field(
        "vllm-kvpilot-canary",
        min_length=1,
        description="The backend Service of the canary pods; its weight moves, back to 0 on abort.",
    )


class CanaryConfig(StrictModel):
    """What traffic a canary is judged on: a synthetic replay, or a share of live traffic."""

    traffic: Literal["replay", "service", "gateway"] = Field(
        "replay",
        description="replay: baseline and canary get the same synthetic workload (one machine, "
        "or no traffic at the chosen hour). service: the canary's pods join the Service and "
        "get their share of its traffic. gateway: an HTTPRoute weight sends weight_percent "
        "to the canary's Service. Live traffic needs the Kubernetes runtime and parallel.",
    )
    weight_percent: float = Field(
        10,
        ge=1,
        le=50,
        description="gateway: the canary backend's weight. service: informational (the share "
        "follows the replica counts); the share each side really received is stated.",
    )
    warmup_s: float = Field(
        120,
        ge=0,
        description="Live traffic to the canary before the analysis starts (warms its caches; "
        "not judged). The stable pod's window is judged from the same moment on.",
    )
    analysis_s: float = Field(600, gt=0, description="How long both pods are judged.")
    analysis_interval_s: float = Field(
        30,
        ge=1,
        description="Each pod's /metrics is scraped this often; each interval is one sample "
        "for the judge, and a canary interval that breaks the SLO aborts at once.",
    )
    bake_s: float = Field(
        600, gt=0, description="How long promoted flags are watched on live traffic."
    )
    service: str | None = Field(
        None,
        min_length=1,
        description="traffic: service: the Service whose traffic the canary's pods share "
        "(it must not select on kvpilot.dev/role); default: the Deployment's name.",
    )
    gateway: CanaryGateway | None = Field(
        None, description="The HTTPRoute and its Services; required for traffic: gateway."
    )

    @model_validator(mode="after")
    def _consistent(self) -> CanaryConfig:
        if self.traffic == "gateway" and self.gateway is None:
            raise ValueError(
                "traffic: gateway needs a gateway block (httproute, stable_service, canary_service)"
            )
        if self.traffic != "gateway" and self.gateway is not None:
            raise ValueError(
                f"a gateway block is read only with traffic: gateway, not {self.traffic}"
            )
        intervals = self.analysis_s / self.analysis_interval_s
        if intervals < MIN_ANALYSIS_INTERVALS:
            raise ValueError(
                f"analysis_s {self.analysis_s:g} holds {intervals:.1f} intervals of "
                f"{self.analysis_interval_s:g} s; the judge needs at least "
                f"{MIN_ANALYSIS_INTERVALS} samples a side"
            )
        return self


class RetuneConfig(StrictModel):
    """When `kvpilot run` re-opens tuning: the ground it was tuned on moved (a new vLLM
    version, model or workload shape), or preemption incidents keep coming while no
    validated better configuration exists. With a schedule the next firing tunes; without
    one a KvpilotTuningRecommended alert says why."""

    enabled: bool = Field(True, description="Watch for ground that moved, and re-open tuning.")
    preemption_incidents: int = Field(
        3, ge=1, description="VllmPreemptionSpike firings within `within_h` that re-open tuning."
    )
    within_h: float = Field(
        24.0, gt=0, le=24 * 30, description="The window, in hours, those firings are counted in."
    )
    check_every_s: float = Field(
        60.0, gt=0, description="How often `kvpilot run` checks the ground (after a tick)."
    )


class TuningConfig(StrictModel):
    """How kvpilot tunes the stable instance's memory knobs (local runtime)."""

    schedule: str | None = Field(
        None,
        description="When `kvpilot run` tunes: a crontab line in UTC, e.g. '0 3 * * *' "
        "(nightly at 03:00). Unset: only `kvpilot tune` tunes.",
    )
    schedule_spread_s: int = Field(
        3600,
        ge=0,
        le=7 * 86400,
        description="On Kubernetes, each Deployment's firing comes this many seconds after "
        "the schedule at most: a hash of its name picks its place, so a namespace's "
        "Deployments do not all ask for canary GPUs at once. 0: all fire on the schedule.",
    )
    trials: int = Field(3, ge=1, description="Trials per run.")
    strategy: Literal["parallel", "sequential"] = Field(
        "parallel",
        description="parallel: a canary beside the stable instance; sequential: the one "
        "instance switches and is compared with its own window before (one-GPU boxes).",
    )
    canary_port: int = Field(8199, ge=1, le=65535, description="The canary's port (parallel).")
    canary_cpus: tuple[Annotated[int, Field(ge=0)], ...] = Field(
        (), description="Pin the canary to these CPU numbers; empty: any."
    )
    memory_knob: Literal["auto", "gpu_memory_utilization", "kv_cache_memory_bytes"] = Field(
        "auto",
        description="The memory knob searched. auto: --kv-cache-memory-bytes when the stable "
        "argv sets it or no GPU is visible (the CPU build), else --gpu-memory-utilization.",
    )
    max_gpu_memory_utilization: float = Field(
        0.95,
        gt=0,
        le=1,
        description="Upper end of --gpu-memory-utilization (the free "
        "memory NVML reports caps it further).",
    )
    kv_min_bytes: int | None = Field(
        None,
        ge=1,
        description="Lower end of --kv-cache-memory-bytes; unset: the planner's "
        "minimum (one request of max_model_len). Never below that minimum.",
    )
    kv_max_bytes: int = Field(
        64 << 20, ge=1, description="Upper end of --kv-cache-memory-bytes (the CPU rig's knob)."
    )
    min_num_seqs: int = Field(1, ge=1, description="Lower end of --max-num-seqs.")
    max_num_seqs: int = Field(64, ge=1, description="Upper end of --max-num-seqs.")
    extra_knobs: tuple[ExtraKnob, ...] = Field(
        (), description="More flags to search, e.g. {name: max_num_batched_tokens}."
    )
    constraints: tuple[str, ...] = Field(
        (),
        description="Your own rules a candidate must meet before a trial is spent, e.g. "
        "'max_num_seqs * 64 <= max_num_batched_tokens'.",
    )
    workload: TuningWorkload = Field(default_factory=TuningWorkload, description="The load.")
    learn: LearnConfig = Field(
        default_factory=LearnConfig, description="The workload learned from the server."
    )
    slo: TuningSlo = Field(default_factory=TuningSlo, description="The SLO.")
    bake: bool = Field(
        True,
        description="Watch promoted flags for 8 more windows, judged against the old flags' "
        "windows; revert when shown worse.",
    )
    windows: int = Field(
        DEFAULT_WINDOWS,
        ge=1,
        le=256,
        description="The most replayed windows a side per trial (at the same time on both "
        "sides for a parallel canary), judged at looks of 8, 16, 32 and 64 windows: a clearly "
        "bad canary stops early. With zero errors on both sides the half-point error margin "
        "needs about 550 requests a side, so an equal canary passes by 32 windows of 64 "
        "requests at the earliest. From 5 the window is the judge's unit of evidence; fewer "
        "are judged request by request, which the calibration (docs/judge.md) shows "
        "overconfident. Live traffic is judged over canary.analysis_s instead.",
    )
    hold_inconclusive: bool = Field(
        False,
        description="A canary still inconclusive after the last look is held (left running, "
        "the stable untouched) for a person's review instead of rolled back (parallel only).",
    )
    hold_timeout_s: float = Field(
        86400.0,
        gt=0,
        le=30 * 86400,
        description="How long a held canary waits for a person (`kvpilot tuning release "
        "TRIAL --promote|--rollback`) before it is rolled back, saying so; while one is held "
        "no other trial starts.",
    )
    error_margin_ratio: float = Field(
        0.005,
        gt=0,
        le=0.5,
        description="How many more failed requests a canary may have and pass: half a point "
        "by default. A rig of few requests (a CPU test, the demo) sets its own.",
    )
    preemption_margin_per_request: float | None = Field(
        None,
        gt=0,
        le=10,
        description="How many more preemptions per finished request a canary may have and "
        "pass; unset: a fifth of the stable's, at least 0.01 replayed (with none on both sides "
        "about 300 requests a side show it) and 0.1 on live traffic. A rig of few requests "
        "(a CPU test, the demo) sets its own.",
    )
    latency_margin_ratio: float = Field(
        0.10,
        gt=0,
        le=10,
        description="How much higher a canary's latency tails (TTFT, inter-token gap, "
        "end-to-end; each window's p95) may be and pass: 0.1 is x1.1. A larger batch "
        "(more --max-num-seqs) lengthens every decode step: raise this where the inter-token "
        "gap may be traded for memory or queueing.",
    )
    min_memory_saving_ratio: float = Field(
        0.05, ge=0, le=1, description="Less memory is a gain only from this share of the stable's."
    )
    min_memory_saving_bytes: int = Field(
        64 << 20,
        ge=0,
        description="...and only from this many bytes (the CPU rigs' budgets are 1-24 MiB: "
        "they set their own).",
    )
    max_cumulative_loss_ratio: float = Field(
        0.10,
        ge=0,
        lt=1,
        description="No promotion may leave goodput more than this share below the "
        "configuration the operator deployed.",
    )
    canary: CanaryConfig = Field(
        default_factory=CanaryConfig,
        description="Replayed or live traffic for the canary, and its analysis windows.",
    )
    suggester: Literal["bayes", "informed", "random", "grid"] = Field(
        "bayes",
        description="Who proposes the trials (tuner/suggest/registry.py): bayes, a Gaussian "
        "process; informed, where the planner knows the workload's shape and the memory "
        "knob's KV bytes and the space has max_num_seqs, the batch the load needs first "
        "(Little's law on the workload, bisected at ample memory), then the least memory "
        "that holds it, max_num_batched_tokens two prompts beside a decode token of every "
        "sequence; otherwise bisection on the memory knob with failed starts as its cliff, "
        "then max_num_seqs on a log ladder (not yet the stable server's KV high-water mark); "
        "random; grid.",
    )
    seed: int = Field(0, description="The suggester's seed.")
    retune: RetuneConfig = Field(
        default_factory=RetuneConfig, description="When `kvpilot run` re-opens tuning."
    )

    @model_validator(mode="after")
    def _ranges_are_ranges(self) -> TuningConfig:
        if self.kv_min_bytes is not None and self.kv_min_bytes >= self.kv_max_bytes:
            raise ValueError("kv_min_bytes must be below kv_max_bytes")
        if self.min_num_seqs >= self.max_num_seqs:
            raise ValueError("min_num_seqs must be below max_num_seqs")
        if self.canary.traffic != "replay" and self.strategy != "parallel":
            raise ValueError(
                f"canary traffic {self.canary.traffic} needs strategy: parallel (a canary "
                "beside the stable pod)"
            )
        return self

    @field_validator("constraints")
    @classmethod
    def _constraints_parse(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        from kvpilot.tuner.problem.constraints import parse_constraint

        for text in value:
            parse_constraint(text)  # raises ValueError with what is wrong
        return value

    @field_validator("extra_knobs")
    @classmethod
    def _knobs_build(cls, value: tuple[ExtraKnob, ...]) -> tuple[ExtraKnob, ...]:
        from kvpilot.tuner.problem.space import optional_knob

        for knob in value:
            optional_knob(knob.name, low=knob.low, high=knob.high, choices=knob.choices)
        return value

    @field_validator("schedule")
    @classmethod
    def _a_crontab_line(cls, value: str | None) -> str | None:
        if value is None:
            return None
        from apscheduler.triggers.cron import CronTrigger

        try:
            CronTrigger.from_crontab(value, timezone="UTC")
        except ValueError as exc:
            raise ValueError(f"not a crontab line (minute hour day month weekday): {exc}") from exc
        return value
