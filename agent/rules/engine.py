"""Evaluates every enabled rule on one tick's context: one snapshot, every rule the same."""

from __future__ import annotations

import logging

from kvpilot.agent.model import Condition, Instance, labels_of
from kvpilot.agent.readings.derive import EngineFigures
from kvpilot.agent.readings.snapshot import Snapshot
from kvpilot.agent.rules.base import Rule, RuleContext
from kvpilot.agent.rules.config import RulesConfig
from kvpilot.agent.rules.deferred import RequestsDeferredRule
from kvpilot.agent.rules.fragmentation import FragmentationRule
from kvpilot.agent.rules.gpu_memory import GpuMemoryGrowthRule, GpuNeighbourPressureRule
from kvpilot.agent.rules.memory_headroom import MemoryHeadroomRule
from kvpilot.agent.rules.occupancy import TokenOccupancyRule
from kvpilot.agent.rules.preemption import PreemptionSpikeRule
from kvpilot.agent.rules.saturation import KvSaturationRule
from kvpilot.agent.rules.server_down import ServerDownRule
from kvpilot.agent.rules.stall import EngineStallRule
from kvpilot.collectors.kvpool.client import KvBlockSample
from kvpilot.collectors.vllm_metrics import EngineSample
from kvpilot.collectors.window import RollingWindow

log = logging.getLogger(__name__)


def build_rules(config: RulesConfig) -> list[Rule]:
    """One object per enabled rule, in a fixed order."""
    candidates: list[tuple[bool, Rule]] = [
        (
            config.fragmentation.kv_blocks.enabled,
            FragmentationRule("kv_blocks", config.fragmentation.kv_blocks),
        ),
        (
            config.fragmentation.allocator.enabled,
            FragmentationRule("allocator", config.fragmentation.allocator),
        ),
        (config.preemption_spike.enabled, PreemptionSpikeRule(config.preemption_spike)),
        (config.server_down.enabled, ServerDownRule(config.server_down)),
        (config.kv_saturation.enabled, KvSaturationRule(config.kv_saturation)),
        (config.memory_headroom.enabled, MemoryHeadroomRule(config.memory_headroom)),
        (config.engine_stall.enabled, EngineStallRule(config.engine_stall)),
        (config.requests_deferred.enabled, RequestsDeferredRule(config.requests_deferred)),
        (config.token_occupancy.enabled, TokenOccupancyRule(config.token_occupancy)),
        (config.gpu_memory_growth.enabled, GpuMemoryGrowthRule(config.gpu_memory_growth)),
        (
            config.gpu_neighbour_pressure.enabled,
            GpuNeighbourPressureRule(config.gpu_neighbour_pressure),
        ),
    ]
    return [rule for enabled, rule in candidates if enabled]


class RuleEngine:
    """Holds the rules for the agent's lifetime (some keep history) and runs them per tick."""

    def __init__(self, rules: list[Rule]) -> None:
        self.rules = list(rules)
        self.errors_total: dict[str, int] = {}

    @classmethod
    def from_config(cls, config: RulesConfig) -> RuleEngine:
        return cls(build_rules(config))

    def evaluate(
        self,
        snapshot: Snapshot,
        *,
        instance: Instance,
        vllm_window: RollingWindow[EngineSample],
        kvpool_window: RollingWindow[KvBlockSample],
        figures: tuple[EngineFigures, ...] = (),
        instance_state: str | None = None,
        instance_state_reason: str | None = None,
    ) -> list[Condition]:
        """Every rule's conditions for one instance at one tick."""
        ctx = RuleContext(
            snapshot=snapshot,
            vllm_window=vllm_window,
            kvpool_window=kvpool_window,
            figures=figures,
            instance=instance,
            instance_state=instance_state,
            instance_state_reason=instance_state_reason,
        )
        return self.evaluate_context(ctx)

    def evaluate_context(self, ctx: RuleContext) -> list[Condition]:
        """Every rule on the same context; a rule that raises yields one unknown condition."""
        out: list[Condition] = []
        for rule in self.rules:
            try:
                out.extend(rule.evaluate(ctx))
            except Exception as exc:  # one broken rule must not silence the others
                self.errors_total[rule.name] = self.errors_total.get(rule.name, 0) + 1
                log.exception("rule %s failed on %s", rule.name, ctx.instance.name)
                reason = f"rule error: {exc!r}"
                out.append(
                    Condition(
                        rule=rule.name,
                        labels=labels_of(
                            {
                                "alertname": "KvpilotRuleError",
                                "rule": rule.name,
                                "instance": ctx.instance.name,
                                "role": ctx.instance.role,
                            }
                        ),
                        active=None,
                        value=None,
                        summary=f"rule {rule.name} could not be evaluated: {reason}",
                        reason=reason,
                    )
                )
        return out
