"""The `kvpilot` command."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

from kvpilot.agent.app.logs import configure_logging
from kvpilot.agent.cli import config_cmd as config_cli
from kvpilot.agent.cli import dashboards_cmd as dashboards_cli
from kvpilot.agent.cli import operate_cmd as operate_cli
from kvpilot.agent.cli import plan_cmd as plan_cli
from kvpilot.agent.cli import state_cmd as state_cli
from kvpilot.agent.cli import tune_cmd as tune_cli
from kvpilot.agent.cli import workload_cmd as workload_cli
from kvpilot.agent.cli.config_load import INVALID_CONFIG_EXIT
from kvpilot.agent.config.agent import DEFAULT_PORT, parse_host_port
from kvpilot.agent.readings.snapshot import read_nvml
from kvpilot.agent.tick.wiring import CollectSettings, build_ticker
from kvpilot.collectors.limits import (
    DEFAULT_BODY_SIZE_LIMIT_BYTES,
    DEFAULT_SAMPLE_LIMIT,
    DEFAULT_TIMEOUT_S,
    ScrapeLimits,
)
from kvpilot.collectors.nvml import NvmlCollector
from kvpilot.collectors.scrape_client import ScrapeClient

if TYPE_CHECKING:
    from kvpilot.agent.app.lifecycle import ListenError
    from kvpilot.agent.config import AgentConfig, ListenConfig

app = typer.Typer(
    help="Memory observability and auto-tuning for vLLM.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
rig_app = typer.Typer(help="The test rig: a real CPU vLLM and a load generator.")
app.add_typer(rig_app, name="rig")
plan_cli.register(app)
config_cli.register(app)
dashboards_cli.register(app)
tune_cli.register(app)
state_cli.register(app)
workload_cli.register(app)
operate_cli.register(app)


def _print_version(asked: bool) -> None:
    if asked:
        from importlib.metadata import version

        print(f"kvpilot {version('kvpilot')}")
        raise typer.Exit()


@app.callback()
def _options(
    show_version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_print_version, is_eager=True, help="Print the version, exit."
        ),
    ] = False,
) -> None:
    """Memory observability and auto-tuning for vLLM."""


VllmUrl = Annotated[
    str, typer.Option("--vllm-url", envvar="KVPILOT_VLLM_URL", help="vLLM server's base URL.")
]
KvpoolUrl = Annotated[
    str | None,
    typer.Option(
        "--kvpool-url",
        envvar="KVPILOT_KVPOOL_URL",
        help="The kvpool plugin's base URL (the server's KVPILOT_KVPOOL_PORT).",
    ),
]
ModelConfig = Annotated[
    Path | None,
    typer.Option(
        "--model-config",
        help="The served model's config.json: compare the planner's KV prediction with "
        "what the server reports.",
    ),
]
ApiKey = Annotated[
    str | None,
    typer.Option("--api-key", envvar="KVPILOT_VLLM_API_KEY", help="vLLM's --api-key, if set."),
]


def _pids_option(pids: list[int] | None) -> frozenset[int]:
    return frozenset(pids or ())


@app.command()
def collect(
    vllm_url: VllmUrl = "http://127.0.0.1:8000",
    kvpool_url: KvpoolUrl = None,
    api_key: ApiKey = None,
    once: Annotated[bool, typer.Option("--once", help="One snapshot, then exit.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="JSON instead of tables.")] = False,
    span: Annotated[
        float | None,
        typer.Option(
            "--span",
            min=0.1,
            help="Scrape twice, SECONDS apart: quantiles and rates over that span "
            "(without it, quantiles are since the server started).",
        ),
    ] = None,
    interval: Annotated[float, typer.Option(help="Seconds between ticks (live view).")] = 1.0,
    server_pid: Annotated[
        list[int] | None,
        typer.Option("--server-pid", help="PIDs of the vLLM server (tells them apart in NVML)."),
    ] = None,
    timeout: Annotated[
        float,
        typer.Option(
            min=0.001, help="Deadline for each source's whole response (headers and body), seconds."
        ),
    ] = DEFAULT_TIMEOUT_S,
    body_size_limit: Annotated[
        int,
        typer.Option(min=1, help="Largest body read from a source, bytes; past it: too_large."),
    ] = DEFAULT_BODY_SIZE_LIMIT_BYTES,
    sample_limit: Annotated[
        int,
        typer.Option(min=1, help="Most samples in one exposition; past it: too_many_samples."),
    ] = DEFAULT_SAMPLE_LIMIT,
    model_config: ModelConfig = None,
) -> None:
    """Read vLLM's /metrics, the kvpool plugin and NVML, and show what they say."""
    configure_logging(json_logs=False, level=logging.ERROR)  # the output says what failed
    settings = CollectSettings(
        vllm_url=vllm_url,
        kvpool_url=kvpool_url,
        api_key=api_key,
        limits=ScrapeLimits(
            timeout_s=timeout, body_size_limit_bytes=body_size_limit, sample_limit=sample_limit
        ),
        # The second scrape lands a little after `span`: keep both in the window.
        rate_span_s=2 * span if span else 60.0,
        quantile_span_s=2 * span if span else 60.0,
        model_config=model_config,
    )
    pids = _pids_option(server_pid)
    if once:
        ok = asyncio.run(_collect_once(settings, pids, span=span, as_json=as_json))
        raise typer.Exit(0 if ok else 1)
    asyncio.run(_collect_live(settings, pids, interval))


async def _collect_once(
    settings: CollectSettings, pids: frozenset[int], *, span: float | None, as_json: bool
) -> bool:
    from kvpilot.agent.cli.snapshot_view import render, to_data
    from kvpilot.collectors.errors import SourceError

    nvml = NvmlCollector(server_pids=lambda: pids)
    async with ScrapeClient() as client:
        ticker = build_ticker(settings, client)
        snapshot = await ticker.tick(await read_nvml(nvml))
        if span is not None and not isinstance(snapshot.vllm, SourceError):
            await asyncio.sleep(span)  # the user asked for a span between two scrapes
            snapshot = await ticker.tick(await read_nvml(nvml))
    state = ticker.state
    if as_json:
        print(json.dumps(to_data(snapshot, state.figures, state.calibrations), indent=2))
    else:
        Console().print(render(snapshot, state.figures, state.calibrations))
    return not isinstance(snapshot.vllm, SourceError)


async def _collect_live(settings: CollectSettings, pids: frozenset[int], interval: float) -> None:
    from kvpilot.agent.cli.live_view import LiveView

    nvml = NvmlCollector(server_pids=lambda: pids)
    async with ScrapeClient() as client:
        ticker = build_ticker(settings, client)
        with LiveView(title=f"kvpilot: {settings.vllm_url}") as view:
            while True:
                await ticker.tick(await read_nvml(nvml))
                view.show(ticker.state)
                await asyncio.sleep(interval)


@app.command()
def run(
    config: Annotated[
        Path | None,
        typer.Option(
            "--config",
            envvar="KVPILOT_CONFIG",
            help="The sidecar's YAML configuration (runtime, rules, notifiers, remediation). "
            "Without it: collect and serve metrics for --vllm-url only.",
        ),
    ] = None,
    vllm_url: VllmUrl = "http://127.0.0.1:8000",
    kvpool_url: KvpoolUrl = None,
    api_key: ApiKey = None,
    listen: Annotated[
        str, typer.Option(help="HOST:PORT for /metrics and /healthz (without --config).")
    ] = f"127.0.0.1:{DEFAULT_PORT}",
    interval: Annotated[float, typer.Option(min=0.1, help="Seconds between ticks.")] = 1.0,
    server_pid: Annotated[
        list[int] | None,
        typer.Option("--server-pid", help="PIDs of the vLLM server (tells them apart in NVML)."),
    ] = None,
    model_config: ModelConfig = None,
) -> None:
    """The agent: collect, evaluate the rules and serve /metrics every tick. With --config,
    the YAML decides everything; without it, one server is watched by URL (the `attach`
    runtime: never signalled or restarted) with the product's default rules."""
    if config is not None:
        _run_sidecar(config)
        return
    try:
        listen_section = parse_host_port(listen)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--listen") from None
    server: dict[str, object] = {"name": "vllm", "url": vllm_url, "kvpool_url": kvpool_url}
    if server_pid:
        server["pids"] = list(server_pid)
    if model_config is not None:
        server["served_model_config"] = str(model_config)
    runtime: dict[str, object] = {"kind": "attach", "servers": [server]}
    if api_key:
        runtime["api_key"] = api_key
    data = {
        "listen": listen_section,
        "interval_s": interval,
        "runtime": runtime,
    }
    _run_sidecar(None, data)


def _run_sidecar(path: Path | None, data: dict[str, object] | None = None) -> None:
    """One path for both forms of `kvpilot run`. Without a file nothing is kept after the
    agent stops unless KVPILOT_STATE_DIR names a state directory. A listen address that is
    taken, or a server that exits before it was first ready, ends it with a plain message
    and exit code 1, never a traceback."""
    from kvpilot.agent.app.compose import run_sidecar
    from kvpilot.agent.app.lifecycle import ListenError
    from kvpilot.agent.cli.config_load import exit_missing_extras, load_or_exit, validate_or_exit
    from kvpilot.agent.config import secret_values
    from kvpilot.agent.config.extras import needed_extras
    from kvpilot.agent.runtimes.probe import StartFailed

    configure_logging(json_logs=True)
    with _scratch_state_dir(needed=path is None) as scratch:
        reload_config = None
        if path is not None:
            config, sha256 = load_or_exit(path, read_token=True)
            reload_config = _reloader(path, secret_values(config))
        else:
            config = validate_or_exit({"state_dir": scratch, **(data or {})})
            sha256 = None
        exit_missing_extras(needed_extras(config))
        configure_logging(json_logs=True, secrets=secret_values(config))
        try:
            asyncio.run(run_sidecar(config, config_sha256=sha256, reload_config=reload_config))
        except ListenError as exc:
            where = _listen_setting(exc, config.api.listen, path)
            print(f"kvpilot: {exc}; choose another with {where}", file=sys.stderr)
            raise typer.Exit(1) from None
        except StartFailed as exc:
            print(exc.explain(), file=sys.stderr)
            raise typer.Exit(1) from None


def _listen_setting(exc: ListenError, api: ListenConfig | None, path: Path | None) -> str:
    """The setting that holds the address that could not be bound: `api.listen` when the
    control API has a listener `api` of its own there, else `listen`."""
    if api is not None and (api.host, api.port) == (exc.host, exc.port):
        return f"api.listen in {path} (or KVPILOT_API__LISTEN=HOST:PORT)"
    if path is not None:
        return f"listen.host and listen.port in {path} (or KVPILOT_LISTEN__PORT)"
    return "--listen HOST:PORT"


@contextlib.contextmanager
def _scratch_state_dir(*, needed: bool) -> Iterator[str]:
    """A temporary state directory for `run` without --config, made only when it is used:
    a container with a read-only root and no /tmp (Kubernetes' readOnlyRootFilesystem) runs
    `run --config` or sets KVPILOT_STATE_DIR, and needs no temporary directory at all."""
    import tempfile

    if not needed or os.environ.get("KVPILOT_STATE_DIR"):
        yield ""  # never used: the file's state_dir or KVPILOT_STATE_DIR decides
        return
    try:
        scratch = tempfile.TemporaryDirectory(prefix="kvpilot-state-")
    except OSError as exc:  # FileNotFoundError: no usable temporary directory
        print(
            f"kvpilot: no writable temporary directory for the state ({exc}): set "
            "KVPILOT_STATE_DIR to a writable directory (a volume), or mount one on /tmp",
            file=sys.stderr,
        )
        raise typer.Exit(INVALID_CONFIG_EXIT) from None
    with scratch as path:
        yield path


def _reloader(path: Path, secrets: tuple[str, ...]) -> Callable[[], AgentConfig]:
    """Reads `path` again as `run --config` did (environment overrides, the token file), for
    a reload; raises ConfigError. The new configuration's secrets are masked in logs too."""
    import os

    from kvpilot.agent.config import load_config, secret_values

    masked = set(secrets)

    def load() -> AgentConfig:
        config = load_config(path, os.environ)
        config.api.control_token()
        masked.update(secret_values(config))
        configure_logging(json_logs=True, secrets=sorted(masked))
        return config

    return load


@app.command()
def demo(
    duration: Annotated[
        float | None, typer.Option(help="Stop after this many seconds (default: Ctrl-C).")
    ] = None,
    listen_port: Annotated[int, typer.Option(help="Port for kvpilot's /metrics.")] = DEFAULT_PORT,
    no_view: Annotated[
        bool, typer.Option("--no-view", help="Logs instead of the live view.")
    ] = False,
    log_file: Annotated[
        Path | None, typer.Option(help="Also write the whole log to this file.")
    ] = None,
    capture: Annotated[
        Path | None,
        typer.Option(help="Write the view's last screen to PATH.txt and PATH.svg at the end."),
    ] = None,
    trials: Annotated[
        int, typer.Option(min=1, max=5, help="Trials of the tuning session (phase 3).")
    ] = 2,
) -> None:
    """The whole loop on a local CPU vLLM: steady load, a burst that preempts and is
    restarted, a short tuning session, the burst again on the promoted flags."""
    from kvpilot.agent.app.lifecycle import ListenError
    from kvpilot.agent.cli.demo.run import DemoSettings, run_demo
    from kvpilot.agent.runtimes.probe import StartFailed

    configure_logging(json_logs=False, level=logging.INFO)
    settings = DemoSettings(
        duration_s=duration,
        listen_port=listen_port,
        live_view=not no_view,
        log_file=log_file,
        capture=capture,
        trials=trials,
    )
    try:
        asyncio.run(run_demo(settings))
    except ListenError as exc:
        print(f"kvpilot: {exc}; choose another port with --listen-port", file=sys.stderr)
        raise typer.Exit(1) from None
    except StartFailed as exc:  # no vLLM in this Python, a port taken meanwhile
        print(f"kvpilot: the demo's server did not start: {exc.headline}", file=sys.stderr)
        raise typer.Exit(1) from None


@app.command("metrics-table")
def metrics_table(
    readme: Annotated[
        Path | None, typer.Option(help="Rewrite the table between the markers in this file.")
    ] = None,
) -> None:
    """Print the Markdown table of every metric the agent exports (or update the README's)."""
    from kvpilot.dashboards.metric_catalog import markdown_table, replace_table

    if readme is None:
        print(markdown_table())
        return
    readme.write_text(replace_table(readme.read_text()))


@rig_app.command("serve")
def rig_serve(
    port: Annotated[int, typer.Option(help="vLLM's port.")] = 8000,
    kvpool_port: Annotated[
        int | None, typer.Option(help="Port for the kvpool plugin (unset: plugin idle).")
    ] = None,
    kv_cache_memory_bytes: Annotated[int, typer.Option(help="KV-cache budget.")] = 64 * 2**20,
    num_gpu_blocks_override: Annotated[
        int | None, typer.Option(help="Force a small KV pool (testing override).")
    ] = None,
    model_dir: Annotated[
        Path | None, typer.Option(help="A folder with a config.json (default: the tiny Llama).")
    ] = None,
) -> None:
    """Start a real CPU vLLM on a random-weight model and keep it up until Ctrl-C."""
    from kvpilot.rig.server import TINY_MODEL_DIR, ServerSpec, VllmServer

    spec = ServerSpec(
        port=port,
        kvpool_port=kvpool_port,
        kv_cache_memory_bytes=None if num_gpu_blocks_override else kv_cache_memory_bytes,
        num_gpu_blocks_override=num_gpu_blocks_override,
        model_dir=model_dir or TINY_MODEL_DIR,
    )
    server = VllmServer(spec)
    print(f"starting vLLM on {spec.url} (log: {server.log_path})", file=sys.stderr)
    with server:
        print(f"healthy: {spec.url}", file=sys.stderr)
        try:
            server.process.wait()  # type: ignore[union-attr]  # started by `with server`
        except KeyboardInterrupt:
            print("stopping", file=sys.stderr)


@rig_app.command("load")
def rig_load(
    url: Annotated[str, typer.Option(help="vLLM's base URL.")] = "http://127.0.0.1:8000",
    requests: Annotated[int, typer.Option(min=1)] = 64,
    concurrency: Annotated[int | None, typer.Option(min=1)] = None,
    rate: Annotated[float | None, typer.Option(help="Poisson arrivals per second.")] = None,
    prompt_len: Annotated[tuple[int, int], typer.Option(help="Uniform LOW HIGH.")] = (32, 256),
    output_len: Annotated[tuple[int, int], typer.Option(help="Uniform LOW HIGH.")] = (32, 128),
    seed: int = 0,
    model: str = "tiny-llama",
    api_key: ApiKey = None,
) -> None:
    """Send token-id completions and print client-side latency quantiles."""
    from kvpilot.tuner.load.generator import LengthDist, Workload, percentile, run_load

    if concurrency is None and rate is None:
        concurrency = 8
    workload = Workload(
        num_requests=requests,
        concurrency=concurrency,
        rate_rps=rate,
        prompt_len=LengthDist.uniform(*prompt_len),
        output_len=LengthDist.uniform(*output_len),
        seed=seed,
    )
    report = asyncio.run(run_load(url, workload, model=model, api_key=api_key))
    summary: dict[str, object] = {
        "requests": len(report.results),
        "failed": len(report.failed),
        "duration_s": round(report.duration_s, 3),
        "output_tokens_per_s": round(report.output_tokens_per_s(), 1),
    }
    for name, values in (
        ("ttft", report.ttfts_s()),
        ("inter_token", report.inter_tokens_s()),
        ("e2e", report.e2es_s()),
    ):
        for q in (0.5, 0.95, 0.99):
            value = percentile(values, q)
            summary[f"{name}_p{q * 100:g}_ms"] = None if value is None else round(value * 1e3, 2)
    if report.failed:
        summary["first_error"] = report.failed[0].error
    print(json.dumps(summary, indent=2))
    raise typer.Exit(1 if report.failed else 0)


def main() -> None:
    app()
