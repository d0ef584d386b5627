"""`kvpilot dashboards build|push` and `kvpilot rules`: the agent's settings passed down."""

from __future__ import annotations

import enum
import sys
from pathlib import Path
from typing import Annotated

import typer

from kvpilot.agent.rules.config import RulesConfig
from kvpilot.dashboards.rule_context import RUNBOOK_URL_BASE, SCRAPE_INTERVAL_S

RulesConfigFile = Annotated[
    Path | None,
    typer.Option(
        "--config",
        envvar="KVPILOT_CONFIG",
        help="The agent's YAML; its `rules:` section sets thresholds and durations "
        "(default: the product's defaults).",
    ),
]


class RulesFormat(enum.StrEnum):
    RULES = "rules"
    PROMETHEUS_RULE = "prometheusrule"


def label_pairs(given: list[str]) -> dict[str, str]:
    """`KEY=VALUE` options as labels; anything else is refused with its reason."""
    pairs: dict[str, str] = {}
    for each in given:
        key, sep, value = each.partition("=")
        if not sep or not key.strip():
            raise typer.BadParameter(f"{each!r}: expected KEY=VALUE", param_hint="--label")
        pairs[key.strip()] = value
    return pairs


def rules_config(config_file: Path | None) -> RulesConfig:
    """The `rules:` section of the agent's configuration (with its overrides), or the defaults."""
    if config_file is None:
        return RulesConfig()
    from kvpilot.agent.cli.config_load import load_or_exit

    config, _ = load_or_exit(config_file, warn=False)
    return config.rules


def runbooks() -> dict[str, str]:
    """Each alert's runbook text, as the agent's own rules carry it."""
    from kvpilot.agent.rules import (
        deferred,
        fragmentation,
        gpu_memory,
        occupancy,
        preemption,
        saturation,
        stall,
    )

    return {
        fragmentation.ALERTNAME: " ".join(fragmentation.RUNBOOKS.values()),
        # Each source's own text for its rule (`alertname/source`).
        **{f"{fragmentation.ALERTNAME}/{s}": text for s, text in fragmentation.RUNBOOKS.items()},
        preemption.ALERTNAME: preemption.RUNBOOK,
        saturation.ALERTNAME: saturation.RUNBOOK,
        stall.ALERTNAME: stall.RUNBOOK,
        occupancy.ALERTNAME: occupancy.RUNBOOK,
        deferred.ALERTNAME: deferred.RUNBOOK,
        gpu_memory.GROWTH_ALERTNAME: gpu_memory.GROWTH_RUNBOOK,
    }


def register(app: typer.Typer) -> None:
    """Add `dashboards build`, `dashboards push` and `rules` to the `kvpilot` command."""
    dashboards_app = typer.Typer(help="Grafana dashboards: build the JSON, push to Grafana.")
    app.add_typer(dashboards_app, name="dashboards")

    @dashboards_app.command("build")
    def build(
        root: Annotated[
            Path, typer.Option(help="Repository root the generated files are written under.")
        ] = Path(),
        check: Annotated[
            bool, typer.Option("--check", help="Write nothing; exit 1 when a file is stale.")
        ] = False,
        config_file: RulesConfigFile = None,
    ) -> None:
        """Write the dashboards' JSON, the rules file and the deploy base's generated manifests."""
        from kvpilot.dashboards.build import generated_files, stale, write
        from kvpilot.dashboards.rules import build_rules

        config = rules_config(config_file)
        files = generated_files(
            build_rules(config, runbooks=runbooks()),
            fragmentation_threshold_ratio=config.fragmentation.kv_blocks.threshold_ratio,
        )
        if check:
            out_of_date = stale(root, files)
            for path in out_of_date:
                typer.echo(f"stale: {path}")
            raise typer.Exit(1 if out_of_date else 0)
        changed = write(root, files)
        for generated in files:
            state = "written" if generated.path in changed else "unchanged"
            typer.echo(f"{generated.path}: {state}")

    @dashboards_app.command("push")
    def push(
        grafana_url: Annotated[
            str, typer.Option(envvar="KVPILOT_GRAFANA_URL", help="Grafana's base URL.")
        ],
        token: Annotated[
            str,
            typer.Option(
                envvar="KVPILOT_GRAFANA_TOKEN",
                help="A Grafana service-account token (Editor role).",
                show_default=False,
            ),
        ],
        timeout: Annotated[float, typer.Option(help="Per-request timeout, seconds.")] = 10.0,
        config_file: RulesConfigFile = None,
    ) -> None:
        """Create the kvpilot folder and upload the dashboards that changed."""
        from kvpilot.dashboards.build import build_dashboards
        from kvpilot.dashboards.push import PushError
        from kvpilot.dashboards.push import push as push_dashboards

        config = rules_config(config_file)
        dashboards = build_dashboards(
            fragmentation_threshold_ratio=config.fragmentation.kv_blocks.threshold_ratio
        )
        try:
            result = push_dashboards(grafana_url, token, dashboards, timeout_s=timeout)
        except PushError as exc:
            typer.echo(f"kvpilot: {exc}", err=True)
            raise typer.Exit(exc.exit_code) from None
        for line in result.lines():
            typer.echo(line)

    @app.command("rules")
    def rules(
        out: Annotated[
            Path | None, typer.Option("--out", "-o", help="Write here (default: standard output).")
        ] = None,
        output_format: Annotated[
            RulesFormat,
            typer.Option(
                "--format", help="A plain Prometheus rules file or a PrometheusRule manifest."
            ),
        ] = RulesFormat.RULES,
        namespace: Annotated[
            str | None, typer.Option(help="The PrometheusRule's namespace.")
        ] = None,
        evaluation_interval: Annotated[
            float | None,
            typer.Option(help="Seconds between evaluations (default: Prometheus's global)."),
        ] = None,
        scrape_interval: Annotated[
            float,
            typer.Option(
                min=1,
                help="Seconds between scrapes of vLLM and kvpilot: every window holds at least "
                "four scrapes, every `for` two (default: the shipped ServiceMonitor's).",
            ),
        ] = SCRAPE_INTERVAL_S,
        runbook_url_base: Annotated[
            str,
            typer.Option(
                help="Where docs/runbooks/ is served; each alert's runbook_url is "
                "this followed by <alert>.md."
            ),
        ] = RUNBOOK_URL_BASE,
        label: Annotated[
            list[str] | None,
            typer.Option(
                help="KEY=VALUE, repeatable: a label of the PrometheusRule "
                "(kube-prometheus-stack selects `release=<its release>`)."
            ),
        ] = None,
        job: Annotated[
            str,
            typer.Option(
                help="The scrape job of kvpilot's targets, as your ServiceMonitor or PodMonitor "
                "names it (the self-watch rules select it)."
            ),
        ] = "kvpilot",
        config_file: RulesConfigFile = None,
    ) -> None:
        """Prometheus rules equivalent to kvpilot's own, and rules that watch kvpilot itself."""
        from kvpilot.dashboards.rules import build_rules
        from kvpilot.dashboards.self_watch import SelfWatch

        labels = label_pairs(label or [])
        groups = build_rules(
            rules_config(config_file),
            runbooks=runbooks(),
            self_watch=SelfWatch(job=job),
            evaluation_interval_s=evaluation_interval,
            scrape_interval_s=scrape_interval,
            runbook_url_base=runbook_url_base,
        )
        text = (
            groups.rules_file()
            if output_format is RulesFormat.RULES
            else groups.prometheus_rule(namespace=namespace, labels=labels)
        )
        if out is None:
            sys.stdout.write(text)
        else:
            out.write_text(text, encoding="utf-8")
            typer.echo(f"wrote {out}", err=True)
