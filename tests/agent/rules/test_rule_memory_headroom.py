"""The ledger's early warning, fed from the plugin's own exposition read back by the agent."""

from __future__ import annotations

import json
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

from kvpilot.agent.model import Condition
from kvpilot.agent.readings.snapshot import Snapshot
from kvpilot.agent.rules.base import RuleContext
from kvpilot.agent.rules.config import MemoryHeadroomConfig, RulesConfig
from kvpilot.agent.rules.memory_headroom import MemoryHeadroomRule
from kvpilot.collectors.kvpool.client import samples_to_scrape
from kvpilot.collectors.kvpool.ledger import MemoryLedger
from kvpilot.collectors.kvpool.ledger_families import LedgerCollector
from kvpilot.collectors.kvpool.ledger_reader import cuda_ledger_from
from kvpilot.collectors.kvpool.server import PartErrors
from kvpilot.collectors.promtext import parse_samples
from kvpilot.collectors.window import RollingWindow
from tests.agent.rules.rules_helpers import NO_GPU, instance

FIXTURES = Path(__file__).parent.parent.parent / "fixtures" / "allocator"
MIB = 1024 * 1024
GIB = 1024 * MIB
RECORDED_SLACK = 22 * MIB - int(14.5 * MIB)  # reserved - allocated in the recorded stats


def ledger(used: int, budget: int, total: int = 80 * GIB) -> MemoryLedger:
    stats = json.loads((FIXTURES / "memory_stats_device0.json").read_text())
    return cuda_ledger_from(
        device=0,
        rank="0",
        memory_stats=stats,
        free_and_total=(total - used, total),
        weights_bytes=16 * GIB,
        graph_bytes=None,
        context_bytes=None,
        kv_bytes=50 * GIB,
        blocks=None,
        budget_bytes=budget,
    )


def evaluate(rule: MemoryHeadroomRule, *ledgers: MemoryLedger) -> list[Condition]:
    """The ledgers as the plugin serves them, parsed as the agent scrapes them."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(
        LedgerCollector(
            engines=list,
            allocators=list,
            ledgers=lambda: list(ledgers),
            errors=PartErrors(),
            clock=lambda: 0.0,
        )
    )
    text = generate_latest(registry).decode()
    scrape = samples_to_scrape(
        parse_samples(text, prefixes=("kvpool_",)), taken_at_s=1.0, wall_time_s=1.0
    )
    assert scrape.allocators == ()  # ledger families are not mistaken for an allocator
    ctx = RuleContext(
        snapshot=Snapshot(
            taken_at_s=1.0, wall_time_s=1.0, vllm=None, kvpool=scrape, nvml=NO_GPU, durations_s=()
        ),  # type: ignore[arg-type]
        vllm_window=RollingWindow(retention_s=60.0),
        kvpool_window=RollingWindow(retention_s=60.0),
        figures=(),
        instance=instance(),
    )
    return rule.evaluate(ctx)


def test_drift_plus_slack_past_half_the_headroom_warns() -> None:
    rule = MemoryHeadroomRule(MemoryHeadroomConfig())
    budget = 72 * GIB  # headroom: 8 GiB
    (calm,) = evaluate(rule, ledger(used=budget + 2 * GIB, budget=budget))
    assert calm.active is False
    (warn,) = evaluate(rule, ledger(used=budget + 4 * GIB, budget=budget))
    assert warn.active is True  # 4 GiB drift + the recorded 7.5 MiB slack > 4 GiB
    assert warn.value is not None
    assert abs(warn.value - (4 * GIB + RECORDED_SLACK) / (8 * GIB)) < 1e-9
    assert dict(warn.labels)["alertname"] == "VllmMemoryHeadroomLow"


def test_the_share_is_settable_and_under_budget_use_is_no_drift() -> None:
    rule = MemoryHeadroomRule(MemoryHeadroomConfig(headroom_share_ratio=0.2))
    budget = 72 * GIB
    (warn,) = evaluate(rule, ledger(used=budget + 2 * GIB, budget=budget))
    assert warn.active is True  # 2 GiB > 20 % of 8 GiB
    (calm,) = evaluate(rule, ledger(used=budget - 10 * GIB, budget=budget))
    assert calm.active is False and calm.value == RECORDED_SLACK / (8 * GIB)


def test_cpu_ledgers_and_missing_budgets() -> None:
    rule = MemoryHeadroomRule(MemoryHeadroomConfig())
    cpu = MemoryLedger(device="cpu", rank="0", used_bytes=GIB, used_source="pss", parts=())
    assert evaluate(rule, cpu) == []  # no device budget on CPU: nothing to warn about
    (unknown,) = evaluate(rule, ledger(used=10 * GIB, budget=None))  # type: ignore[arg-type]
    assert unknown.active is None and unknown.reason


def test_on_by_default_with_half_the_headroom() -> None:
    assert RulesConfig().memory_headroom.headroom_share_ratio == 0.5
    assert RulesConfig().memory_headroom.enabled
