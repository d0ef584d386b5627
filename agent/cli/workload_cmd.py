"""`kvpilot workload show`: the workload learned from the stable server beside the configured
one, and which one a tuning run would replay (and why).

The learned shape comes from a running sidecar's API (`--sidecar-url`, default: the
configuration's listen address) or, with `--observe-s`, from this command's own window over
the stable server's `/metrics`.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from kvpilot.agent.cli.config_load import load_or_exit
from kvpilot.agent.config import ListenConfig
from kvpilot.agent.config.runtime import RuntimeConfig
from kvpilot.agent.config.tuning import TuningConfig
from kvpilot.agent.tuning.promoted import tuned_instance
from kvpilot.agent.tuning.workload.as_json import workload_json
from kvpilot.agent.tuning.workload.choice import WorkloadChoice, choose_workload
from kvpilot.agent.tuning.workload.source import Learned, from_sidecar, observe
from kvpilot.collectors.addresses import WILDCARD_HOSTS
from kvpilot.collectors.vllm_argv import flag_value
from kvpilot.tuner.load.learned import WorkloadShape, coarse_key

SidecarUrl = Annotated[
    str | None,
    typer.Option(
        "--sidecar-url",
        help="A running `kvpilot run`'s address, whose learned window is used "
        "(default: the configuration's listen address).",
    ),
]
ObserveS = Annotated[
    float | None,
    typer.Option(
        "--observe-s",
        min=1,
        help="Instead, observe the stable server's /metrics for this many seconds.",
    ),
]


def learned_for(
    runtime: RuntimeConfig, window_s: float, sidecar_url: str, observe_s: float | None
) -> Learned:
    """The learned shape: the configured stable server observed for `observe_s` when given
    (over a window of `window_s`), else what the sidecar at `sidecar_url` learned."""
    if observe_s is not None:
        inst = tuned_instance(runtime)
        if inst is None:
            return Learned(None, "no stable instance to observe in the configuration")
        key = runtime.api_key.get_secret_value() if runtime.api_key else None
        return asyncio.run(observe(inst.url, observe_s, window_s=window_s, api_key=key))
    return asyncio.run(from_sidecar(sidecar_url))


def choose_for_tune(
    runtime: RuntimeConfig, tuning: TuningConfig, sidecar_url: str, observe_s: float | None
) -> WorkloadChoice:
    """`kvpilot tune`'s workload: a trace, the learned one (from a sidecar or observed), or
    the configured one. ValueError for an unreadable trace file."""
    if tuning.workload.trace is not None or not tuning.learn.enabled:
        return choose_workload(tuning, None)
    learned = learned_for(runtime, tuning.learn.window_s, sidecar_url, observe_s)
    inst = tuned_instance(runtime)
    limit = flag_value(inst.argv, "--max-model-len") if inst else None
    return choose_workload(
        tuning, learned.shape, max_model_len=int(limit) if limit else None, no_shape=learned.why
    )


def agent_url(listen: ListenConfig) -> str:
    """Where the running agent's API answers, given its listener (`api_listen()`)."""
    host = "127.0.0.1" if listen.host in WILDCARD_HOSTS else listen.host  # answers on loopback
    return f"http://[{host}]:{listen.port}" if ":" in host else f"http://{host}:{listen.port}"


def _fmt(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


_NAMES = (
    "requests",
    "arrivals",
    "prompt tokens p50 / p90",
    "output tokens p50 / p90",
    "prefix cache hits",
    "coarse key",
)


def shape_rows(shape: WorkloadShape) -> list[tuple[str, str]]:
    """The learned shape in a few rounded lines."""
    q = shape.quantiles()
    ratio = shape.prefix_hit_ratio
    values = [
        f"{shape.requests} in {_fmt(shape.window_s)} s",
        f"Poisson at {_fmt(shape.rate_rps, 2)} req/s",
        f"{_fmt(q['prompt_p50'])} / {_fmt(q['prompt_p90'])}",
        f"{_fmt(q['generation_p50'])} / {_fmt(q['generation_p90'])}",
        "-" if ratio is None else f"{ratio:.0%} of prompt tokens",
        coarse_key(shape),
    ]
    return list(zip(_NAMES, values, strict=True))


def show(
    config: Annotated[Path, typer.Option("--config", "-c", help="The agent's YAML.")],
    sidecar_url: SidecarUrl = None,
    observe_s: ObserveS = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the JSON the API serves.")] = False,
) -> None:
    """Print the learned workload beside the configured one, and which a run would use."""
    cfg, _ = load_or_exit(config)
    url = sidecar_url or agent_url(cfg.api_listen())
    learned = learned_for(cfg.runtime, cfg.tuning.learn.window_s, url, observe_s)
    body = workload_json(cfg.tuning, learned.shape, learned.requests, no_shape=learned.why)
    if as_json:
        print(json.dumps(body, indent=2, allow_nan=False))
        return
    console = Console()
    table = Table("", "learned", "configured")
    w = cfg.tuning.workload
    configured = [
        f"{w.requests} per window",
        f"closed loop, {w.concurrency} in flight",
        f"{w.prompt_len} / {w.prompt_len} (fixed)",
        f"{w.output_len} / {w.output_len} (fixed)",
        "none",
        "-" if w.trace is None else f"trace file {w.trace}",
    ]
    rows = shape_rows(learned.shape) if learned.shape else []
    for i, mine in enumerate(configured):
        name, value = rows[i] if rows else (_NAMES[i], "-")
        table.add_row(name, value, mine)
    console.print(table)
    console.print(f"learned: {learned.why}", highlight=False, soft_wrap=True)
    choice = body["choice"]
    console.print(
        f"a tuning run uses: {choice['source']} ({choice['reason']})",
        highlight=False,
        soft_wrap=True,
    )


def register(app: typer.Typer) -> None:
    """Add `workload show` to the kvpilot CLI."""
    workload_app = typer.Typer(help="The workload learned from the server.", no_args_is_help=True)
    workload_app.command("show")(show)
    app.add_typer(workload_app, name="workload")
