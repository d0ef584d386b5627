"""The server is down: its process exited or is missing, as the runtime sees it."""

from __future__ import annotations

from kvpilot.agent.model import Condition
from kvpilot.agent.rules.base import ConditionMaker, RuleContext
from kvpilot.agent.rules.config import ServerDownConfig

ALERTNAME = "VllmServerDown"
RUNBOOK = (
    "The vLLM server's process is gone. Its log (the local runtime keeps one per instance) "
    "says why: an out-of-memory kill, a crash at start-up, a signal. With action restart "
    "kvpilot brings it back under the remediation budget and circuit breaker."
)
_DOWN = frozenset({"exited", "missing"})


class ServerDownRule:
    """Per instance: active while the runtime reports the process exited or missing."""

    name = "server_down"

    def __init__(self, config: ServerDownConfig) -> None:
        self.config = config
        self._maker = ConditionMaker.of(
            config, rule=self.name, alertname=ALERTNAME, runbook=RUNBOOK
        )

    def evaluate(self, ctx: RuleContext) -> list[Condition]:
        state, why = ctx.instance_state, ctx.instance_state_reason
        where = ctx.instance.name
        if state is None or state == "unknown":
            reason = f"the runtime cannot tell whether {where} runs" + (f": {why}" if why else "")
            summary = f"server state unknown on {where}"
            return [
                self._maker.condition(
                    ctx,
                    {},
                    active=None,
                    value=None,
                    summary=summary,
                    description=summary,
                    reason=reason,
                )
            ]
        down = state in _DOWN
        summary = f"vLLM on {where} is {state}" + (f" ({why})" if why and down else "")
        return [
            self._maker.condition(
                ctx,
                {},
                active=down,
                value=1.0 if down else 0.0,
                summary=summary,
                description=summary,
            )
        ]
