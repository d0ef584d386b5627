"""Settings of every rule: thresholds, `for` durations, labels, severity and action.

Each rule has one model; `RulesConfig` groups them with the product's defaults. Units are in
the field names. The `action` of a rule is one of the actions that rule supports:

* `alert`: notify only.
* `restart`: the restart ladder (the light step where vLLM offers one and the user enabled
  it, then drain, restart and verify), under the remediation guards.
* `ladder` (preemption spike and KV saturation, causes a restart does not cure): alert;
  promote a validated better configuration if the tuner holds one; restart with the same
  flags only for the capacity-leak signature (KV usage high while few requests run);
  otherwise recommend a lower admission cap (`--max-num-active-seqs`) or a tuning run.

A rule given in part keeps the rest of its default: the user's fields are validated over the
default rule's (`fragmentation.allocator` with only a threshold still restarts).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from kvpilot.agent.strict_model import StrictModel

Severity = Literal["info", "warning", "critical"]
# Labels a rule sets itself; a user label may not replace them.
RESERVED_LABELS = frozenset(
    {
        "alertname",
        "instance",
        "role",
        "model_name",
        "engine",
        "source",
        "gpu",
        "severity",
        "kv_group",
    }
)
_LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
MIB = 1024 * 1024


class _Section(StrictModel):
    """A section given as a mapping goes over its field's default."""

    @model_validator(mode="before")
    @classmethod
    def _over_defaults(cls, data: Any) -> Any:
        # A default can be more than its class's defaults (the allocator's `restart`): fields
        # the user leaves out come from that default, not from the class.
        if not isinstance(data, Mapping):
            return data
        merged = dict(data)
        for name, field in cls.model_fields.items():
            given = data.get(name)
            if isinstance(given, Mapping):
                default = field.get_default(call_default_factory=True)
                if isinstance(default, BaseModel):
                    merged[name] = {**default.model_dump(), **given}
        return merged


class _RuleBase(_Section):
    """What every rule has: on/off, a `for` duration, extra labels and a severity."""

    enabled: bool = Field(True, description="Evaluate this rule.")
    for_s: float = Field(
        60.0,
        ge=0,
        description="How long the condition must hold without a break before the alert "
        "fires (Prometheus `for`); 0 fires on the first tick it holds.",
    )
    labels: dict[str, str] = Field(
        default_factory=dict,
        description="Extra labels added to this rule's alerts (for routing in receivers).",
    )
    severity: Severity = Field("warning", description="The `severity` label of the alert.")

    @field_validator("labels")
    @classmethod
    def _check_labels(cls, labels: dict[str, str]) -> dict[str, str]:
        for name in labels:
            if not _LABEL_NAME.match(name):
                raise ValueError(
                    f"label name {name!r} is not a valid Prometheus label name "
                    "(letters, digits and underscores, not starting with a digit)"
                )
            if name in RESERVED_LABELS or name.startswith("__"):
                raise ValueError(
                    f"label {name!r} is set by kvpilot itself and cannot be overridden"
                )
        return labels


class FragmentationSourceConfig(_RuleBase):
    """Fragmentation (1 - largest contiguous free / total free) of one pool above a threshold."""

    threshold_ratio: float = Field(
        0.30,
        gt=0,
        lt=1,
        description="Alert when the fragmentation rate is above this (0..1).",
    )
    for_s: float = Field(
        120.0, ge=0, description="How long the rate must stay above the threshold before firing."
    )
    action: Literal["alert", "restart"] = Field(
        "alert", description="`alert` notifies only; `restart` runs the restart ladder."
    )


class FragmentationConfig(_Section):
    """Fragmentation per source: the KV block pool and the CUDA caching allocator."""

    kv_blocks: FragmentationSourceConfig = Field(
        default_factory=FragmentationSourceConfig,
        description="The KV block pool (from the kvpool plugin). Paged attention can use any "
        "free block, and the load scatters the free list again after a restart: alert only "
        "unless configured.",
    )
    allocator: FragmentationSourceConfig = Field(
        default_factory=lambda: FragmentationSourceConfig(action="restart"),
        description="The CUDA caching allocator (GPU only): free memory that cannot be "
        "allocated; a restart gives it back contiguous memory, so the default is the restart "
        "ladder.",
    )


class PreemptionSpikeConfig(_RuleBase):
    """Preemption rate over a short window above a floor and above a multiple of its baseline."""

    for_s: float = Field(
        0.0,
        ge=0,
        description="How long the spike must last before firing; the rate is already taken "
        "over `window_s`, so the default fires at once.",
    )
    window_s: float = Field(30.0, gt=0, description="The short window the rate is taken over.")
    baseline_window_s: float = Field(
        600.0,
        gt=0,
        description="The recent past the baseline rate is taken over (ending where the short "
        "window starts). Limited by the agent's window retention.",
    )
    floor_per_s: float = Field(
        0.1,
        ge=0,
        description="The absolute floor: the short-window rate (preemptions per second) must "
        "be above it.",
    )
    baseline_multiple: float = Field(
        3.0,
        ge=1,
        description="The short-window rate must also be above this multiple of the baseline "
        "rate. Without a baseline yet (a fresh server) the floor alone decides.",
    )
    capacity_leak_usage_ratio: float = Field(
        0.90,
        gt=0,
        le=1,
        description="Capacity-leak signature, first half: KV usage at or above this "
        "(with at most `capacity_leak_max_running` requests running).",
    )
    capacity_leak_max_running: int = Field(
        2,
        ge=0,
        description="Capacity-leak signature, second half: at most this many requests running "
        "(with KV usage at or above `capacity_leak_usage_ratio`). Only this signature makes "
        "the `ladder` action restart with the same flags.",
    )
    action: Literal["alert", "ladder", "restart"] = Field(
        "ladder",
        description="`ladder`: alert, promote a validated better configuration if the tuner "
        "has one, restart only for the capacity-leak signature, else recommend tuning; "
        "`restart`: the restart ladder whatever the signature; `alert`: notify only.",
    )

    @model_validator(mode="after")
    def _baseline_longer(self) -> PreemptionSpikeConfig:
        if self.baseline_window_s <= self.window_s:
            raise ValueError(
                f"baseline_window_s ({self.baseline_window_s}) must be longer than "
                f"window_s ({self.window_s})"
            )
        return self


class KvSaturationConfig(_RuleBase):
    """KV cache usage near 1 while requests wait for room."""

    usage_threshold_ratio: float = Field(
        0.98,
        gt=0,
        le=1,
        description="Alert when KV cache usage is at or above this (0..1) and at least "
        "`min_waiting` requests wait.",
    )
    min_waiting: int = Field(
        1, ge=1, description="The fewest waiting requests that count as saturation."
    )
    action: Literal["alert", "ladder", "restart"] = Field(
        "ladder",
        description="`ladder`: alert, promote a validated better configuration if the tuner "
        "holds one, else recommend a lower admission cap (`--max-num-active-seqs`) or a "
        "tuning run, and never restart with the same flags; `restart`: the restart ladder; "
        "`alert`: notify only.",
    )


class EngineStallConfig(_RuleBase):
    """Requests waiting or running while the engine's iteration counter does not move."""

    stall_s: float = Field(
        30.0,
        gt=0,
        description="Alert when the iteration counter has not moved for this long while "
        "requests wait or run (`/health` stays 200 when the engine is wedged).",
    )
    for_s: float = Field(
        0.0, ge=0, description="Extra time the stall must last before firing, after `stall_s`."
    )
    severity: Severity = Field("critical", description="The `severity` label of the alert.")
    action: Literal["alert", "restart"] = Field(
        "alert",
        description="`alert` notifies only; `restart` runs the restart ladder. Unset, the "
        "runtime decides: `restart` for the local and process runtimes (kvpilot owns the "
        "server), `alert` for pod (the fleet's first-install mode will govern it) and attach "
        "(kvpilot cannot restart).",
    )


class RequestsDeferredConfig(_RuleBase):
    """Partial starvation: requests held back (deferred) for long while others run.

    vLLM's `num_requests_waiting_by_reason{reason="deferred"}` is a gauge, not a per-request
    age: a deferred count that never drops to 0 for `deferred_limit_s` while requests run
    (and the engine steps) is read as some request deferred that long.
    """

    deferred_limit_s: float = Field(
        60.0,
        gt=0,
        description="Alert when at least one request has stayed deferred this long "
        "(the deferred count never 0 over the span) while others run.",
    )
    min_running: int = Field(
        1, ge=0, description="The fewest running requests that count as others progressing."
    )
    for_s: float = Field(
        0.0, ge=0, description="Extra time the starvation must last, after `deferred_limit_s`."
    )
    severity: Severity = Field("critical", description="The `severity` label of the alert.")
    action: Literal["alert", "restart"] = Field(
        "alert",
        description="`restart`: the restart ladder (only a restart recovers a scheduler "
        "that stopped admitting); `alert`: notify only. Unset, the runtime decides: "
        "`restart` for the local and process runtimes, `alert` for pod and attach.",
    )


class TokenOccupancyConfig(_RuleBase):
    """KV blocks mostly in use while the tokens in them fill few of their slots."""

    usage_above_ratio: float = Field(
        0.8,
        ge=0,
        lt=1,
        description="Block usage (blocks in use / usable blocks) must be above this.",
    )
    occupancy_below_ratio: float = Field(
        0.5,
        gt=0,
        le=1,
        description="Alert when token occupancy (tokens / (blocks in use x block size)) "
        "is below this while block usage is above `usage_above_ratio`.",
    )
    for_s: float = Field(300.0, ge=0, description="How long it must last before firing.")
    action: Literal["alert"] = Field(
        "alert",
        description="Only `alert`: the remedy is a smaller --block-size, which the alert "
        "names; a restart with the same flags changes nothing.",
    )


class GpuMemoryGrowthConfig(_RuleBase):
    """The vLLM process's GPU memory growing beyond weights + KV pool: a leak slope."""

    window_s: float = Field(
        1800.0, gt=0, description="The long window the growth slope is fitted over."
    )
    min_coverage_ratio: float = Field(
        0.5,
        gt=0,
        le=1,
        description="The slope is unknown until samples cover at least this share of `window_s`.",
    )
    slope_threshold_bytes_per_s: float = Field(
        float(MIB) / 60.0,
        gt=0,
        description="Alert when the least-squares slope of the process's GPU memory is above "
        "this (default 1 MiB per minute) and it grew by at least `min_growth_bytes`.",
    )
    min_growth_bytes: int = Field(
        256 * MIB,
        ge=0,
        description="The least growth over the window (newest minus oldest) that counts.",
    )
    for_s: float = Field(300.0, ge=0, description="How long the growth must last before firing.")
    action: Literal["alert", "restart"] = Field(
        "alert", description="`alert` notifies only; `restart` runs the restart ladder."
    )


class MemoryHeadroomConfig(_RuleBase):
    """The memory ledger's early warning: allocator slack plus drift from vLLM's budget
    eating into the headroom the budget leaves on the device (GPU ledgers only)."""

    headroom_share_ratio: float = Field(
        0.5,
        gt=0,
        le=1,
        description="Warn when allocator slack plus the drift beyond vLLM's budget exceed "
        "this share of the headroom (device capacity minus the budget).",
    )
    action: Literal["alert"] = Field(
        "alert", description="`alert` notifies only: an early warning before out-of-memory."
    )


class GpuNeighbourPressureConfig(_RuleBase):
    """Other processes on the server's GPU holding memory the server would need to start again."""

    margin_ratio: float = Field(
        0.05,
        ge=0,
        lt=1,
        description="Alert when the memory left to the server after a stop (total minus the "
        "neighbours' use) is below what it needs at start-up (gpu_memory_utilization x "
        "total) plus this margin of it.",
    )
    for_s: float = Field(30.0, ge=0, description="How long the pressure must last before firing.")
    action: Literal["alert"] = Field(
        "alert",
        description="Only `alert`: a restart would not get the memory back and could leave "
        "the server unable to start.",
    )


class ServerDownConfig(_RuleBase):
    """The vLLM server's process exited or disappeared (the runtime says so)."""

    for_s: float = Field(5.0, ge=0, description="How long the server must stay down before firing.")
    severity: Severity = Field("critical", description="The `severity` label of the alert.")
    action: Literal["restart", "alert"] = Field(
        "restart",
        description="restart: bring it back through the runtime (under the remediation "
        "guards); alert: notify only (another supervisor restarts it).",
    )


class RulesConfig(_Section):
    """Every rule, with the product's defaults."""

    fragmentation: FragmentationConfig = Field(
        default_factory=FragmentationConfig,
        description="Fragmentation rate above 0.30, sustained, per source.",
    )
    preemption_spike: PreemptionSpikeConfig = Field(
        default_factory=PreemptionSpikeConfig,
        description="Preemption spike (from the plugin's lag-free counter where present, "
        "else vLLM's).",
    )
    server_down: ServerDownConfig = Field(
        default_factory=ServerDownConfig,
        description="The server's process exited or is missing.",
    )
    kv_saturation: KvSaturationConfig = Field(
        default_factory=KvSaturationConfig,
        description="KV cache usage near 1 with requests waiting.",
    )
    engine_stall: EngineStallConfig = Field(
        default_factory=EngineStallConfig,
        description="Requests waiting or running while the engine makes no progress.",
    )
    requests_deferred: RequestsDeferredConfig = Field(
        default_factory=RequestsDeferredConfig,
        description="Requests deferred past a limit while others run (partial starvation).",
    )
    token_occupancy: TokenOccupancyConfig = Field(
        default_factory=TokenOccupancyConfig,
        description="Block usage high while token occupancy is low: a smaller block size "
        "gives capacity back.",
    )
    gpu_memory_growth: GpuMemoryGrowthConfig = Field(
        default_factory=GpuMemoryGrowthConfig,
        description="GPU memory of the vLLM process growing beyond weights + KV pool.",
    )
    gpu_neighbour_pressure: GpuNeighbourPressureConfig = Field(
        default_factory=GpuNeighbourPressureConfig,
        description="Other processes on the same GPU taking memory the server needs to restart.",
    )
    memory_headroom: MemoryHeadroomConfig = Field(
        default_factory=MemoryHeadroomConfig,
        description="Allocator slack plus drift from vLLM's memory budget past a share of "
        "the headroom: an early warning from the memory ledger.",
    )
    external_labels: dict[str, str] = Field(
        default_factory=dict,
        description="Labels added to every alert kvpilot notifies, as Prometheus's "
        "external_labels (e.g. cluster). In a pod, namespace and pod come from "
        "KVPILOT_POD_NAMESPACE and KVPILOT_POD_NAME unless set here; an alert's own labels "
        "win, so instance stays the server's name.",
    )

    @field_validator("external_labels")
    @classmethod
    def _external_label_names(cls, labels: dict[str, str]) -> dict[str, str]:
        for name in labels:
            if not _LABEL_NAME.match(name) or name.startswith("__"):
                raise ValueError(f"external label name {name!r} is not a Prometheus label name")
            if name in RESERVED_LABELS:
                raise ValueError(f"external label {name!r} is set by the rules themselves")
        return labels


# Liveness rules whose remedy is a restart: their default action depends on who owns the server.
LIVENESS_RULES = ("engine_stall", "requests_deferred")
RESTARTING_RUNTIMES = frozenset({"local", "process"})


def with_runtime_defaults(rules: Any, runtime_kind: object) -> Any:
    """The raw `rules` mapping with each liveness rule's action defaulted for the runtime:
    `restart` where kvpilot owns the server's process (local, process), else `alert` (pod:
    the fleet's first-install mode will decide; attach: nothing to restart). An action the
    user set is kept."""
    if runtime_kind not in RESTARTING_RUNTIMES:
        return rules
    if rules is None:
        rules = {}
    if not isinstance(rules, Mapping):
        return rules  # not a mapping: validation says why
    out = dict(rules)
    for name in LIVENESS_RULES:
        given = out.get(name)
        if given is None:
            out[name] = {"action": "restart"}
        elif isinstance(given, Mapping) and "action" not in given:
            out[name] = {**given, "action": "restart"}
    return out
