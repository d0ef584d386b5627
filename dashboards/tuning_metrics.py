"""The tuner's metric families, rendered from trial records and the live flags.

One definition serves the agent's live `/metrics` (no timestamps) and the historical
OpenMetrics export that `promtool tsdb create-blocks-from openmetrics` backfills (a sample
per series at each trial's end). Families are plain values: the agent turns them into its
exposition's families; `exposition_text` and `openmetrics_text` render them as text.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from kvpilot.collectors.secrets import mask_text
from kvpilot.dashboards.metric_catalog import FamilySpec, specs
from kvpilot.tuner.judge.judgement import Judgement
from kvpilot.tuner.problem.constraints import Value
from kvpilot.tuner.trials import Trial, TrialState

TRIAL_GOODPUT = "kvpilot_tuning_trial_goodput_tokens_per_second"
TRIAL_PREEMPTION_RATE = "kvpilot_tuning_trial_preemption_rate_per_second"
TRIAL_INFO = "kvpilot_tuning_trial_info"
BEST_GOODPUT = "kvpilot_tuning_best_goodput_tokens_per_second"
TRIALS_TOTAL = "kvpilot_tuning_trials_total"
LIVE_FLAGS_INFO = "kvpilot_live_flags_info"
CANARY_METRIC = "kvpilot_canary_metric"
# The verdict label of a trial without a canary judgement.
UNJUDGED = "unjudged"
TERMINAL_STATES = tuple(s for s in TrialState if s.terminal)


class FlagSource(StrEnum):
    """Where the live flags came from."""

    CONFIGURED = "configured"
    PROMOTED = "promoted"


@dataclass(frozen=True, slots=True)
class LiveFlags:
    """The flags one stable server runs with now (shown with their secrets masked)."""

    server: str
    flags: str
    source: FlagSource


# The families' specs are the catalog's; this module renders their samples.
SPECS: tuple[FamilySpec, ...] = specs(
    TRIAL_GOODPUT,
    TRIAL_PREEMPTION_RATE,
    TRIAL_INFO,
    BEST_GOODPUT,
    TRIALS_TOTAL,
    LIVE_FLAGS_INFO,
    CANARY_METRIC,
)
SPEC_BY_NAME: Mapping[str, FamilySpec] = {spec.name: spec for spec in SPECS}


@dataclass(frozen=True, slots=True)
class Sample:
    """One sample: labels in the family's order, a value, and an optional wall time."""

    labels: tuple[tuple[str, str], ...]
    value: float
    timestamp_s: float | None = None


@dataclass(frozen=True, slots=True)
class Family:
    """A family's spec and its samples."""

    spec: FamilySpec
    samples: tuple[Sample, ...]


def flags_text(values: Sequence[tuple[str, Value]]) -> str:
    """Knob values as vLLM's command line writes them, e.g. `--max-num-seqs 16`."""
    parts = []
    for name, value in values:
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            parts.append(flag if value else "--no-" + flag[2:])
        else:
            parts.append(f"{flag} {value}")
    return " ".join(parts)


def verdict_label(judgement: Judgement | None) -> str:
    """The canary's classification, or `unjudged`."""
    return UNJUDGED if judgement is None else judgement.classification.value


def tuning_families(
    trials: Sequence[Trial], live_flags: Sequence[LiveFlags], *, at_wall_s: float | None = None
) -> tuple[Family, ...]:
    """Every family from the trials and the live flags, stamped `at_wall_s` when given."""
    samples: dict[str, list[Sample]] = {spec.name: [] for spec in SPECS}

    def add(name: str, labels: Sequence[str], value: float) -> None:
        pairs = tuple(zip(SPEC_BY_NAME[name].labels, labels, strict=True))
        samples[name].append(Sample(pairs, value, at_wall_s))

    for trial in trials:
        verdict = verdict_label(trial.judgement)
        state = trial.state.value
        add(
            TRIAL_INFO,
            (
                trial.trial_id,
                state,
                verdict,
                flags_text(trial.values),
                mask_text(trial.reason or ""),
            ),
            1.0,
        )
        result = trial.result
        if not trial.state.terminal or result is None:
            continue
        if result.goodput_tokens_per_s is not None:
            add(TRIAL_GOODPUT, (trial.trial_id, state, verdict), result.goodput_tokens_per_s)
        window = result.metrics
        if window is not None and window.preemptions_total is not None and window.duration_s > 0:
            add(
                TRIAL_PREEMPTION_RATE,
                (trial.trial_id,),
                window.preemptions_total / window.duration_s,
            )
    for trial in trials:
        for metric in trial.judgement.metrics if trial.judgement else ():
            for side, median in (
                ("canary", metric.canary_median),
                ("baseline", metric.baseline_median),
            ):
                if median is not None:
                    add(CANARY_METRIC, (trial.trial_id, metric.name, side, "median"), median)
    best = best_goodput(trials)
    if best is not None:
        add(BEST_GOODPUT, (), best)
    for state in TERMINAL_STATES:
        add(TRIALS_TOTAL, (state.value,), float(sum(t.state is state for t in trials)))
    for live in live_flags:
        add(LIVE_FLAGS_INFO, (live.server, mask_text(live.flags), live.source.value), 1.0)
    return tuple(Family(spec, tuple(samples[spec.name])) for spec in SPECS)


def best_goodput(trials: Sequence[Trial]) -> float | None:
    """The highest goodput of a complete (feasible) trial; None before the first."""
    goodputs = [
        t.result.goodput_tokens_per_s
        for t in trials
        if t.state is TrialState.COMPLETE
        and t.result is not None
        and t.result.goodput_tokens_per_s is not None
    ]
    return max(goodputs, default=None)


# --- text ----------------------------------------------------------------------------


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _line(name: str, sample: Sample, extra: tuple[tuple[str, str], ...]) -> str:
    pairs = (*sample.labels, *extra)
    labels = ",".join(f'{k}="{_escape(v)}"' for k, v in pairs)
    text = f"{name}{{{labels}}}" if labels else name
    text += f" {sample.value!r}"
    if sample.timestamp_s is not None:
        text += f" {sample.timestamp_s:.3f}"
    return text


def _help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def exposition_text(families: Sequence[Family]) -> str:
    """Prometheus's text format 0.0.4 (info families as gauges), as `/metrics` serves it."""
    lines = []
    for family in families:
        spec = family.spec
        kind = "gauge" if spec.kind == "info" else spec.kind
        lines += [f"# HELP {spec.name} {_help(spec.help)}", f"# TYPE {spec.name} {kind}"]
        lines += [_line(spec.name, s, ()) for s in family.samples]
    return "\n".join(lines) + "\n"


def openmetrics_text(
    families: Sequence[Family], *, target_labels: Mapping[str, str] | None = None
) -> str:
    """OpenMetrics text ending in `# EOF`; `target_labels` (job, instance) join every sample."""
    extra = tuple((target_labels or {}).items())
    lines = []
    for family in families:
        spec = family.spec
        lines += [
            f"# TYPE {spec.base_name} {spec.kind}",
            f"# HELP {spec.base_name} {_help(spec.help)}",
        ]
        lines += [_line(spec.name, s, extra) for s in family.samples]
    return "\n".join([*lines, "# EOF"]) + "\n"


# --- history -------------------------------------------------------------------------


def openmetrics_history(
    trials: Sequence[Trial],
    live_flags: LiveFlags,
    *,
    start_wall_s: float,
    target_labels: Mapping[str, str] | None = None,
) -> str:
    """The families as the agent exported them after each trial ended, as OpenMetrics.

    Times are moved so that the first trial starts at `start_wall_s`. A trial whose canary
    judgement promotes replaces the live flags from its end on (source `promoted`).
    """
    finished = sorted((t for t in trials if t.state.terminal), key=lambda t: t.updated_wall_s)
    if not finished:
        raise ValueError("no finished trial: nothing to export")
    shift_s = start_wall_s - min(t.created_wall_s for t in trials)
    series: dict[str, dict[tuple[tuple[str, str], ...], list[Sample]]] = {
        spec.name: {} for spec in SPECS
    }
    live = live_flags
    for index, trial in enumerate(finished):
        if (
            trial.state is TrialState.COMPLETE
            and trial.judgement is not None
            and trial.judgement.promote
        ):
            live = LiveFlags(live.server, flags_text(trial.values), FlagSource.PROMOTED)
        at_s = trial.updated_wall_s + shift_s
        for family in tuning_families(finished[: index + 1], (live,), at_wall_s=at_s):
            for sample in family.samples:
                series[family.spec.name].setdefault(sample.labels, []).append(sample)
    # A series' samples stay together and in time order.
    families = [
        Family(spec, tuple(s for samples in series[spec.name].values() for s in samples))
        for spec in SPECS
    ]
    return openmetrics_text(families, target_labels=target_labels)
