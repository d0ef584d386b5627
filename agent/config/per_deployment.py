"""Per-Deployment settings: `kvpilot.dev/<dotted.path>` annotations of one Deployment laid
over the shared configuration (one ConfigMap for every Deployment of a namespace).

Only settings that are per-Deployment by nature may be laid over (`PER_DEPLOYMENT`, and every
number of a rule: its thresholds, durations and windows): when and how hard a model is tuned,
its SLO and its load, its restart budget, its rules' thresholds. Where vLLM runs, what kvpilot
may change and how (remediation, promotion, notifiers and their secrets) stay the ConfigMap
owner's; the mode has its own annotation (`kvpilot.dev/mode`).

Each value is read as a YAML scalar within bounds, merged into the configuration's mapping,
and the whole configuration is validated again by its own models: either every annotation
applies or none does (`Layered.problems` then says why, and the shared configuration stands).
Pure: the Kubernetes read is `kvpilot.agent.runtimes.kubernetes.deployment_settings`.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, get_args

from pydantic import BaseModel

from kvpilot.agent.config.agent import AgentConfig
from kvpilot.agent.config.bounded_yaml import YamlInputError, load_yaml
from kvpilot.agent.config.errors import ConfigError, suggest
from kvpilot.agent.config.load import validate_config
from kvpilot.agent.rules.config import RulesConfig

PREFIX = "kvpilot.dev/"
MAX_SETTINGS = 32  # settings annotations on one Deployment; more is refused whole
MAX_NAME_CHARS = 63  # the name part of an annotation key, as Kubernetes bounds it
MAX_VALUE_CHARS = 256  # a schedule, a number, a surge: short

# Settings a Deployment may set for itself, beside every number under `rules`.
PER_DEPLOYMENT = frozenset(
    {
        "tuning.schedule",
        "tuning.schedule_spread_s",
        "tuning.trials",
        "tuning.windows",
        "tuning.min_num_seqs",
        "tuning.max_num_seqs",
        "tuning.kv_min_bytes",
        "tuning.kv_max_bytes",
        "tuning.max_gpu_memory_utilization",
        "tuning.slo.ttft_p95_s",
        "tuning.slo.inter_token_p95_s",
        "tuning.workload.requests",
        "tuning.workload.concurrency",
        "tuning.workload.prompt_len",
        "tuning.workload.output_len",
        "runtime.kubernetes.restarting_at_once",
        "runtime.kubernetes.promotion_surge",
    }
)
Scalar = str | int | float | bool | None


@dataclass(frozen=True, slots=True)
class Setting:
    """One annotation read as a setting: its config path, its value, the annotation's text."""

    path: str
    value: Scalar
    text: str


@dataclass(frozen=True, slots=True)
class Layered:
    """The configuration with a Deployment's settings, or the shared one and the problems."""

    config: AgentConfig
    settings: tuple[Setting, ...] = ()
    problems: tuple[str, ...] = ()

    @property
    def from_deployment(self) -> dict[str, str]:
        """path -> the annotation's text, of the settings in force."""
        return {s.path: s.text for s in self.settings}


def is_setting_name(name: str) -> bool:
    """Whether an annotation's name (after the prefix) reads as a configuration path: dotted,
    or a top-level section. kvpilot's own other annotations (`mode`, `recommendation`,
    `inject`, `canary-of`, `handover-sha256` ...) are neither, and are left alone."""
    return "." in name or name in AgentConfig.model_fields


def settings_of(annotations: Mapping[str, str]) -> tuple[tuple[Setting, ...], tuple[str, ...]]:
    """The settings among a Deployment's annotations, and the problems of those refused."""
    named = sorted(
        (key, value)
        for key, value in annotations.items()
        if key.startswith(PREFIX) and is_setting_name(key[len(PREFIX) :])
    )
    if len(named) > MAX_SETTINGS:
        return (), (f"{len(named)} settings annotations, more than the {MAX_SETTINGS} read",)
    settings: list[Setting] = []
    problems: list[str] = []
    for key, text in named:
        try:
            settings.append(_setting(key[len(PREFIX) :], text))
        except ValueError as exc:
            problems.append(f"{key[: MAX_NAME_CHARS + len(PREFIX)]}: {exc}")
    return tuple(settings), tuple(problems)


def layer_settings(shared: AgentConfig, annotations: Mapping[str, str]) -> Layered:
    """`shared` with the Deployment's settings, validated whole; or `shared` and the problems."""
    settings, problems = settings_of(annotations)
    if problems:
        return Layered(shared, problems=problems)
    if not settings:
        return Layered(shared)
    data = shared.model_dump(exclude_unset=True, by_alias=True)
    if AgentConfig.model_validate(data) != shared:  # guards the merge's premise
        return Layered(shared, problems=("the shared configuration does not read back whole",))
    for setting in settings:
        _set(data, setting.path.split("."), setting.value)
    try:
        layered = validate_config(data, warn=False)
    except ConfigError as exc:
        return Layered(shared, problems=tuple(_named(p, settings) for p in exc.problems))
    return Layered(layered, settings)


def _named(problem: str, settings: tuple[Setting, ...]) -> str:
    """A validation problem named by its annotation where one setting caused it."""
    for setting in settings:
        if problem.startswith(f"{setting.path}:"):
            return f"{PREFIX}{problem}"
    return f"with the Deployment's settings: {problem}"


def _setting(path: str, text: str) -> Setting:
    if len(path) > MAX_NAME_CHARS:
        raise ValueError(f"a name longer than {MAX_NAME_CHARS} characters")
    if len(text) > MAX_VALUE_CHARS:
        raise ValueError(f"a value longer than {MAX_VALUE_CHARS} characters")
    if not per_deployment(path):
        check_known(path)
        raise ValueError("not a per-Deployment setting: set it in the shared configuration")
    return Setting(path, _scalar(text), text)


def per_deployment(path: str) -> bool:
    """Whether `path` is one a Deployment may set: in PER_DEPLOYMENT, or a rule's number."""
    if path in PER_DEPLOYMENT:
        return True
    parts = path.split(".")
    if parts[0] != "rules" or len(parts) < 3:
        return False
    leaf = _field_type(RulesConfig, parts[1:])
    return leaf is not None and _is_number(leaf)


def check_known(path: str) -> None:
    """ValueError naming `path` (and the closest field) where it names no setting."""
    parts = path.split(".")
    model: type[BaseModel] = AgentConfig
    for depth, part in enumerate(parts):
        fields = model.model_fields
        if part not in fields:
            raise ValueError(f"no such setting{suggest(part, fields)}")
        if parts[0] == "runtime":  # a union of kinds, each with fields of its own
            return
        inner = _model_of(fields[part].annotation)
        if inner is None:
            if depth < len(parts) - 1:
                raise ValueError("no such setting")
            return
        model = inner


def _field_type(model: type[BaseModel], parts: list[str]) -> Any:
    for depth, part in enumerate(parts):
        info = model.model_fields.get(part)
        if info is None:
            return None
        if depth == len(parts) - 1:
            return info.annotation
        inner = _model_of(info.annotation)
        if inner is None:
            return None
        model = inner
    return None


def _model_of(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    models = [a for a in get_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
    return models[0] if len(models) == 1 else None


def _is_number(annotation: Any) -> bool:
    kinds = set(get_args(annotation)) - {type(None)} or {annotation}
    return all(k in (int, float) for k in kinds)


def _scalar(text: str) -> Scalar:
    """The text as YAML reads one scalar (`3`, `0.5`, `null`, `true`); text YAML cannot read
    as one (`*/5 * * * *` starts like an alias) or reads as a date stays the text."""
    try:
        value = load_yaml(text)
    except YamlInputError:
        return text
    if isinstance(value, datetime.date):
        return text
    if isinstance(value, list | dict):
        raise ValueError("one value, not a list or a mapping")
    if not isinstance(value, str | int | float | bool) and value is not None:
        return text
    return value


def _set(data: dict[str, Any], parts: list[str], value: Scalar) -> None:
    node = data
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[parts[-1]] = value
