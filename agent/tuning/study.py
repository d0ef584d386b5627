"""One tuning study from the configuration: the search space, workload, SLO and fingerprint,
and the session that runs it. Shared by `kvpilot tune` and the agent's scheduled tuning."""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from kvpilot.agent.config.tuning import CanaryConfig, TuningConfig
from kvpilot.agent.config.tuning_reach import judged_metrics
from kvpilot.agent.model_files import find_model_config
from kvpilot.agent.state.db import Database
from kvpilot.agent.state.trials import SqliteRolloutJournal, SqliteTrialStore
from kvpilot.agent.tuning.gpu_bounds import GpuMemory as GpuMemory
from kvpilot.agent.tuning.gpu_bounds import canary_strategy
from kvpilot.agent.tuning.gpu_bounds import read_gpu as read_gpu
from kvpilot.agent.tuning.observer import LoadObserver
from kvpilot.agent.tuning.server import TunedServer
from kvpilot.agent.tuning.workload.choice import WorkloadChoice, choose_workload
from kvpilot.collectors.vllm_argv import (
    flag_value,
    has_flag,
    parse_human_int,
    parse_server_argv,
    without_flags,
)
from kvpilot.tuner.judge.judgement import (
    LIVE_METRICS,
    JudgeConfig,
)
from kvpilot.tuner.load.generator import BucketLengths, LengthDist, TraceWorkload, Workload
from kvpilot.tuner.load.learned import WorkloadShape
from kvpilot.tuner.planner import FeasibleBounds, Plan, PlanInputs, feasible_bounds, make_plan
from kvpilot.tuner.problem.constraints import (
    Value,
    batched_tokens_constraint,
    parse_constraint,
    planner_constraint,
)
from kvpilot.tuner.problem.fingerprint import fingerprint
from kvpilot.tuner.problem.objective import Slo
from kvpilot.tuner.problem.space import Knob, KnobKind, SearchSpace, optional_knob
from kvpilot.tuner.rollout.canary import RolloutSettings, Strategy
from kvpilot.tuner.rollout.ports import Observer, RolloutJournal, TunerRuntime
from kvpilot.tuner.session import PlannedTrial, Progress, TuningSession, dry_run
from kvpilot.tuner.suggest.base import Suggester
from kvpilot.tuner.suggest.prior import KvPrior, LoadShape, MemoryAxis
from kvpilot.tuner.suggest.registry import Knowledge, make_suggester


class StudyError(ValueError):
    """The configuration cannot be tuned as it stands (the message says why)."""


# The device memory the server at a URL holds (None: unknown), for a trial's measurement.
DeviceMemory = Callable[[str], "int | None"]
# The observer of live traffic the runtime splits (canary settings, SLO): the pod's.
LiveObserver = Callable[[CanaryConfig, Slo], Observer]


@dataclass(frozen=True, slots=True)
class Study:
    """Everything one tuning run is built from."""

    tuning: TuningConfig
    stable: TunedServer
    configured_argv: tuple[str, ...]
    space: SearchSpace
    workload: Workload
    slo: Slo
    fingerprint: str
    ready_timeout_s: float
    choice: WorkloadChoice | None = None  # where the workload came from, and why
    strategy: Strategy = Strategy.PARALLEL
    strategy_reason: str | None = None  # why trials do not run as configured
    knowledge: Knowledge = field(default_factory=Knowledge)  # for suggesters that use it

    @property
    def model(self) -> str:
        """The name requests ask for: the served model name, or the model path."""
        args = parse_server_argv(self.configured_argv)
        return args.served_model_name or args.model or ""


def study_suggester(study: Study) -> Suggester:
    """The suggester `tuning.suggester` names, over the study's space and seed, told what
    the study knows (the planner's KV need, the deployed flags, the memory axis)."""
    return make_suggester(study.tuning.suggester, study.space, study.tuning.seed, study.knowledge)


def planned_trials(study: Study, db: Database) -> tuple[int, list[PlannedTrial]]:
    """What a run of the study would try first, its past trials told as a run tells them
    (a dry run: `kvpilot tune --dry-run`, the schedule under the switch's dry-run mode)."""
    return dry_run(
        study.space,
        study_suggester(study),
        SqliteTrialStore(db),
        study.fingerprint,
        study.tuning.trials,
        initial_points=len(study.space.knobs) + 2,
        journal=SqliteRolloutJournal(db),
    )


def require_server(server: TunedServer | None) -> TunedServer:
    """The server to tune, or StudyError where the configuration names none (tuning needs a
    stable instance kvpilot starts, on the local runtime, or the pod runtime's Deployment)."""
    if server is None:
        raise StudyError("tuning needs a stable instance on the local runtime, or the pod runtime")
    return server


def build_study(
    stable: TunedServer,
    tuning: TuningConfig,
    gpu: GpuMemory | None = None,
    *,
    vllm_version: str | None = None,
    chosen: WorkloadChoice | None = None,
) -> Study:
    """The study of the stable server under `tuning` (bounds from the planner); `gpu` is
    the GPU's memory now, needed to search --gpu-memory-utilization.
    `vllm_version`: the stable server's (`/version`), part of the fingerprint; None: unknown.
    `chosen`: the workload `choose_workload` chose; default: the trace or configured one."""
    argv = tuple(stable.argv)
    knob_name = _knob_name(argv, tuning, gpu)
    bounds, plan = _bounds(
        argv, tuning, gpu if knob_name == "gpu_memory_utilization" else None, stable.model_config
    )
    space = SearchSpace(
        knobs=(
            _memory_knob(knob_name, argv, tuning, gpu, bounds),
            Knob(
                "max_num_seqs",
                KnobKind.INTEGER,
                tuning.min_num_seqs,
                tuning.max_num_seqs,
                log_scale=True,
            ),
            *(
                optional_knob(k.name, low=k.low, high=k.high, choices=k.choices)
                for k in tuning.extra_knobs
            ),
        ),
        constraints=(
            planner_constraint(bounds),
            batched_tokens_constraint(),
            *(parse_constraint(text) for text in tuning.constraints),
        ),
    )
    choice = chosen or _default_workload(tuning)
    workload = choice.workload
    slo = Slo(ttft_p95_s=tuning.slo.ttft_p95_s, inter_token_p95_s=tuning.slo.inter_token_p95_s)
    fixed = _fixed_args(argv, space)
    model = parse_server_argv(argv).model or ""
    # Live traffic is not the replayed workload: its goodput (per share) is another figure.
    traffic = tuning.canary.traffic
    served = choice.served() if traffic == "replay" else f"live traffic ({traffic})"
    strategy, why = Strategy(tuning.strategy), None
    if traffic == "replay":  # live traffic: the canary has a pod (and a device) of its own
        strategy, why = canary_strategy(strategy, space.knobs[0], gpu, argv)
    return Study(
        tuning,
        stable,
        argv,
        space,
        workload,
        slo,
        fingerprint(model, fixed, served, slo, vllm_version=vllm_version),
        stable.ready_timeout_s,
        choice,
        strategy,
        why,
        study_knowledge(space, argv, plan, workload, slo, gpu, choice.shape),
    )


def _default_workload(tuning: TuningConfig) -> WorkloadChoice:
    """The trace's or the configured workload, where no learned one was offered."""
    try:
        return choose_workload(tuning, None, no_shape="none was offered")
    except ValueError as exc:  # an unreadable trace file
        raise StudyError(str(exc)) from None


def with_version(study: Study, version: str) -> Study:
    """The same study on the server's vLLM version (part of the fingerprint: a new version is
    a new study), its workload kept."""
    return build_study(
        study.stable, study.tuning, read_gpu(), vllm_version=version, chosen=study.choice
    )


def _fixed_args(argv: tuple[str, ...], space: SearchSpace) -> tuple[str, ...]:
    """The argv without the searched flags and the port: what the study holds fixed."""
    valued = [k.flag for k in space.knobs if k.kind is not KnobKind.FLAG]
    bare = [k.flag for k in space.knobs if k.kind is KnobKind.FLAG]
    return without_flags(argv, [*valued, "--port"], bare)


def study_knowledge(
    space: SearchSpace,
    argv: Sequence[str],
    plan: Plan | None,
    workload: Workload,
    slo: Slo,
    gpu: GpuMemory | None,
    learned: WorkloadShape | None = None,
) -> Knowledge:
    """What the study knows before its first trial: the stable server's own values of the
    searched knobs, the planner's KV need of the workload, the memory knob's KV bytes, and
    the load's shape (with the KV a running request held, where the learned window measured
    it)."""
    deployed = deployed_values(space, argv)
    return Knowledge(
        prior=_kv_prior(plan, workload, slo, deployed.get("max_num_seqs")),
        deployed=deployed,
        axis=_memory_axis(space.knobs[0].name, plan, gpu),
        load=_load_shape(plan, workload, slo, learned),
    )


def deployed_values(space: SearchSpace, argv: Sequence[str]) -> dict[str, Value]:
    """The searched knobs' values as the stable argv sets them; a knob it leaves to vLLM's
    default, or sets outside the space, is unknown (absent)."""
    values: dict[str, Value] = {}
    for knob in space.knobs:
        value = _argv_value(knob, argv)
        if value is not None and knob.contains(value):
            values[knob.name] = value
    return values


def _argv_value(knob: Knob, argv: Sequence[str]) -> Value | None:
    if knob.kind is KnobKind.FLAG:
        if has_flag(argv, "--no-" + knob.flag.removeprefix("--")):
            return False
        return True if has_flag(argv, knob.flag) else None
    text = flag_value(argv, knob.flag)
    if text is None:
        return None
    if knob.kind is KnobKind.CHOICE:
        return next((c for c in knob.choices if str(c) == text), None)
    if knob.kind is KnobKind.INTEGER:  # digits, or vLLM's human spellings ("8G", "1k")
        return parse_human_int(text)
    try:
        return float(text)
    except ValueError:
        return None


def _memory_axis(knob: str, plan: Plan | None, gpu: GpuMemory | None) -> MemoryAxis | None:
    """KV bytes along the memory knob: the identity for an explicit budget; for the
    utilisation, the GPU's bytes less what the planner says is not KV (weights, activations,
    CUDA graphs: estimates that start-up profiling corrects)."""
    if knob == "kv_cache_memory_bytes":
        return MemoryAxis.identity()
    if plan is None or gpu is None:
        return None
    non_kv = plan.budget.weights_bytes + plan.budget.overheads.total_bytes
    return MemoryAxis.for_utilization(gpu.total_bytes, non_kv)


def _kv_prior(
    plan: Plan | None, workload: Workload, slo: Slo, max_num_seqs: Value | None
) -> KvPrior | None:
    """The planner's KV need of the replayed load (None where it cannot say): requests in
    flight (`_requests_in_flight`) times the tokens each holds (its prompt and half its
    output), in whole blocks. Never more than max_num_seqs run."""
    if plan is None:
        return None
    prompt, output = _mean_lengths(workload)
    requests = _requests_in_flight(workload, slo)
    if isinstance(max_num_seqs, int) and not isinstance(max_num_seqs, bool):
        requests = min(requests, float(max_num_seqs))
    tokens = requests * (prompt + output / 2)
    if not tokens > 0:
        return None
    return KvPrior.from_planner(plan.geometry, tokens)


def _load_shape(
    plan: Plan | None, workload: Workload, slo: Slo, learned: WorkloadShape | None = None
) -> LoadShape | None:
    """The replayed load as the planner sees it: the requests in flight (not capped by the
    deployed max_num_seqs: the batch the load needs is what the search is after), the KV
    bytes each holds, the mean prompt and, for an open loop, the output tokens a second it
    offers; None where the planner or the load cannot say. Where the learned window measured
    the KV a running request held, that replaces the planner's estimate from the lengths
    (prefix sharing and the real lengths included), with a narrower band."""
    if plan is None:
        return None
    prompt, output = _mean_lengths(workload)
    requests = _requests_in_flight(workload, slo)
    if not (requests > 0 and prompt > 0 and math.isfinite(requests)):
        return None
    rate = workload.rate_rps if workload.concurrency is None else None
    rate = rate if rate is not None and math.isfinite(rate) else None
    shape = LoadShape.from_planner(plan.geometry, requests, prompt, output, rate)
    if learned is None or learned.kv_blocks_per_running is None:
        return shape
    block_tokens = learned.block_size or plan.geometry.block_size  # the server's own blocks
    measured = learned.kv_blocks_per_running * block_tokens * plan.geometry.bytes_per_token
    return replace(shape, kv_bytes_per_request=measured, error_ratio=MEASURED_KV_ERROR_RATIO)


# How far the KV a running request held may err when the stable server measured it: the
# gauges are sampled each tick over the learned window and the replay runs faster (more
# queueing, other prefix hits) than the traffic measured. An assumption, not a measurement.
MEASURED_KV_ERROR_RATIO = 0.15


def _requests_in_flight(workload: Workload, slo: Slo) -> float:
    """Closed loop: the concurrency. Open loop, Little's law at the longest a request may
    live while the SLO holds (its TTFT and every gap at their limits): an upper end, so an
    estimate errs toward more memory and more sequences, where a first probe holds."""
    if workload.concurrency is not None:
        return float(workload.concurrency)
    _, output = _mean_lengths(workload)
    latency_s = slo.ttft_p95_s + output * slo.inter_token_p95_s
    return (workload.rate_rps or 0.0) * latency_s


def _mean_lengths(workload: Workload) -> tuple[float, float]:
    """The mean prompt and output tokens the workload sends."""
    if isinstance(workload, TraceWorkload) and workload.arrivals:
        return (
            statistics.fmean(a[1] for a in workload.arrivals),
            statistics.fmean(a[2] for a in workload.arrivals),
        )
    return _mean_length(workload.prompt_len), _mean_length(workload.output_len)


def _mean_length(dist: LengthDist) -> float:
    if isinstance(dist, BucketLengths):
        weight = sum(w for _, _, w in dist.buckets)
        return sum((lo + hi) / 2 * w for lo, hi, w in dist.buckets) / weight
    if dist.choices:
        return statistics.fmean(dist.choices)
    return float(dist.low) if dist.high is None else (dist.low + dist.high) / 2


def _bounds(
    argv: tuple[str, ...], tuning: TuningConfig, gpu: GpuMemory | None, configured: Path | None
) -> tuple[FeasibleBounds, Plan | None]:
    """The planner's feasible region for the stable instance's model and flags; with `gpu`
    the utilisation range, without it the range of an explicit KV budget. Beside it the
    planner's plan (KV geometry, non-KV memory) where it can make one: the suggester's
    knowledge, which a study does without."""
    model = parse_server_argv(argv).model or ""
    try:
        config_json = find_model_config(
            model,
            configured=configured,
            revision=flag_value(argv, "--revision"),
            environ=os.environ,
            home=Path.home(),
        )
        inputs = PlanInputs(
            gpu_memory_bytes=gpu.total_bytes if gpu else None,
            # The stable server's own memory is room: a promotion restarts it (the pre-flight).
            gpu_free_bytes=gpu.room_bytes if gpu else None,
            gpu_name=gpu.name if gpu else "",
            block_size=int(flag_value(argv, "--block-size") or 16),
            max_model_len=int(flag_value(argv, "--max-model-len") or 0) or None,
            dtype=flag_value(argv, "--dtype") or "auto",
            # Without a GPU the planner works from an explicit budget (the CPU build).
            kv_cache_memory_bytes=None if gpu else tuning.kv_max_bytes,
        )
        bounds = feasible_bounds(config_json, inputs)
    except ValueError as exc:  # the planner's ConfigError and PlanError, a malformed flag
        raise StudyError(f"the planner cannot bound the search for {model!r}: {exc}") from exc
    try:
        return bounds, make_plan(config_json, inputs)
    except ValueError:  # weights beyond the default utilisation: bounds, but no plan at it
        return bounds, None


def _knob_name(argv: tuple[str, ...], tuning: TuningConfig, gpu: GpuMemory | None) -> str:
    if tuning.memory_knob != "auto":
        return tuning.memory_knob
    explicit = flag_value(argv, "--kv-cache-memory-bytes") is not None
    return "kv_cache_memory_bytes" if explicit or gpu is None else "gpu_memory_utilization"


def _memory_knob(
    name: str,
    argv: tuple[str, ...],
    tuning: TuningConfig,
    gpu: GpuMemory | None,
    bounds: FeasibleBounds,
) -> Knob:
    low: float | None
    if name == "kv_cache_memory_bytes":
        low = max(bounds.min_kv_cache_memory_bytes, tuning.kv_min_bytes or 0)
        if low >= tuning.kv_max_bytes:
            raise StudyError(
                f"kv_max_bytes {tuning.kv_max_bytes} leaves no room above the planner's "
                f"minimum of {bounds.min_kv_cache_memory_bytes} bytes (one request of "
                "max_model_len)"
            )
        return Knob(name, KnobKind.INTEGER, low, tuning.kv_max_bytes, log_scale=True)
    if gpu is None:
        raise StudyError("searching gpu_memory_utilization needs the GPU's memory: NVML sees none")
    if flag_value(argv, "--kv-cache-memory-bytes") is not None:
        raise StudyError(
            "the stable argv sets --kv-cache-memory-bytes, which overrides "
            "--gpu-memory-utilization: remove it, or search kv_cache_memory_bytes"
        )
    low, high = bounds.min_gpu_memory_utilization, bounds.max_gpu_memory_utilization
    if low is None:
        raise StudyError(f"no utilisation serves one request: {'; '.join(bounds.reasons)}")
    high = min(high if high is not None else 1.0, tuning.max_gpu_memory_utilization)
    if low >= high:
        raise StudyError(
            f"no room to search: gpu_memory_utilization from {low} to {high} "
            f"({'; '.join(bounds.reasons) or 'max_gpu_memory_utilization is below the minimum'})"
        )
    return Knob(name, KnobKind.REAL, low, high)


def make_session(
    study: Study,
    adapter: TunerRuntime,
    db: Database,
    *,
    device_memory: DeviceMemory,
    on_progress: Callable[[Progress], None] | None = None,
    api_key: str | None = None,
    journal: RolloutJournal | None = None,
    live: LiveObserver | None = None,
) -> TuningSession:
    """A session of the study over `adapter`, with its trials and rollouts in `db` (the
    rollouts in `journal` when given); the canary's traffic as `tuning.canary.traffic` says
    (live traffic observed by `live`, the runtime's; replayed load measured with
    `device_memory`)."""
    observer, judge = make_observer(study, device_memory=device_memory, api_key=api_key, live=live)
    settings = rollout_settings(study, judge)
    return TuningSession(
        space=study.space,
        suggester=study_suggester(study),
        store=SqliteTrialStore(db),
        journal=journal or SqliteRolloutJournal(db),
        runtime=adapter,
        observer=observer,
        fingerprint=study.fingerprint,
        settings=settings,
        strategy=study.strategy,
        wall_clock=time.time,
        on_progress=on_progress,
    )


def make_observer(
    study: Study,
    *,
    device_memory: DeviceMemory,
    api_key: str | None = None,
    live: LiveObserver | None = None,
) -> tuple[Observer, JudgeConfig]:
    """The observer `tuning.canary.traffic` picks, and the metrics its samples are judged on:
    replay keeps the synthetic workload against both; service and gateway judge live traffic."""
    canary = study.tuning.canary
    if canary.traffic == "replay":
        observer = LoadObserver(
            study.workload,
            model=study.model,
            api_key=api_key,
            device_memory=device_memory,
        )
        return observer, JudgeConfig()
    if live is None:
        raise StudyError(
            f"canary traffic {canary.traffic} splits live traffic through the Kubernetes "
            "runtime (a Service or an HTTPRoute); this runtime has no traffic split: use "
            "traffic: replay"
        )
    return live(canary, study.slo), JudgeConfig(metrics=LIVE_METRICS)


def rollout_settings(study: Study, judge: JudgeConfig) -> RolloutSettings:
    """How the study's trials are rolled out and judged: `judge` (the observer's metrics)
    with the configured margins, windows and side-door guards."""
    t = study.tuning
    replay = t.canary.traffic == "replay"
    return RolloutSettings(
        slo=study.slo,
        judge=JudgeConfig(
            judged_metrics(t, judge.metrics),
            judge.alpha,
            judge.marginal_score_ratio,
        ),
        bake=t.bake,
        ready_timeout_s=study.ready_timeout_s,
        windows=t.windows if replay else 1,  # live: one analysis of many intervals
        hold_inconclusive=t.hold_inconclusive,
        min_memory_saving_ratio=t.min_memory_saving_ratio,
        min_memory_saving_bytes=t.min_memory_saving_bytes,
        max_cumulative_loss_ratio=t.max_cumulative_loss_ratio,
    )
