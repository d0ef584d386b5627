"""The JSON API beside /metrics: read-only status and alerts, token-protected control.

Control endpoints (POST) need `Authorization: Bearer <api.token>`; without a configured
token they are disabled (403), never open. The token is checked before the body is read;
then the body is read within `BodyLimits` (413 when too large, 400 when not JSON or nested
too deep), validated (422), and its instance looked up (404), all before anything is
changed or recorded.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    StringConstraints,
    ValidationError,
    model_validator,
)
from starlette.requests import Request
from starlette.routing import Route

from kvpilot.agent.app.control_ports import ControlPorts, HeldCanaries
from kvpilot.agent.app.control_token import ControlToken, control_token
from kvpilot.agent.app.json_render import JsonResponse, error_response
from kvpilot.agent.app.request_body import BodyLimits, RequestRejected, read_json
from kvpilot.agent.config import secret_values
from kvpilot.agent.config.runtime import RuntimeConfig
from kvpilot.agent.mode import LiveMode, Mode, ModeSource
from kvpilot.agent.runtimes import Runtime
from kvpilot.agent.runtimes.kubernetes.values import RecommendsFlags
from kvpilot.agent.runtimes.offloop import in_daemon_thread
from kvpilot.agent.tuning.held import ReleaseRefused
from kvpilot.agent.tuning.workload.as_json import workload_json
from kvpilot.agent.tuning.workload.window import WorkloadWindow
from kvpilot.collectors.secrets import mask, mask_argv, mask_text, mask_url
from kvpilot.tuner.rollout.record import Release

log = logging.getLogger(__name__)

Handler = Callable[[Request], Awaitable[JsonResponse]]

MAX_MATCHERS = 32
MAX_PROBLEMS = 10
MAX_TRIAL_ID = 64
NOTHING_HELD = "no tuning here: nothing is held (tuning.schedule is not set)"
MAX_LISTED_REMEDIATIONS = 500
DEFAULT_LISTED_REMEDIATIONS = 20
DEFAULT_LIMITS = BodyLimits()
RUNTIME_READ_TIMEOUT_S = 5.0  # the status API's wait on the runtime's reads
# Prometheus's label-name syntax, as alert labels use it.
LabelName = Annotated[str, StringConstraints(pattern=r"^[a-zA-Z_][a-zA-Z0-9_]*$", max_length=128)]
LabelValue = Annotated[str, StringConstraints(max_length=256)]
InstanceName = Annotated[str, StringConstraints(min_length=1, max_length=128)]
IncidentId = Annotated[str, StringConstraints(min_length=1, max_length=64)]
# Strict: a number where a string belongs (or "yes" for a boolean) is refused, not converted.
_STRICT = ConfigDict(extra="forbid", strict=True)


class SilenceRequest(BaseModel):
    model_config = _STRICT
    matchers: dict[LabelName, LabelValue] = Field(
        min_length=1, max_length=MAX_MATCHERS, description="Labels an alert must carry."
    )
    duration_s: float = Field(gt=0, le=30 * 86400, description="How long the silence lasts.")
    comment: str = Field("", max_length=500)
    requested_by: str = Field("api", max_length=100)


class TriggerRequest(BaseModel):
    model_config = _STRICT
    instance: InstanceName
    force: bool = False
    reason: str = Field("", max_length=500)
    requested_by: str = Field("api", max_length=100)


class VetoRequest(BaseModel):
    model_config = _STRICT
    instance: InstanceName | None = None
    incident_id: IncidentId | None = None
    reason: str = Field(min_length=1, max_length=500)
    requested_by: str = Field("api", max_length=100)
    duration_s: float | None = Field(
        None, gt=0, le=30 * 86400, description="How long the veto lasts; none: until lifted."
    )

    @model_validator(mode="after")
    def _one_target(self) -> VetoRequest:
        if (self.instance is None) == (self.incident_id is None):
            raise ValueError("give exactly one of instance or incident_id")
        return self


class ReleaseRequest(BaseModel):
    """A held canary's release: promoted (the way a pass is) or rolled back, and why."""

    model_config = _STRICT
    action: Literal["promote", "rollback"]
    reason: str = Field(min_length=1, max_length=500)
    requested_by: str = Field("api", min_length=1, max_length=100)


class ModeRequest(BaseModel):
    """The control API's layer of the switch; null clears it (the layers below apply)."""

    model_config = _STRICT
    mode: Literal["paused", "dry-run", "armed"] | None
    requested_by: str = Field("api", max_length=100)


_LABEL_FIELDS = frozenset({"labels", "annotations", "matchers"})


def _plain(value: Any) -> Any:
    """JSON-ready data; label sets (sorted pairs inside kvpilot) become objects."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        data = dataclasses.asdict(value)
        return {
            key: dict(item) if key in _LABEL_FIELDS and isinstance(item, tuple) else _plain(item)
            for key, item in data.items()
        }
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_plain(v) for v in value]
    return value


def _configured_argv(runtime: RuntimeConfig) -> dict[str, tuple[str, ...]]:
    return {i.name: tuple(i.argv) for i in runtime.started_instances}


def _runtime_status(
    runtime: Runtime, configured: dict[str, tuple[str, ...]]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Each listed server as the runtime sees it, and its recommendations (a blocking read)."""
    targets = []
    for instance in runtime.instances():
        state = runtime.status(instance.name)
        targets.append(
            {
                "name": instance.name,
                "role": instance.role,
                "url": mask_url(instance.url),
                "kvpool_url": instance.kvpool_url and mask_url(instance.kvpool_url),
                "pids": sorted(instance.pids),
                "main_pid": instance.main_pid,
                "state": state.state,
                "since_wall_s": state.since_wall_s,
                "live_flags": mask_argv(instance.argv or ()),
                "live_flags_source": (
                    "promoted by the tuner"
                    if instance.name in configured
                    and tuple(instance.argv or ()) != configured[instance.name]
                    else "configuration"
                ),
            }
        )
    return targets, _recommendations(runtime)


def _recommendations(runtime: object) -> list[dict[str, Any]]:
    """The latest promotions written down instead of applied (recommend-only), newest first."""
    if not isinstance(runtime, RecommendsFlags):
        return []
    return [
        {
            "deployment": r.deployment,
            "namespace": r.namespace,
            "path": None if r.path is None else str(r.path),
            "reason": mask_text(r.reason),
            "kubectl": mask_text(r.kubectl),
            "event": None if r.event is None else mask_text(r.event),
            "wall_s": r.wall_s,
        }
        for r in reversed(runtime.recommendations())
    ]


def _mode_json(live: LiveMode) -> dict[str, Any]:
    """The mode in force, where it comes from, and every layer set (highest first)."""
    now = live.current()
    layers = [
        {"source": s.source.value, "mode": s.mode.value, "detail": s.detail} for s in live.layers()
    ]
    return {"mode": now.mode.value, "source": now.source.value, "layers": layers}


def _problems(exc: ValidationError) -> list[str]:
    """What was wrong, briefly: a few lines, each cut short (a field name can be long)."""
    lines = [f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()]
    shown = [line if len(line) <= 200 else line[:199] + "…" for line in lines[:MAX_PROBLEMS]]
    if len(lines) > MAX_PROBLEMS:
        shown.append(f"... and {len(lines) - MAX_PROBLEMS} more")
    return shown


def api_routes(
    ports: ControlPorts,
    token: ControlToken | SecretStr | None,
    limits: BodyLimits = DEFAULT_LIMITS,
    *,
    window: WorkloadWindow | None = None,
    runtime_timeout_s: float = RUNTIME_READ_TIMEOUT_S,
) -> list[Route]:
    control = control_token(token)
    background: set[asyncio.Task[Any]] = set()

    def shown(value: Any) -> Any:
        """A failed source's message may name its URL, and these reads need no token: every
        text masked (the configuration's secrets, as reloaded, and whatever reads as one)."""
        return mask(_plain(value), secret_values(ports.config))

    def protected(handler: Handler) -> Handler:
        async def guarded(request: Request) -> JsonResponse:
            # Before anything else, the body included: an unauthenticated caller gets nothing
            # parsed. The body may be left unread, so the connection closes after the answer.
            verdict = control.check(request.headers.get("authorization", ""))
            if verdict == "disabled":
                return error_response(403, control.disabled_reason(), close=True)
            if verdict == "refused":
                log.warning(
                    "control API: refused %s %s (bad or missing token)",
                    request.method,
                    request.url.path,
                )
                return error_response(401, "missing or wrong bearer token", close=True)
            try:
                return await handler(request)
            except RequestRejected as exc:
                return error_response(exc.status_code, exc.message, close=exc.status_code == 413)
            except ValidationError as exc:
                return error_response(422, "invalid request", problems=_problems(exc))
            except ValueError as exc:
                return error_response(422, str(exc))

        return guarded

    def known_instances() -> set[str]:
        return {i.name for i in ports.runtime.instances()}

    def unknown(instance: str) -> JsonResponse:
        return error_response(404, f"unknown instance {instance[:128]!r}")

    async def status(_: Request) -> JsonResponse:
        # The runtime's reads may block (a process table, an API server): in a thread of
        # their own, so that a hung read stalls this answer alone, never the loop.
        try:
            targets, recommendations = await asyncio.wait_for(
                in_daemon_thread(
                    _runtime_status, ports.runtime, _configured_argv(ports.config.runtime)
                ),
                runtime_timeout_s,
            )
        except TimeoutError:
            return error_response(
                503, f"the runtime did not answer within {runtime_timeout_s:g} s; try again"
            )
        body = {
            "runtime": ports.runtime.kind,
            "targets": targets,
            "ticks_total": ports.status.ticks_total,
            "alerts": shown(ports.alerts.alerts()),
            "remediation": shown(ports.remediation.status()),
            "last_actions": shown(ports.status.last_actions(10)),
            "outbox_backlog": ports.status.outbox_backlog(),
            "recommendations": recommendations,
            "settings_from_deployment": shown(
                dict(ports.from_deployment()) if ports.from_deployment is not None else {}
            ),
        }
        return JsonResponse(body)

    async def alerts(_: Request) -> JsonResponse:
        return JsonResponse({"alerts": shown(ports.alerts.alerts())})

    async def workload(_: Request) -> JsonResponse:
        """The workload learned from the stable server beside the configured one."""
        shape = window.shape() if window else None
        seen = window.requests() if window else 0
        return JsonResponse(workload_json(ports.config.tuning, shape, seen))

    async def silence(request: Request) -> JsonResponse:
        body = SilenceRequest.model_validate(await read_json(request, limits))
        made = ports.alerts.silence(
            body.matchers,
            body.duration_s,
            comment=body.comment,
            requested_by=body.requested_by,
        )
        return JsonResponse({"silence": _plain(made)}, 201)

    async def remediations(request: Request) -> JsonResponse:
        """Remediations under way and the latest `?limit=` (default 20) recorded, newest first."""
        text = request.query_params.get("limit", str(DEFAULT_LISTED_REMEDIATIONS))
        # The length first: int() refuses (raises on) thousands of digits.
        if not (text.isdecimal() and len(text) <= 3 and 1 <= int(text) <= MAX_LISTED_REMEDIATIONS):
            return error_response(422, f"limit: a whole number from 1 to {MAX_LISTED_REMEDIATIONS}")
        return JsonResponse(
            {
                "active": shown(ports.remediation.status().active),
                "recent": shown(ports.status.last_actions(int(text))),
            }
        )

    async def trigger(request: Request) -> JsonResponse:
        body = TriggerRequest.model_validate(await read_json(request, limits))
        if body.instance not in known_instances():
            return unknown(body.instance)
        task = asyncio.get_running_loop().create_task(
            ports.remediation.trigger(
                body.instance, requested_by=body.requested_by, force=body.force, reason=body.reason
            )
        )
        background.add(task)
        task.add_done_callback(background.discard)
        return JsonResponse({"accepted": True, "instance": body.instance}, 202)

    async def veto(request: Request) -> JsonResponse:
        body = VetoRequest.model_validate(await read_json(request, limits))
        if body.instance is not None and body.instance not in known_instances():
            return unknown(body.instance)
        made = ports.remediation.veto(
            requested_by=body.requested_by,
            reason=body.reason,
            instance=body.instance,
            incident_id=body.incident_id,
            duration_s=body.duration_s,
        )
        return JsonResponse({"vetoed": body.instance or body.incident_id, "veto": shown(made)}, 201)

    async def vetoes(_: Request) -> JsonResponse:
        return JsonResponse({"vetoes": shown(ports.remediation.status().vetoes)})

    async def lift_veto(request: Request) -> JsonResponse:
        kind, target = request.path_params["kind"], request.path_params["target"]
        if kind not in ("instance", "incident") or len(target) > 128:
            return error_response(
                404, "no such veto: DELETE /api/v1/vetoes/{instance|incident}/NAME"
            )
        lifted = ports.remediation.lift_veto(
            requested_by="api",
            reason="lifted through the API",
            instance=target if kind == "instance" else None,
            incident_id=target if kind == "incident" else None,
        )
        if not lifted:
            return error_response(404, f"no veto of {kind} {target!r} in force")
        return JsonResponse({"lifted": target, "kind": kind})

    async def silences(_: Request) -> JsonResponse:
        return JsonResponse({"silences": shown(ports.alerts.silences())})

    async def expire_silence(request: Request) -> JsonResponse:
        silence_id = request.path_params["silence_id"]
        if len(silence_id) > 64 or not ports.alerts.expire_silence(silence_id, requested_by="api"):
            return error_response(404, f"no silence {silence_id[:64]!r} in force")
        return JsonResponse({"expired": silence_id})

    async def mode(_: Request) -> JsonResponse:
        return JsonResponse(_mode_json(ports.remediation.mode))

    async def set_mode(request: Request) -> JsonResponse:
        body = ModeRequest.model_validate(await read_json(request, limits))
        chosen = None if body.mode is None else Mode(body.mode)
        ports.remediation.mode.set(ModeSource.API, chosen, f"by {body.requested_by}")
        return JsonResponse(_mode_json(ports.remediation.mode))

    async def reset_breaker(request: Request) -> JsonResponse:
        instance = request.path_params["instance"]
        # An instance gone from the runtime may still hold an open breaker (and its page).
        breakers = {b.instance for b in ports.remediation.status().breakers}
        if instance not in known_instances() | breakers:
            return unknown(instance)
        changed = ports.remediation.reset_breaker(
            instance, requested_by="api", reason="reset through the API"
        )
        return JsonResponse({"instance": instance, "was_open": changed})

    async def held(_: Request) -> JsonResponse:
        """The trials held for review, oldest first."""
        listed = [] if ports.held is None else ports.held.held()
        return JsonResponse({"held": shown(listed)})

    async def release(request: Request) -> JsonResponse:
        """Promote or roll back a held trial: validated and checked here (404 unknown, 409 not
        held or busy; a repeat answers 200 as it stands), then released in the background."""
        trial_id = request.path_params["trial_id"]
        body = ReleaseRequest.model_validate(await read_json(request, limits))
        if len(trial_id) > MAX_TRIAL_ID:
            return error_response(404, f"no trial {trial_id[:MAX_TRIAL_ID]!r}…")
        if ports.held is None:
            return error_response(404, NOTHING_HELD)
        try:
            repeat = ports.held.check(trial_id, Release(body.action))
        except ReleaseRefused as exc:
            return error_response(exc.status, str(exc))
        if repeat is not None:
            return JsonResponse({"release": shown(repeat)})
        task = asyncio.get_running_loop().create_task(
            _released(ports.held, trial_id, body), name=f"release-{trial_id}"
        )
        background.add(task)
        task.add_done_callback(background.discard)
        return JsonResponse({"accepted": True, "trial_id": trial_id, "action": body.action}, 202)

    return [
        Route("/api/v1/status", status),
        Route("/api/v1/alerts", alerts),
        Route("/api/v1/workload", workload),
        Route("/api/v1/silences", protected(silence), methods=["POST"]),
        Route("/api/v1/remediations", protected(trigger), methods=["POST"]),
        Route("/api/v1/remediations", remediations, methods=["GET"]),
        Route("/api/v1/silences", silences, methods=["GET"]),
        Route("/api/v1/silences/{silence_id}", protected(expire_silence), methods=["DELETE"]),
        Route("/api/v1/vetoes", protected(veto), methods=["POST"]),
        Route("/api/v1/vetoes", vetoes, methods=["GET"]),
        Route("/api/v1/vetoes/{kind}/{target}", protected(lift_veto), methods=["DELETE"]),
        Route("/api/v1/mode", mode, methods=["GET"]),
        Route("/api/v1/mode", protected(set_mode), methods=["POST"]),
        Route("/api/v1/breakers/{instance}/reset", protected(reset_breaker), methods=["POST"]),
        Route("/api/v1/tuning/held", held, methods=["GET"]),
        Route("/api/v1/tuning/held/{trial_id}", protected(release), methods=["POST"]),
    ]


async def _released(held: HeldCanaries, trial_id: str, body: ReleaseRequest) -> None:
    """A release in the background: its outcome is audited; a failure is logged too."""
    try:
        done = await held.release(
            trial_id, Release(body.action), by=body.requested_by, reason=body.reason
        )
    except Exception:
        log.exception("releasing held trial %s (%s) failed", trial_id, body.action)
        return
    log.info("held trial %s released: %s (%s)", trial_id, done.phase.value, done.reason)
