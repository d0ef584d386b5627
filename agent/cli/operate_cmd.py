"""The operator's commands against a running agent's control API: `status`, `alerts`,
`silence`, `veto`, `breaker`, `remediations` and `tuning` (held canaries). Tables for
people, `--json` for scripts.

The agent's address is `--url` (default the agent's own default listener); in Kubernetes,
forward the sidecar's port first: `kubectl port-forward -n NS pod/POD 8474`. Control
commands send the bearer token from `--token-file` or `KVPILOT_API_TOKEN`.
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Annotated, Any, NoReturn
from urllib.parse import quote

import typer
from rich.console import Console
from rich.table import Table

from kvpilot.agent.cli.agent_client import (
    DEFAULT_AGENT_URL,
    DEFAULT_TIMEOUT_S,
    TOKEN_ENV,
    AgentAddress,
    AgentClient,
    AgentError,
    read_token,
)

FAILED_EXIT = 1
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd]?)$")
_UNIT_S = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}

Url = Annotated[
    str,
    typer.Option(
        "--url",
        envvar="KVPILOT_URL",
        help="The agent's address (its api.listen, else its listen). In Kubernetes: "
        "`kubectl port-forward -n NS pod/POD 8474`, then the default.",
    ),
]
TokenFile = Annotated[
    Path | None,
    typer.Option(
        "--token-file",
        envvar="KVPILOT_API_TOKEN_FILE",
        help=f"A file holding the control token (api.token); else ${TOKEN_ENV}.",
    ),
]
AsJson = Annotated[bool, typer.Option("--json", help="JSON instead of tables.")]
Timeout = Annotated[float, typer.Option("--timeout", min=0.1, help="Seconds to wait.")]
InstanceOption = Annotated[
    str | None, typer.Option("--instance", help="The server's name (the `instance` label).")
]
Incident = Annotated[str | None, typer.Option("--incident", help="An incident's id.")]


def parse_duration_s(text: str) -> float:
    """`90`, `90s`, `15m`, `2h`, `1d` as seconds; ValueError otherwise."""
    found = _DURATION.match(text.strip())
    if found is None or float(found.group(1)) <= 0:
        raise ValueError(f"{text!r} is not a duration like 30m, 2h or 1d")
    return float(found.group(1)) * _UNIT_S[found.group(2)]


def parse_matchers(pairs: Iterable[str]) -> dict[str, str]:
    """`NAME=VALUE` pairs as a label set; ValueError naming the first that is not one."""
    matchers: dict[str, str] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise ValueError(f"{pair!r} is not NAME=VALUE")
        matchers[name.strip()] = value.strip()
    return matchers


def _fail(message: str) -> NoReturn:
    print(f"kvpilot: {message}", file=sys.stderr)
    raise typer.Exit(FAILED_EXIT)


def _call(
    url: str,
    token_file: Path | None,
    timeout: float,
    request: Callable[[AgentClient], Any],
) -> Any:
    try:
        address = AgentAddress(url, read_token(token_file), timeout)
        with AgentClient(address) as client:
            return request(client)
    except AgentError as exc:
        _fail(str(exc))


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, sort_keys=True))


def _when(wall_s: object) -> str:
    if not isinstance(wall_s, int | float):
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(wall_s))


def _labels(labels: object) -> str:
    if not isinstance(labels, dict):
        return "-"
    return ", ".join(f"{k}={v}" for k, v in sorted(labels.items()))


def _cell(value: object) -> str:
    return "-" if value is None or value == "" else str(value)


def _table(title: str, columns: list[str], rows: Iterable[Iterable[object]]) -> Table:
    table = Table(title=title, title_justify="left")
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*(_cell(v) for v in row))
    return table


def alerts_table(alerts: list[dict[str, Any]]) -> Table:
    return _table(
        "alerts",
        ["rule", "state", "value", "since", "labels", "reason"],
        (
            (
                a.get("rule"),
                a.get("state"),
                a.get("value"),
                _when(a.get("active_since_wall_s")),
                _labels(a.get("labels")),
                a.get("reason"),
            )
            for a in alerts
        ),
    )


def actions_table(title: str, actions: list[dict[str, Any]]) -> Table:
    return _table(
        title,
        ["id", "instance", "action", "state", "started", "reason"],
        (
            (
                r.get("id"),
                r.get("instance"),
                r.get("action"),
                r.get("state"),
                _when(r.get("started_wall_s")),
                r.get("reason"),
            )
            for r in actions
        ),
    )


def show_status(body: dict[str, Any], console: Console) -> None:
    targets = body.get("targets", [])
    console.print(f"runtime: {body.get('runtime')}   ticks: {body.get('ticks_total')}")
    console.print(
        _table(
            "servers",
            ["name", "role", "state", "since", "main pid", "flags from"],
            (
                (
                    t.get("name"),
                    t.get("role"),
                    t.get("state"),
                    _when(t.get("since_wall_s")),
                    t.get("main_pid"),
                    t.get("live_flags_source"),
                )
                for t in targets
            ),
        )
    )
    for target in targets:
        console.print(f"{target.get('name')} flags: {' '.join(target.get('live_flags') or [])}")
    remediation = body.get("remediation") or {}
    mode = "dry run (records, never acts)" if remediation.get("dry_run") else "acting"
    console.print(f"remediation: {mode}")
    breakers = remediation.get("breakers") or []
    console.print(
        _table(
            "circuit breakers",
            ["instance", "state", "failures"],
            ((b.get("instance"), b.get("state"), b.get("failures")) for b in breakers),
        )
    )
    vetoed = [*(remediation.get("vetoed_instances") or ())]
    vetoed += [f"incident {i}" for i in remediation.get("vetoed_incidents") or ()]
    console.print(f"vetoed: {', '.join(vetoed) if vetoed else 'nothing'}")
    console.print(alerts_table(body.get("alerts") or []))
    console.print(actions_table("last actions", body.get("last_actions") or []))
    console.print(f"notifications waiting in the outbox: {body.get('outbox_backlog')}")
    for rec in body.get("recommendations") or []:
        console.print(f"recommended for {rec.get('deployment')}: {rec.get('kubectl')}")


def register(app: typer.Typer) -> None:
    """The operator's commands, on the top-level app."""

    @app.command("status")
    def status(
        url: Url = DEFAULT_AGENT_URL,
        as_json: AsJson = False,
        timeout: Timeout = DEFAULT_TIMEOUT_S,
    ) -> None:
        """A running agent's servers, alerts, breakers, vetoes and last actions."""
        body = _call(url, None, timeout, lambda c: c.get("/api/v1/status", "the status API"))
        if as_json:
            _print_json(body)
        else:
            show_status(body, Console())

    @app.command("alerts")
    def alerts(
        url: Url = DEFAULT_AGENT_URL,
        as_json: AsJson = False,
        timeout: Timeout = DEFAULT_TIMEOUT_S,
    ) -> None:
        """Every alert a running agent tracks, with its state."""
        body = _call(url, None, timeout, lambda c: c.get("/api/v1/alerts", "listing alerts"))
        if as_json:
            _print_json(body)
        else:
            Console().print(alerts_table(body.get("alerts") or []))

    _register_silence(app)
    _register_veto(app)
    _register_breaker(app)
    _register_remediations(app)
    _register_tuning(app)


def _register_silence(app: typer.Typer) -> None:
    silence_app = typer.Typer(
        help="Silence an alert's notifications; list and expire silences.", no_args_is_help=True
    )
    app.add_typer(silence_app, name="silence")

    @silence_app.command("add")
    def add(
        match: Annotated[
            list[str],
            typer.Option("--match", help="NAME=VALUE an alert's labels must carry (repeat)."),
        ],
        duration: Annotated[str, typer.Option("--duration", help="e.g. 30m, 2h, 1d.")] = "1h",
        comment: Annotated[str, typer.Option("--comment", help="Why.")] = "",
        url: Url = DEFAULT_AGENT_URL,
        token_file: TokenFile = None,
        as_json: AsJson = False,
        timeout: Timeout = DEFAULT_TIMEOUT_S,
    ) -> None:
        """Silence notifications of alerts whose labels include every --match."""
        try:
            body = {
                "matchers": parse_matchers(match),
                "duration_s": parse_duration_s(duration),
                "comment": comment,
                "requested_by": "cli",
            }
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
        made = _call(
            url, token_file, timeout, lambda c: c.post("/api/v1/silences", "silences", body)
        )
        silence = made.get("silence", made)
        if as_json:
            _print_json(made)
        else:
            print(f"silence {silence.get('silence_id')} until {_when(silence.get('until_wall_s'))}")

    @silence_app.command("list")
    def list_(
        url: Url = DEFAULT_AGENT_URL,
        token_file: TokenFile = None,
        as_json: AsJson = False,
        timeout: Timeout = DEFAULT_TIMEOUT_S,
    ) -> None:
        """The silences in force."""
        body = _call(
            url, token_file, timeout, lambda c: c.get("/api/v1/silences", "listing silences")
        )
        if as_json:
            _print_json(body)
            return
        rows = body.get("silences", []) if isinstance(body, dict) else body
        Console().print(
            _table(
                "silences",
                ["id", "matchers", "until", "comment"],
                (
                    (
                        s.get("silence_id"),
                        _labels(s.get("matchers")),
                        _when(s.get("until_wall_s")),
                        s.get("comment"),
                    )
                    for s in rows
                ),
            )
        )

    @silence_app.command("expire")
    def expire(
        silence_id: Annotated[str, typer.Argument(help="The silence's id (`silence list`).")],
        url: Url = DEFAULT_AGENT_URL,
        token_file: TokenFile = None,
        as_json: AsJson = False,
        timeout: Timeout = DEFAULT_TIMEOUT_S,
    ) -> None:
        """End a silence now."""
        path = f"/api/v1/silences/{quote(silence_id, safe='')}"
        body = _call(url, token_file, timeout, lambda c: c.delete(path, "expiring silences"))
        if as_json:
            _print_json(body)
        else:
            print(f"silence {silence_id} expired")


def _target(instance: str | None, incident: str | None) -> dict[str, str]:
    if (instance is None) == (incident is None):
        raise typer.BadParameter("give exactly one of --instance or --incident")
    return {"instance": instance} if instance is not None else {"incident_id": str(incident)}


def _register_veto(app: typer.Typer) -> None:
    veto_app = typer.Typer(
        help="Stop remediation of a server or an incident; lift a veto.", no_args_is_help=True
    )
    app.add_typer(veto_app, name="veto")

    @veto_app.command("add")
    def add(
        reason: Annotated[str, typer.Option("--reason", help="Why (kept in the audit).")],
        instance: InstanceOption = None,
        incident: Incident = None,
        duration: Annotated[
            str | None,
            typer.Option("--duration", help="e.g. 2h (agents that support it); else until lifted."),
        ] = None,
        url: Url = DEFAULT_AGENT_URL,
        token_file: TokenFile = None,
        as_json: AsJson = False,
        timeout: Timeout = DEFAULT_TIMEOUT_S,
    ) -> None:
        """No remediation for one server (--instance) or one incident (--incident)."""
        body: dict[str, Any] = {**_target(instance, incident), "reason": reason}
        body["requested_by"] = "cli"
        if duration is not None:
            try:
                body["duration_s"] = parse_duration_s(duration)
            except ValueError as exc:
                raise typer.BadParameter(str(exc), param_hint="--duration") from None
        made = _call(url, token_file, timeout, lambda c: c.post("/api/v1/vetoes", "vetoes", body))
        if as_json:
            _print_json(made)
        else:
            print(f"vetoed: {instance or incident}")

    @veto_app.command("lift")
    def lift(
        instance: InstanceOption = None,
        incident: Incident = None,
        url: Url = DEFAULT_AGENT_URL,
        token_file: TokenFile = None,
        as_json: AsJson = False,
        timeout: Timeout = DEFAULT_TIMEOUT_S,
    ) -> None:
        """Lift a veto: remediation may act on the server or incident again."""
        _target(instance, incident)  # exactly one
        kind, name = ("instance", instance) if instance is not None else ("incident", incident)
        path = f"/api/v1/vetoes/{kind}/{quote(str(name), safe='')}"
        made = _call(url, token_file, timeout, lambda c: c.delete(path, "lifting vetoes"))
        if as_json:
            _print_json(made)
        else:
            print(f"veto lifted: {instance or incident}")


def _register_breaker(app: typer.Typer) -> None:
    breaker_app = typer.Typer(help="Remediation's circuit breakers.", no_args_is_help=True)
    app.add_typer(breaker_app, name="breaker")

    @breaker_app.command("reset")
    def reset(
        instance: Annotated[str, typer.Argument(help="The server whose breaker to close.")],
        url: Url = DEFAULT_AGENT_URL,
        token_file: TokenFile = None,
        as_json: AsJson = False,
        timeout: Timeout = DEFAULT_TIMEOUT_S,
    ) -> None:
        """Close a server's circuit breaker: remediation may restart it again."""
        path = f"/api/v1/breakers/{quote(instance, safe='')}/reset"
        body = _call(url, token_file, timeout, lambda c: c.post(path, "breaker resets"))
        if as_json:
            _print_json(body)
        elif body.get("was_open"):
            print(f"{instance}: breaker closed")
        else:
            print(f"{instance}: the breaker was not open")


def _register_remediations(app: typer.Typer) -> None:
    remediations_app = typer.Typer(
        help="Remediations: the active and the recent; queue a restart.", no_args_is_help=True
    )
    app.add_typer(remediations_app, name="remediations")

    @remediations_app.command("list")
    def list_(
        limit: Annotated[int, typer.Option("--limit", min=1, max=500)] = 20,
        url: Url = DEFAULT_AGENT_URL,
        as_json: AsJson = False,
        timeout: Timeout = DEFAULT_TIMEOUT_S,
    ) -> None:
        """Remediations under way and the most recent ones, newest first."""
        body = _call(
            url,
            None,
            timeout,
            lambda c: c.get(
                "/api/v1/remediations", "listing remediations", params={"limit": str(limit)}
            ),
        )
        if as_json:
            _print_json(body)
            return
        console = Console()
        active = body.get("active") or []
        console.print(
            _table(
                "under way",
                ["id", "instance", "action", "state", "since"],
                (
                    (
                        a.get("remediation_id"),
                        a.get("instance"),
                        a.get("action"),
                        a.get("state"),
                        _when(a.get("since_wall_s")),
                    )
                    for a in active
                ),
            )
        )
        console.print(actions_table("recent", body.get("recent") or []))

    @remediations_app.command("queue")
    def queue(
        instance: Annotated[str, typer.Argument(help="The server to restart.")],
        reason: Annotated[str, typer.Option("--reason", help="Why (kept in the audit).")] = "",
        force: Annotated[
            bool, typer.Option("--force", help="Past the guards (budget, cooldown, breaker).")
        ] = False,
        url: Url = DEFAULT_AGENT_URL,
        token_file: TokenFile = None,
        as_json: AsJson = False,
        timeout: Timeout = DEFAULT_TIMEOUT_S,
    ) -> None:
        """Queue a restart of a server now (under the guards unless --force)."""
        body = {"instance": instance, "force": force, "reason": reason, "requested_by": "cli"}
        made = _call(
            url,
            token_file,
            timeout,
            lambda c: c.post("/api/v1/remediations", "queueing remediations", body),
        )
        if as_json:
            _print_json(made)
        else:
            print(f"queued: restart of {instance} (`kvpilot remediations list` follows it)")


def _register_tuning(app: typer.Typer) -> None:
    tuning_app = typer.Typer(
        help="Canaries held for review (tuning.hold_inconclusive): list, promote, roll back.",
        no_args_is_help=True,
    )
    app.add_typer(tuning_app, name="tuning")

    @tuning_app.command("held")
    def held(
        url: Url = DEFAULT_AGENT_URL,
        as_json: AsJson = False,
        timeout: Timeout = DEFAULT_TIMEOUT_S,
    ) -> None:
        """The trials whose canary is held for a person's review."""
        body = _call(url, None, timeout, lambda c: c.get("/api/v1/tuning/held", "held canaries"))
        if as_json:
            _print_json(body)
            return
        Console().print(
            _table(
                "held canaries",
                ["trial", "number", "values", "held since", "rolled back at", "reason"],
                (
                    (
                        h.get("trial_id"),
                        h.get("number"),
                        _labels(h.get("values")),
                        _when(h.get("held_since_wall_s")),
                        _when(h.get("rolled_back_at_wall_s")),
                        h.get("reason"),
                    )
                    for h in body.get("held") or []
                ),
            )
        )

    @tuning_app.command("release")
    def release(
        trial: Annotated[str, typer.Argument(help="The held trial's id (`tuning held`).")],
        reason: Annotated[str, typer.Option("--reason", help="Why (kept in the audit).")],
        promote: Annotated[
            bool, typer.Option("--promote", help="Promote it, as a judge's pass would.")
        ] = False,
        rollback: Annotated[bool, typer.Option("--rollback", help="Stop it.")] = False,
        url: Url = DEFAULT_AGENT_URL,
        token_file: TokenFile = None,
        as_json: AsJson = False,
        timeout: Timeout = DEFAULT_TIMEOUT_S,
    ) -> None:
        """Release a held canary: --promote (under the restart guards, then baked) or --rollback."""
        if promote == rollback:
            raise typer.BadParameter("give exactly one of --promote or --rollback")
        action = "promote" if promote else "rollback"
        body = {"action": action, "reason": reason, "requested_by": "cli"}
        path = f"/api/v1/tuning/held/{quote(trial, safe='')}"
        made = _call(
            url, token_file, timeout, lambda c: c.post(path, "releasing held canaries", body)
        )
        if as_json:
            _print_json(made)
        elif made.get("accepted"):
            print(
                f"trial {trial}: {action} accepted; `kvpilot tuning held` shows it gone once done"
            )
        else:
            done = made.get("release") or {}
            print(f"trial {trial}: already {done.get('phase')} ({done.get('reason')})")
