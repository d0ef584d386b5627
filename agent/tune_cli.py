"""`kvpilot tune` (a tuning run, or `--dry-run`), `kvpilot tune report` and `kvpilot trials`.

The stable instance is the configuration's first `stable` instance on the `local` runtime; the
canary runs beside it on `--canary-port`. At start-up a trial a dead kvpilot left running is
recovered (its canary stopped, the stable flags kept or restored, the trial aborted).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.live import Live

from kvpilot.agent.config import AgentConfig, LocalRuntimeConfig, load_config
from kvpilot.agent.runtimes.local import LocalInstanceSpec, LocalRuntime
from kvpilot.agent.state.db import Database
from kvpilot.agent.state.store import StateStore
from kvpilot.agent.state.trials import SqliteRolloutJournal, SqliteTrialStore
from kvpilot.agent.tuning import (
    PROMOTED_FACT,
    LoadObserver,
    LocalTunerAdapter,
    live_stable_argv,
    recover_at_startup,
    yaml_hash,
)
from kvpilot.rig.loadgen import LengthDist, Workload
from kvpilot.tuner.constraints import batched_tokens_constraint, planner_constraint
from kvpilot.tuner.fingerprint import fingerprint
from kvpilot.tuner.objective import Slo
from kvpilot.tuner.planner import PlanInputs, feasible_bounds
from kvpilot.tuner.render import trials_table
from kvpilot.tuner.report import write_report
from kvpilot.tuner.rollout import RolloutSettings, Strategy
from kvpilot.tuner.session import Progress, TuningSession, dry_run
from kvpilot.tuner.space import Knob, KnobKind, SearchSpace
from kvpilot.tuner.suggest import BayesianSuggester
from kvpilot.tuner.traces import workload_hash

ConfigOpt = Annotated[Path, typer.Option("--config", "-c", help="The agent's YAML file.")]
tune_app = typer.Typer(help="Tune vLLM's memory knobs with canary rollouts.")


@dataclass(frozen=True, slots=True)
class _Study:
    """Everything one tuning run is built from."""

    config: AgentConfig
    config_sha256: str
    stable: LocalInstanceSpec
    configured_argv: tuple[str, ...]
    space: SearchSpace
    workload: Workload
    slo: Slo
    fingerprint: str


def _flag(argv: tuple[str, ...], name: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def _study(
    path: Path, *, requests: int, concurrency: int, prompt_len: int, output_len: int,
    ttft_p95_s: float, itl_p95_s: float, kv_max_bytes: int, max_seqs: int,
) -> _Study:  # fmt: skip
    config = load_config(path)
    runtime = config.runtime
    if not isinstance(runtime, LocalRuntimeConfig):
        raise typer.BadParameter("kvpilot tune needs the local runtime", param_hint="--config")
    inst = next((i for i in runtime.instances if i.role == "stable"), None)
    if inst is None:
        raise typer.BadParameter("no stable instance in the configuration", param_hint="--config")
    argv = tuple(inst.argv)
    model = _flag(argv, "--model") or ""
    block = int(_flag(argv, "--block-size") or 16)
    max_len = int(_flag(argv, "--max-model-len") or 0) or None
    bounds = feasible_bounds(
        Path(model) / "config.json",
        PlanInputs(
            block_size=block,
            max_model_len=max_len,
            dtype=_flag(argv, "--dtype") or "auto",
            kv_cache_memory_bytes=kv_max_bytes,  # the CPU rig plans from an explicit budget
        ),
    )
    space = SearchSpace(
        knobs=(
            Knob("kv_cache_memory_bytes", KnobKind.INTEGER, bounds.min_kv_cache_memory_bytes,
                 kv_max_bytes, log_scale=True),
            Knob("max_num_seqs", KnobKind.INTEGER, 1, max_seqs, log_scale=True),
        ),
        constraints=(planner_constraint(bounds), batched_tokens_constraint()),
    )  # fmt: skip
    workload = Workload(
        requests, LengthDist.fixed(prompt_len), LengthDist.fixed(output_len), concurrency
    )
    slo = Slo(ttft_p95_s=ttft_p95_s, inter_token_p95_s=itl_p95_s)
    knob_flags = {k.flag for k in space.knobs} | {"--port"}
    fixed = [a for i, a in enumerate(argv) if a not in knob_flags and argv[i - 1] not in knob_flags]
    stable = LocalInstanceSpec(
        inst.name, argv, "stable", tuple(inst.env.items()), inst.kvpool_port, inst.cpus
    )
    return _Study(
        config, yaml_hash(path), stable, argv, space, workload, slo,
        fingerprint(model, fixed, workload_hash(workload), slo),
    )  # fmt: skip


@tune_app.callback(invoke_without_command=True)
def tune(
    ctx: typer.Context,
    config: Annotated[Path | None, typer.Option("--config", "-c", help="The agent's YAML.")] = None,
    trials: Annotated[int, typer.Option(min=1, help="Trials to run.")] = 3,
    strategy: Annotated[Strategy, typer.Option(help="Canary strategy.")] = Strategy.PARALLEL,
    dry: Annotated[bool, typer.Option("--dry-run", help="Print the plan; start nothing.")] = False,
    canary_port: Annotated[int, typer.Option(help="The canary's port.")] = 8199,
    canary_cpus: Annotated[
        str, typer.Option(help="Pin the canary to these CPUs, e.g. '1' or '2,3'; empty: any.")
    ] = "",
    requests: Annotated[int, typer.Option(help="Requests per window.")] = 32,
    concurrency: Annotated[int, typer.Option(help="Concurrent requests.")] = 16,
    prompt_len: Annotated[int, typer.Option(help="Prompt tokens.")] = 128,
    output_len: Annotated[int, typer.Option(help="Output tokens.")] = 64,
    ttft_p95_s: Annotated[float, typer.Option(help="SLO: TTFT p95 limit.")] = 5.0,
    itl_p95_s: Annotated[float, typer.Option(help="SLO: inter-token p95 limit.")] = 0.5,
    kv_max_bytes: Annotated[int, typer.Option(help="Upper end of the KV budget.")] = 64 << 20,
    max_seqs: Annotated[int, typer.Option(help="Upper end of max_num_seqs.")] = 64,
    seed: Annotated[int, typer.Option(help="The suggester's seed.")] = 0,
    bake: Annotated[bool, typer.Option(help="Bake window after a promotion.")] = True,
) -> None:
    """Run N trials: ask, start the canary, observe, judge, promote or roll back."""
    if ctx.invoked_subcommand is not None:
        return
    if config is None:
        raise typer.BadParameter("--config is required", param_hint="--config")
    study = _study(
        config, requests=requests, concurrency=concurrency, prompt_len=prompt_len,
        output_len=output_len, ttft_p95_s=ttft_p95_s, itl_p95_s=itl_p95_s,
        kv_max_bytes=kv_max_bytes, max_seqs=max_seqs,
    )  # fmt: skip
    console = Console()
    db = Database.open(study.config.state_dir)
    try:
        suggester = BayesianSuggester(study.space, seed=seed)
        if dry:
            told, planned = dry_run(
                study.space, suggester, SqliteTrialStore(db), study.fingerprint, trials,
                initial_points=len(study.space.knobs) + 2,
            )  # fmt: skip
            console.print(f"study {study.fingerprint}: {told} past trials told")
            for i, plan in enumerate(planned, 1):
                console.print(f"{i}. {plan.candidate.describe()}  [dim]{plan.why}[/dim]")
            return
        cpus = _cpu_list(canary_cpus)
        asyncio.run(_run(study, db, trials, strategy, canary_port, cpus, seed, bake, console))
    finally:
        db.close()


def _cpu_list(text: str) -> tuple[int, ...]:
    try:
        cpus = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise typer.BadParameter(f"not a list of CPU numbers: {text!r}") from None
    if any(c < 0 for c in cpus):
        raise typer.BadParameter(f"CPU numbers are 0 or more: {text!r}")
    return cpus


async def _run(
    study: _Study, db: Database, trials: int, strategy: Strategy, canary_port: int,
    canary_cpus: tuple[int, ...], seed: int, bake: bool, console: Console,
) -> None:  # fmt: skip
    runtime_cfg = study.config.runtime
    assert isinstance(runtime_cfg, LocalRuntimeConfig)
    promoted = StateStore(db).get_fact(PROMOTED_FACT)
    argv, why = live_stable_argv(study.configured_argv, promoted, study.config_sha256)
    log_dir = study.config.state_dir / "logs"
    runtime = LocalRuntime([dataclasses.replace(study.stable, argv=argv)], log_dir)
    runtime.adopt_orphans()
    adapter = LocalTunerAdapter(
        runtime, stable_name=study.stable.name, canary_port=canary_port, log_dir=log_dir, db=db,
        configured_argv=study.configured_argv, config_sha256=study.config_sha256,
        canary_env=study.stable.env, canary_cpus=canary_cpus,
    )  # fmt: skip
    for done in await recover_at_startup(db, adapter):
        console.print(f"recovered trial {done.trial_id} (was {done.phase.value})")
    if runtime.status(study.stable.name).state != "running":
        console.print(f"starting the stable instance ({why})")
        await runtime.start(study.stable.name, ready_timeout_s=runtime_cfg.ready_timeout_s)
    model = _flag(argv, "--served-model-name") or _flag(argv, "--model") or ""
    line = {"text": "starting"}
    with Live(console=console, refresh_per_second=4) as live:

        def show(p: Progress) -> None:
            best = (
                "-" if p.best_goodput_tokens_per_s is None else f"{p.best_goodput_tokens_per_s:.1f}"
            )
            flags = " ".join(f"{k}={v}" for k, v in p.values)
            line["text"] = (
                f"trial {p.trial_number}  {flags}  phase {p.phase.value}  best {best} tok/s"
            )
            live.update(line["text"])

        session = TuningSession(
            space=study.space, suggester=BayesianSuggester(study.space, seed=seed),
            store=SqliteTrialStore(db), journal=SqliteRolloutJournal(db), runtime=adapter,
            observer=LoadObserver(study.workload, model=model), fingerprint=study.fingerprint,
            settings=RolloutSettings(slo=study.slo, bake=bake,
                                     ready_timeout_s=runtime_cfg.ready_timeout_s),
            strategy=strategy, wall_clock=time.time, on_progress=show,
        )  # fmt: skip
        summary = await session.run(trials)
    if not console.is_terminal:
        console.line()  # Live leaves its last line open where output is not a terminal
    for outcome in summary.outcomes:
        t = outcome.trial
        console.print(f"trial {t.number}: {outcome.record.phase.value}: {outcome.record.reason}")
    console.print(f"{summary.stopped_reason}; best goodput {summary.best_goodput_tokens_per_s}")
    console.print(f"stable flags now: {' '.join(adapter.stable_argv())}")


@tune_app.command("report")
def report(
    config: ConfigOpt,
    output: Annotated[Path, typer.Option("--output", "-o", help="The HTML file.")] = Path(
        "report.html"
    ),
) -> None:
    """Write the tuning history as one self-contained HTML page."""
    cfg = load_config(config)
    db = Database.open(cfg.state_dir)
    try:
        path = write_report(output, SqliteTrialStore(db).trials())
    finally:
        db.close()
    Console().print(f"wrote {path}")


def trials_command(
    config: ConfigOpt,
    canary_port: Annotated[int, typer.Option(help="The canary's port.")] = 8199,
) -> None:
    """Print the tuning history as a table (recovering a trial a dead kvpilot left)."""
    cfg = load_config(config)
    db = Database.open(cfg.state_dir)
    try:
        if SqliteRolloutJournal(db).open_records() or SqliteTrialStore(db).unfinished():
            _recover_only(cfg, config, db, canary_port)
        Console().print(trials_table(SqliteTrialStore(db).trials()))
    finally:
        db.close()


def _recover_only(cfg: AgentConfig, path: Path, db: Database, canary_port: int) -> None:
    runtime_cfg = cfg.runtime
    if not isinstance(runtime_cfg, LocalRuntimeConfig):
        return
    inst = next(i for i in runtime_cfg.instances if i.role == "stable")
    promoted = StateStore(db).get_fact(PROMOTED_FACT)
    argv, _ = live_stable_argv(tuple(inst.argv), promoted, yaml_hash(path))
    log_dir = cfg.state_dir / "logs"
    env = tuple(inst.env.items())
    runtime = LocalRuntime(
        [LocalInstanceSpec(inst.name, argv, "stable", env, inst.kvpool_port, inst.cpus)], log_dir
    )
    runtime.adopt_orphans()
    adapter = LocalTunerAdapter(
        runtime, stable_name=inst.name, canary_port=canary_port, log_dir=log_dir, db=db,
        configured_argv=tuple(inst.argv), config_sha256=yaml_hash(path), canary_env=env,
    )  # fmt: skip
    asyncio.run(recover_at_startup(db, adapter))


def register(app: typer.Typer) -> None:
    """Add `tune` (with `tune report`) and `trials` to the kvpilot CLI."""
    app.add_typer(tune_app, name="tune")
    app.command("trials")(trials_command)
