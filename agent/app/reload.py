"""Reloading the configuration on SIGHUP or `POST /-/reload`, as Prometheus and Alertmanager do.

The file is read and validated first: an invalid one is refused with its problems, and the
running configuration stays. The notifiers change in place (the outbox keeps what is queued;
queued and new notifications go to the new ones), and so do the rules (from the next tick)
and `remediation.dry_run` (the live switch's configuration layer, `kvpilot.agent.mode`).
Every other section applies when kvpilot restarts, and the reload says which of them
changed. Each reload is audited. On the pod runtime the Deployment's settings annotations
are laid over the file's configuration again (`layer`), so `kubectl annotate` and a reload
apply them as an edit of the file would.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from pydantic import SecretStr
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from kvpilot.agent.app.control_token import ControlToken, control_token
from kvpilot.agent.config import AgentConfig, ConfigError, NotifierConfig
from kvpilot.agent.mode import LiveMode, ModeSource, configured_mode
from kvpilot.agent.notify import Notifier
from kvpilot.agent.rules.config import RulesConfig
from kvpilot.agent.state import StateStore

log = logging.getLogger(__name__)

LIVE_SECTIONS = frozenset({"notifiers", "rules"})  # applied by a reload; others at the next start
DRY_RUN = "remediation.dry_run"  # the one setting of its section a reload applies


@dataclass(frozen=True, slots=True)
class ReloadResult:
    """What one reload did: the sections applied, those left for a restart, or the problems."""

    applied: tuple[str, ...] = ()
    needs_restart: tuple[str, ...] = ()
    problems: tuple[str, ...] = ()

    @property
    def refused(self) -> bool:
        return bool(self.problems)


class Reloadable(Protocol):
    """What a reload changes in the running loop: its notifiers and its rules."""

    def use_notifiers(
        self, configs: tuple[NotifierConfig, ...], notifiers: Mapping[str, Notifier]
    ) -> None: ...

    def use_rules(self, rules: RulesConfig) -> None: ...


class Reloader:
    """Reads the configuration again and applies what can change while kvpilot runs."""

    def __init__(
        self,
        load: Callable[[], AgentConfig],
        running: AgentConfig,
        loop: Reloadable,
        build_notifiers: Callable[[tuple[NotifierConfig, ...]], Mapping[str, Notifier]],
        *,
        audit: StateStore,
        mode: LiveMode | None = None,
        layer: Callable[[AgentConfig], Awaitable[AgentConfig]] | None = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._load = load
        self._layer = layer  # the Deployment's settings over the file's; never raises
        self._mode = mode
        self._running = running
        self._loop = loop
        self._store = audit
        self._wall_clock = wall_clock
        self._build_notifiers = build_notifiers
        self._lock = asyncio.Lock()
        self.last_successful = True  # kvpilot started on a valid configuration

    async def reload(self) -> ReloadResult:
        async with self._lock:
            try:
                new = self._load()
            except ConfigError as exc:
                return self._refused(tuple(exc.problems))
            except OSError as exc:
                return self._refused((f"cannot read: {exc.strerror or exc}",))
            if self._layer is not None:
                new = await self._layer(new)
            return self._apply(new)

    def _apply(self, new: AgentConfig) -> ReloadResult:
        old = self._running
        changed = [
            name for name in type(old).model_fields if getattr(old, name) != getattr(new, name)
        ]
        applied = tuple(name for name in changed if name in LIVE_SECTIONS)
        later = tuple(name for name in changed if name not in LIVE_SECTIONS)
        if "notifiers" in applied:
            self._loop.use_notifiers(new.notifiers, self._build_notifiers(new.notifiers))
        if "rules" in applied:
            self._loop.use_rules(new.rules)
        running = old.model_copy(update={name: getattr(new, name) for name in applied})
        dry_run = new.remediation.dry_run
        if self._mode is not None and dry_run != old.remediation.dry_run:
            self._mode.set(ModeSource.CONFIG, configured_mode(dry_run), DRY_RUN)
            remediation = running.remediation.model_copy(update={"dry_run": dry_run})
            running = running.model_copy(update={"remediation": remediation})
            if remediation == new.remediation:  # nothing else in the section changed
                later = tuple(name for name in later if name != "remediation")
            applied = (*applied, DRY_RUN)
        self._running = running
        names = ", ".join(n.name for n in self._running.notifiers) or "none"
        if not changed:
            reason = "the configuration is unchanged"
        else:
            reason = f"applied: {', '.join(applied) or 'nothing'} (notifiers now: {names})"
            if later:
                reason += (
                    f"; {', '.join(later)} changed too: these apply when kvpilot restarts "
                    "(it runs on their earlier values until then)"
                )
        self.last_successful = True
        level = logging.WARNING if later else logging.INFO
        log.log(level, "configuration reloaded: %s", reason)
        self._audit("applied", reason)
        return ReloadResult(applied, later)

    def _refused(self, problems: tuple[str, ...]) -> ReloadResult:
        reason = "; ".join(problems) or "invalid configuration"
        self.last_successful = False
        log.error(
            "reload refused, the new configuration is invalid: %s; kvpilot keeps running on "
            "the configuration it had",
            reason,
        )
        self._audit("refused", reason)
        return ReloadResult(problems=problems)

    def _audit(self, decision: str, reason: str) -> None:
        try:
            self._store.record_audit(
                wall_s=self._wall_clock(),
                actor="agent",
                action="reload",
                target="configuration",
                decision=decision,
                reason=reason,
            )
        except Exception:  # the reload itself stands; the audit trail says what it could
            log.exception("reload: recording the audit record failed")


def reload_routes(reloader: Reloader, token: ControlToken | SecretStr | None) -> list[Route]:
    """`POST /-/reload`, behind the control API's bearer token like every POST."""
    control = control_token(token)

    async def reload(request: Request) -> JSONResponse:
        verdict = control.check(request.headers.get("authorization", ""))
        if verdict == "disabled":
            return JSONResponse({"error": control.disabled_reason()}, 403)
        if verdict == "refused":
            log.warning("control API: refused POST /-/reload (bad or missing token)")
            return JSONResponse({"error": "missing or wrong bearer token"}, 401)
        result = await reloader.reload()
        if result.refused:
            body = {"error": "invalid configuration", "problems": list(result.problems)}
            return JSONResponse(body, 400)
        body = {"applied": list(result.applied), "needs_restart": list(result.needs_restart)}
        return JSONResponse(body)

    return [Route("/-/reload", reload, methods=["POST"])]
