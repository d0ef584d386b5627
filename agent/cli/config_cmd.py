"""`kvpilot config check FILE` and `kvpilot config schema`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import BaseModel

from kvpilot.agent.cli.config_load import load_or_exit
from kvpilot.agent.config import (
    AgentConfig,
    NotifierConfig,
    SlackNotifierConfig,
    config_warnings,
)
from kvpilot.agent.config.extras import missing_extras, needed_extras
from kvpilot.agent.config.tuning import TuningConfig
from kvpilot.collectors.secrets import mask_url


def json_schema() -> dict[str, Any]:
    """The JSON schema of the configuration file, for editors (yaml-language-server)."""
    schema = AgentConfig.model_json_schema()
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema}


def enabled_rules(rules: BaseModel, prefix: str = "") -> list[str]:
    """`name (action)` of every enabled rule, nested groups as `group.name`."""
    found = []
    for name in type(rules).model_fields:
        value = getattr(rules, name)
        if not isinstance(value, BaseModel):
            continue
        if hasattr(value, "enabled"):
            if value.enabled:
                action = getattr(value, "action", None)
                found.append(f"{prefix}{name}" + (f" ({action})" if action else ""))
        else:
            found.extend(enabled_rules(value, f"{prefix}{name}."))
    return found


def _notifier_line(notifier: NotifierConfig) -> str:
    if isinstance(notifier, SlackNotifierConfig):
        target = mask_url(notifier.url.get_secret_value(), path_is_secret=True)
    else:
        target = mask_url(notifier.url)
    extras = []
    if getattr(notifier, "hmac_secret", None) is not None:
        extras.append("hmac signed")
    if getattr(notifier, "auth", None) is not None:
        extras.append("auth set")
    if headers := getattr(notifier, "headers", None):
        extras.append(f"headers: {', '.join(sorted(headers))} (values hidden)")
    extra = f" [{'; '.join(extras)}]" if extras else ""
    repeat = f"repeat every {notifier.repeat_interval_s:g} s"
    return f"  {notifier.name}: {notifier.kind} -> {target}, {repeat}{extra}"


def summary(config: AgentConfig) -> list[str]:
    """A short human summary of a valid configuration, secrets masked."""
    lines = [f"listen: {config.listen.host}:{config.listen.port}, every {config.interval_s:g} s"]
    runtime = config.runtime
    lines.extend(runtime.summary_lines())
    lines.append(f"api key for vLLM: {'set' if runtime.api_key else 'none'}")
    rules = enabled_rules(config.rules)
    lines.append(f"rules enabled ({len(rules)}): {', '.join(rules) or 'none'}")
    lines.append(f"notifiers ({len(config.notifiers)}):")
    lines.extend(_notifier_line(n) for n in config.notifiers)
    r = config.remediation
    lines.append(
        f"remediation: {'dry run' if r.dry_run else 'live'}, cooldown {r.cooldown_s:g} s, "
        f"budget {r.budget.max_restarts} per {r.budget.window_s:g} s"
    )
    lines.append(_tuning_line(config.tuning))
    has_token = config.api.token is not None or config.api.token_file is not None
    lines.append(f"control API token: {'set' if has_token else 'none (POST endpoints refused)'}")
    lines.append(f"state: {config.state_dir}")
    return lines


def _tuning_line(t: TuningConfig) -> str:
    when = f"schedule '{t.schedule}' (UTC)" if t.schedule else "on demand (kvpilot tune)"
    c = t.canary
    if c.traffic == "replay":
        how = f"canaries on a synthetic replay ({t.strategy})"
    else:
        split = (
            f"HTTPRoute {c.gateway.httproute} weight {c.weight_percent:g} %"
            if c.gateway is not None
            else "a share of the Service's endpoints"
        )
        how = (
            f"canaries on live traffic through {split}: warm-up {c.warmup_s:g} s, analysis "
            f"{c.analysis_s:g} s every {c.analysis_interval_s:g} s, bake {c.bake_s:g} s"
        )
    return f"tuning: {when}, {t.trials} trials a run, {how}"


def register(app: typer.Typer) -> None:
    config_app = typer.Typer(
        help="Check kvpilot's configuration, print its JSON schema.", no_args_is_help=True
    )
    app.add_typer(config_app, name="config")

    @config_app.command("check")
    def check(
        file: Annotated[Path, typer.Argument(help="The YAML configuration file.")],
        no_env: Annotated[
            bool, typer.Option("--no-env", help="Ignore KVPILOT_* environment overrides.")
        ] = False,
    ) -> None:
        """Validate FILE (plus KVPILOT_* overrides) and summarise it; exit 2 on errors."""
        config, _ = load_or_exit(file, use_env=not no_env, warn=False, read_token=True)
        print(f"OK: {file}")
        for line in summary(config):
            print(line)
        for note in config_warnings(config):
            print(f"warning: {note}")
        missing = missing_extras(needed_extras(config))
        if missing is not None:  # this machine's install, not the file: `run` refuses it
            print(f"warning: {missing}")

    @config_app.command("schema")
    def schema() -> None:
        """Print the configuration's JSON schema (docs/kvpilot.schema.json)."""
        print(json.dumps(json_schema(), indent=2))
