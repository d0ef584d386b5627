"""The memory ledger's early warning: slack plus drift eating the headroom before an OOM.

vLLM sizes its budget once, at start-up (RFC 27951: the profile is inaccurate), and the
caching allocator keeps freed memory as slack. When the slack and the use beyond the budget
together pass a share of what the budget leaves on the device, the next activation peak
may not fit. Ledgers without a device budget (CPU) say nothing here.
"""

from __future__ import annotations

from kvpilot.agent.model import Condition
from kvpilot.agent.rules.base import ConditionMaker, RuleContext, fmt_bytes, source_error_text
from kvpilot.agent.rules.config import MemoryHeadroomConfig
from kvpilot.collectors.errors import SourceError
from kvpilot.collectors.kvpool.ledger import ALLOCATOR_SLACK
from kvpilot.collectors.kvpool.ledger_client import LedgerSample

ALERTNAME = "VllmMemoryHeadroomLow"
RUNBOOK = (
    "The CUDA caching allocator's slack plus the memory used beyond vLLM's start-up budget "
    "are eating the headroom gpu_memory_utilization leaves: an out-of-memory error may be "
    "near. Read the memory ledger row (which part grew); a drained restart returns the slack; "
    "a lasting drift asks for a lower gpu_memory_utilization or kv_cache_memory_bytes."
)


class MemoryHeadroomRule:
    """Per device: slack + max(drift, 0) above `headroom_share_ratio` x headroom."""

    name = "memory_headroom"

    def __init__(self, config: MemoryHeadroomConfig) -> None:
        self.config = config
        self._maker = ConditionMaker.of(
            config, rule=self.name, alertname=ALERTNAME, runbook=RUNBOOK
        )

    def evaluate(self, ctx: RuleContext) -> list[Condition]:
        scrape = ctx.snapshot.kvpool
        if scrape is None:
            return []
        if isinstance(scrape, SourceError):
            return self._maker.unknown_all(ctx, source_error_text(scrape))
        out = [self._judge(ctx, ledger) for ledger in scrape.ledgers if ledger.device != "cpu"]
        self._maker.forget_except(ctx, out)
        return out

    def _judge(self, ctx: RuleContext, ledger: LedgerSample) -> Condition:
        target = {"gpu": ledger.device, "rank": ledger.rank}
        where = f"GPU {ledger.device} (rank {ledger.rank}) of {ctx.instance.name}"
        slack = ledger.part(ALLOCATOR_SLACK)
        drift, headroom = ledger.drift_bytes, ledger.headroom_bytes
        if slack is None or drift is None or headroom is None:
            reason = "the ledger lacks the allocator slack, the budget or the device capacity"
            summary = f"memory headroom unknown on {where}: {reason}"
            return self._maker.condition(
                ctx,
                target,
                active=None,
                value=None,
                summary=summary,
                description=summary,
                reason=reason,
            )
        eaten = slack + max(drift, 0.0)
        limit = self.config.headroom_share_ratio * headroom
        active = eaten > limit
        summary = (
            f"allocator slack {fmt_bytes(slack)} + drift {fmt_bytes(max(drift, 0.0))} "
            f"{'above' if active else 'within'} {self.config.headroom_share_ratio:.0%} of the "
            f"headroom {fmt_bytes(headroom)} on {where}"
        )
        return self._maker.condition(
            ctx,
            target,
            active=active,
            value=eaten / headroom if headroom > 0 else None,
            summary=summary,
            description=f"{summary}. Fires after {self.config.for_s:g} s; action: alert.",
            extra={"headroom_share": f"{self.config.headroom_share_ratio:g}"},
        )
