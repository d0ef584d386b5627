"""`kvpilot tune` (a tuning run, or `--dry-run`), `kvpilot tune report` and `kvpilot trials`.

The stable instance is the configuration's first `stable` instance on the `local` runtime; the
canary runs beside it on `--canary-port`. At start-up a trial a dead kvpilot left running is
recovered (its canary stopped, the stable flags kept or restored, the trial aborted). At its
end, whichever way it ends, a run stops the servers it started (the stable one too, unless
`--keep-servers` hands it over to a later `kvpilot run`); one that ran before is left running.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from kvpilot.agent.app.parts import deployment_server, pod_parts, pod_tuner, tuned_server
from kvpilot.agent.cli import workload_cmd as workload_cli
from kvpilot.agent.cli.config_load import exit_missing_extras, load_or_exit, open_state_or_exit
from kvpilot.agent.cli.tune_output import judging_line, print_end, print_summary, run_with_progress
from kvpilot.agent.cli.tune_report import report
from kvpilot.agent.config import PodRuntimeConfig, secret_values
from kvpilot.agent.config.extras import needed_extras
from kvpilot.agent.config.runtime import RuntimeConfig
from kvpilot.agent.config.tuning import TuningConfig
from kvpilot.agent.runtimes import LocalRuntime, RuntimeFailure
from kvpilot.agent.runtimes.kubernetes.pod import strict_reads
from kvpilot.agent.runtimes.kubernetes.runtime import KubernetesRuntime
from kvpilot.agent.runtimes.probe import StartFailed
from kvpilot.agent.state.db import Database
from kvpilot.agent.state.store import StateStore
from kvpilot.agent.state.trials import SqliteRolloutJournal, SqliteTrialStore
from kvpilot.agent.tuning.entry import (
    Recovery,
    Tuner,
    TuningRefused,
    refuse_unreachable,
    run_tuning,
)
from kvpilot.agent.tuning.ground import Ground, GroundStore, argv_model, server_version
from kvpilot.agent.tuning.local.adapter import (
    STABLE_FACT,
    end_stable,
    recover_at_startup,
    stable_owner_id,
    started_by_tune,
)
from kvpilot.agent.tuning.local.factory import local_adapter, stable_runtime
from kvpilot.agent.tuning.local.tuner import LocalTuner
from kvpilot.agent.tuning.server import TunedServer
from kvpilot.agent.tuning.study import (
    Study,
    StudyError,
    build_study,
    planned_trials,
    read_gpu,
    require_server,
    with_version,
)
from kvpilot.agent.tuning.workload.record import remember_workload
from kvpilot.tuner.report.table import trials_table
from kvpilot.tuner.rollout.canary import Release, Strategy, held_records
from kvpilot.tuner.session import SessionSummary, TuningBlocked

ConfigOpt = Annotated[Path, typer.Option("--config", "-c", help="The agent's YAML file.")]
tune_app = typer.Typer(help="Tune vLLM's memory knobs with canary rollouts.")

STOP_DRAIN_S = 10.0  # a server that never became ready has no requests to drain

# Each option overrides one field of the YAML's `tuning:` section (whose defaults it shows).
_DEFAULTS = TuningConfig()


def _bound(field: str, name: str) -> int:
    """A bound (`ge`, `le`) of a `tuning:` field, read from the model: one source of truth."""
    meta = TuningConfig.model_fields[field].metadata
    return int(next(getattr(m, name) for m in meta if hasattr(m, name)))


# Checked at the flag too, so that the error names the flag rather than the YAML.
_WINDOWS = (_bound("windows", "ge"), _bound("windows", "le"))


def _windows_in_range(value: int | None) -> int | None:
    if value is not None and not _WINDOWS[0] <= value <= _WINDOWS[1]:
        raise typer.BadParameter(
            f"a trial observes {_WINDOWS[0]} to {_WINDOWS[1]} windows a side, not {value}"
        )
    return value


@tune_app.callback(invoke_without_command=True)
def tune(
    ctx: typer.Context,
    config: Annotated[Path | None, typer.Option("--config", "-c", help="The agent's YAML.")] = None,
    trials: Annotated[
        int | None, typer.Option(min=1, help=f"Trials to run [{_DEFAULTS.trials}].")
    ] = None,
    strategy: Annotated[
        Strategy | None, typer.Option(help=f"Canary strategy [{_DEFAULTS.strategy}].")
    ] = None,
    dry: Annotated[bool, typer.Option("--dry-run", help="Print the plan; start nothing.")] = False,
    canary_port: Annotated[
        int | None, typer.Option(help=f"The canary's port [{_DEFAULTS.canary_port}].")
    ] = None,
    canary_cpus: Annotated[
        str | None, typer.Option(help="Pin the canary to these CPUs, e.g. '1' or '2,3'.")
    ] = None,
    windows: Annotated[
        int | None,
        typer.Option(
            callback=_windows_in_range,
            help=f"Replayed windows a side per trial, {_WINDOWS[0]} to {_WINDOWS[1]} "
            f"[{_DEFAULTS.windows}]: more evidence for the judge, a window of load each.",
        ),
    ] = None,
    requests: Annotated[int | None, typer.Option(min=1, help="Requests per window.")] = None,
    concurrency: Annotated[int | None, typer.Option(min=1, help="Concurrent requests.")] = None,
    prompt_len: Annotated[int | None, typer.Option(min=1, help="Prompt tokens.")] = None,
    output_len: Annotated[int | None, typer.Option(min=1, help="Output tokens.")] = None,
    ttft_p95_s: Annotated[float | None, typer.Option(help="SLO: TTFT p95 limit.")] = None,
    itl_p95_s: Annotated[float | None, typer.Option(help="SLO: inter-token p95 limit.")] = None,
    kv_max_bytes: Annotated[int | None, typer.Option(help="Upper end of the KV budget.")] = None,
    max_seqs: Annotated[int | None, typer.Option(help="Upper end of max_num_seqs.")] = None,
    seed: Annotated[int | None, typer.Option(help="The suggester's seed.")] = None,
    bake: Annotated[bool | None, typer.Option(help="Bake window after a promotion.")] = None,
    sidecar_url: workload_cli.SidecarUrl = None,
    observe_s: workload_cli.ObserveS = None,
    keep_servers: Annotated[
        bool,
        typer.Option(
            "--keep-servers",
            help="Leave the stable server this run started running (PID and port printed; "
            "`kvpilot run` adopts it). By default it is stopped; canaries always are.",
        ),
    ] = False,
) -> None:
    """Run N trials: ask, start the canary, observe, judge, promote or roll back."""
    if ctx.invoked_subcommand is not None:
        return
    if config is None:
        raise typer.BadParameter("--config is required", param_hint="--config")
    cfg, config_sha256 = load_or_exit(config)
    exit_missing_extras(needed_extras(cfg, tuning=True))
    base = cfg.tuning
    overrides = {
        "trials": trials,
        "strategy": strategy.value if strategy else None,
        "canary_port": canary_port,
        "kv_max_bytes": kv_max_bytes,
        "max_num_seqs": max_seqs,
        "seed": seed,
        "bake": bake,
        "windows": windows,
        "canary_cpus": _cpu_list(canary_cpus) if canary_cpus is not None else None,
        "workload": base.workload.model_copy(
            update=_given(
                requests=requests,
                concurrency=concurrency,
                prompt_len=prompt_len,
                output_len=output_len,
            )
        ),
        "slo": base.slo.model_copy(
            update=_given(ttft_p95_s=ttft_p95_s, inter_token_p95_s=itl_p95_s)
        ),
    }
    pod = _pod_runtime_or_exit(partial(pod_parts, cfg, os.environ))
    try:
        tuning = TuningConfig.model_validate({**base.model_dump(), **_given(**overrides)})
        chosen = None
        if pod is None or tuning.canary.traffic == "replay":  # live traffic: its own workload
            url = sidecar_url or workload_cli.agent_url(cfg.api_listen())
            chosen = workload_cli.choose_for_tune(cfg.runtime, tuning, url, observe_s)
        api_key = _api_key(cfg.runtime)
        server, version = _stable_server(tuned_server(cfg), pod, api_key)
        study = build_study(server, tuning, read_gpu(), vllm_version=version, chosen=chosen)
    except (ValueError, StudyError) as exc:
        raise typer.BadParameter(str(exc), param_hint="--config") from exc
    except RuntimeFailure as exc:  # the API server refused or did not answer
        print(f"kvpilot tune: {exc}", file=sys.stderr)
        raise typer.Exit(1) from None
    console = Console()
    if chosen is not None:
        console.print(chosen.describe(), highlight=False, markup=False, soft_wrap=True)
    if study.strategy_reason is not None:
        console.print(study.strategy_reason, highlight=False, markup=False, soft_wrap=True)
    console.print(judging_line(tuning, windows is not None), highlight=False, soft_wrap=True)
    try:
        refuse_unreachable(study)  # before any server starts: such a run can only roll back
    except TuningRefused as exc:
        if not dry:
            print(f"kvpilot tune: {exc}", file=sys.stderr)
            raise typer.Exit(1) from None
        console.print(f"warning: {exc}", highlight=False, markup=False, soft_wrap=True)
    db = open_state_or_exit(cfg.state_dir)
    try:
        if dry:
            last = GroundStore(db).load(study.stable.name)  # the study of the last run's vLLM
            if pod is None and last is not None and last.ground.vllm_version is not None:
                study = with_version(study, last.ground.vllm_version)
            told, planned = planned_trials(study, db)
            console.print(f"study {study.fingerprint}: {told} past trials told")
            for knob in study.space.knobs:
                span = knob.choices or (knob.low, knob.high)
                console.print(f"  searching {knob.name} over {span}", highlight=False)
            for i, plan in enumerate(planned, 1):
                console.print(f"{i}. {plan.candidate.describe()}  [dim]{plan.why}[/dim]")
            if len(planned) < study.tuning.trials:
                console.print(
                    f"(the other {study.tuning.trials - len(planned)} follow from what these show)",
                    highlight=False,
                )
            return
        if pod is None:
            run = _run(
                study,
                db,
                console,
                config_sha256=config_sha256,
                secrets=secret_values(cfg),
                api_key=api_key,
                log_dir=cfg.state_dir / "logs",
                config_path=config,
                keep=keep_servers,
            )
            asyncio.run(run)
        else:
            tuner = pod_tuner(pod[0], tuning, pod[1], db, api_key=api_key)
            asyncio.run(_run_pod(tuner, study, console, secret_values(cfg)))
    except StartFailed as exc:  # the log's end and a sentence, never a traceback
        print(exc.explain(), file=sys.stderr)
        raise typer.Exit(1) from None
    except (TuningBlocked, RuntimeFailure) as exc:  # the Lease is held, the API refused
        print(f"kvpilot tune: {exc}", file=sys.stderr)
        raise typer.Exit(1) from None
    finally:
        db.close()


async def _start_stable(runtime: LocalRuntime, study: Study) -> None:
    """The stable instance, ready; StartFailed (with what its log said) when it is not."""
    name = study.stable.name
    try:
        await runtime.start(name, ready_timeout_s=study.ready_timeout_s)
    except StartFailed:
        raise
    except RuntimeFailure as exc:  # not ready in time, or its leftovers would not stop
        with contextlib.suppress(RuntimeFailure):  # no server left half-started
            await runtime.stop(name, drain_timeout_s=STOP_DRAIN_S)
        first = str(exc).splitlines()[0]
        raise StartFailed(
            f"the stable instance {name!r} did not start: {first}",
            getattr(exc, "log_tail", None),
            log_path=runtime.log_path(name),
        ) from None


def _given(**values: object) -> dict[str, object]:
    return {k: v for k, v in values.items() if v is not None}


def _cpu_list(text: str) -> tuple[int, ...]:
    try:
        cpus = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise typer.BadParameter(f"not a list of CPU numbers: {text!r}") from None
    if any(c < 0 for c in cpus):
        raise typer.BadParameter(f"CPU numbers are 0 or more: {text!r}")
    return cpus


async def _run(
    study: Study,
    db: Database,
    console: Console,
    *,
    config_sha256: str,
    secrets: tuple[str, ...],
    api_key: str | None,
    log_dir: Path,
    config_path: Path,
    keep: bool,
) -> None:
    """The run on the local runtime (the servers' logs in `log_dir`). On every way out (the
    end, an error, SIGINT or SIGTERM) the canary stops, and so does the stable server unless
    it ran before or `keep`."""
    owner_id = stable_owner_id(db, time.time())
    runtime, flags = stable_runtime(study.stable, log_dir, db, config_sha256, owner_id=owner_id)
    adapter = local_adapter(
        study.stable, runtime, db, tuning=study.tuning, log_dir=log_dir, config_sha256=config_sha256
    )
    name = study.stable.name
    # Adopted: not this run's to stop, unless a killed `kvpilot tune` started it.
    found_running = runtime.status(name).state == "running"
    if found_running and started_by_tune(runtime, name, owner_id):
        found_running = False
        left = f"the stable server {name!r} a killed kvpilot tune left running is this run's"
        console.print(f"{left}: stopped at its end", highlight=False, soft_wrap=True)
    signals = _Signals()
    tuner: LocalTuner | None = None
    with signals.cancel(asyncio.current_task()):
        try:
            for done in await recover_at_startup(db, adapter):
                console.print(f"recovered trial {done.trial_id} (was {done.phase.value})")
            if runtime.status(name).state != "running":
                console.print(f"starting the stable instance ({flags.describe()})")
                await _start_stable(runtime, study)
            url = next((i.url for i in runtime.instances() if i.name == name), None)
            version = await server_version(url, api_key=api_key) if url else None
            if version is not None:  # the fingerprint holds the version (a new one: a new study)
                study = with_version(study, version)
            if study.choice is not None:
                remember_workload(StateStore(db), study.choice, time.time())
            tuner = LocalTuner(
                study.stable, runtime, adapter, db, tuning=study.tuning, api_key=api_key
            )
            summary = await _tune(tuner, study, console)
            print_summary(console, summary, adapter.stable_argv(), secrets)
            key = study.choice.key if study.choice is not None else None  # None unless learned
            ground = Ground(version, argv_model(study.configured_argv), key)
            GroundStore(db).save(name, ground, time.time())  # the ground `kvpilot run` watches
        except asyncio.CancelledError:
            if signals.received is None:
                raise
        finally:
            signals.stopping = True  # a later signal no longer cuts the clean-up short
            if tuner is not None:
                await roll_back_held(tuner, study, db, console)
            with contextlib.suppress(RuntimeFailure):
                await adapter.aclose()
            end = await end_stable(
                runtime,
                name,
                found_running=found_running,
                keep=keep,
                drain_timeout_s=study.stable.drain_timeout_s,
            )
            StateStore(db).delete_fact(STABLE_FACT)  # ended: what runs now is not this run's
            print_end(console, end, config_path)
    if signals.received is not None:
        print(f"kvpilot tune: stopped by {signals.received.name}", file=sys.stderr)
        raise typer.Exit(128 + signals.received)


async def roll_back_held(tuner: Tuner, study: Study, db: Database, console: Console) -> None:
    """`kvpilot tune` stops the canary it started on its way out: a trial it held for review
    would outlive its canary and block the next run. Rolled back, saying so (a hold waits for
    a person only under `kvpilot run`, whose canary stays up)."""
    why = "kvpilot tune stops its canary as it ends: a hold waits for review under kvpilot run"
    for record in held_records(SqliteRolloutJournal(db)):
        try:
            done = await tuner.session(study).release(
                record.trial_id, Release.ROLLBACK, by="kvpilot tune", reason=why
            )
        except Exception as exc:  # said; the canary still stops below
            console.print(f"trial {record.trial_id} stays held: {type(exc).__name__}: {exc}")
            continue
        console.print(f"trial {record.trial_id} was held: {done.record.reason}", highlight=False)


class _Signals:
    """SIGINT and SIGTERM cancel the run once (its clean-up then stops what it started);
    signals during the clean-up are answered, not obeyed."""

    def __init__(self) -> None:
        self.received: signal.Signals | None = None
        self.stopping = False

    @contextlib.contextmanager
    def cancel(self, task: asyncio.Task[Any] | None) -> Iterator[None]:
        loop = asyncio.get_running_loop()

        def on_signal(sig: signal.Signals) -> None:
            if self.received is None and not self.stopping and task is not None:
                self.received = sig
                task.cancel()
            else:
                print(f"kvpilot tune: {sig.name}: stopping the servers it started", file=sys.stderr)

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal, sig)
        try:
            yield
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)


async def _tune(tuner: Tuner, study: Study, console: Console) -> SessionSummary:
    """A run the one way into tuning (`run_tuning`), its recovery and progress shown."""

    def told(done: Recovery) -> None:
        for resumed in done.resumed:
            console.print(
                f"resumed trial {resumed.trial_id} (handed over in "
                f"{resumed.was.value}): {resumed.now.value}"
            )
        for recovered in done.recovered:
            console.print(f"recovered trial {recovered.trial_id} (was {recovered.phase.value})")

    return await run_tuning(
        tuner, study, on_recovered=told, run=partial(run_with_progress, console)
    )


async def _run_pod(tuner: Tuner, study: Study, console: Console, secrets: tuple[str, ...]) -> None:
    """A run on the pod runtime: under the Deployment's Lease, canary Deployments, promotion
    by patching the Deployment (which replaces the pod `kvpilot tune` may be running in)."""
    summary = await _tune(tuner, study, console)
    print_summary(console, summary, tuner.stable_argv(), secrets)


def _api_key(runtime: RuntimeConfig) -> str | None:
    return runtime.api_key.get_secret_value() if runtime.api_key else None


PodParts = tuple[PodRuntimeConfig, KubernetesRuntime]


def _pod_runtime_or_exit(pod_parts: Callable[[], PodParts | None]) -> PodParts | None:
    """The pod runtime when the configuration names it (None for the local runtime), or one
    plain message (namespace or API server not found) and exit 1."""
    try:
        return pod_parts()
    except RuntimeFailure as exc:
        print(f"kvpilot tune: {exc}", file=sys.stderr)
        raise typer.Exit(1) from None


def _stable_server(
    configured: TunedServer | None, pod: PodParts | None, api_key: str | None
) -> tuple[TunedServer, str | None]:
    """The server to tune and its vLLM version: the `configured` stable instance (its version
    read once it runs), or the Deployment's as it runs now."""
    if pod is None:
        return require_server(configured), None
    section, runtime = pod
    with strict_reads():  # the Deployment's flags, never the process's view of them
        server = deployment_server(runtime, section)
        stable_url = next(i.url for i in runtime.instances() if i.role == "stable")
    return server, asyncio.run(server_version(stable_url, api_key=api_key))


def trials_command(
    config: ConfigOpt,
    canary_port: Annotated[
        int | None, typer.Option(help="The canary's port [tuning.canary_port].")
    ] = None,
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="Add the warm-up and the KV usage (info).")
    ] = False,
) -> None:
    """Print the tuning history as a table (recovering a trial a dead kvpilot left)."""
    cfg, config_sha256 = load_or_exit(config)
    canary_port = canary_port or cfg.tuning.canary_port
    db = open_state_or_exit(cfg.state_dir)
    try:
        if SqliteRolloutJournal(db).open_records() or SqliteTrialStore(db).unfinished():
            pod = _pod_runtime_or_exit(partial(pod_parts, cfg, os.environ))
            found = _Found(tuned_server(cfg), cfg.tuning, cfg.state_dir / "logs", config_sha256)
            _recover_only(pod, found, db, canary_port, _api_key(cfg.runtime))
        Console().print(trials_table(SqliteTrialStore(db).trials(), verbose=verbose))
    finally:
        db.close()


@dataclass(frozen=True, slots=True)
class _Found:
    """What the local runtime's recovery reads of the configuration."""

    server: TunedServer | None  # None: nothing this configuration tunes
    tuning: TuningConfig
    log_dir: Path
    config_sha256: str


def _recover_only(
    pod: PodParts | None, found: _Found, db: Database, canary_port: int, api_key: str | None
) -> None:
    if pod is not None:
        tuner = pod_tuner(pod[0], found.tuning, pod[1], db, api_key=api_key)

        async def recover_pod() -> None:
            study = await tuner.study()
            async with tuner.lease():
                await tuner.recover(study)

        try:
            asyncio.run(recover_pod())
        except (TuningBlocked, RuntimeFailure, StudyError) as exc:
            print(f"kvpilot trials: not recovered: {exc}", file=sys.stderr)
        return
    server = found.server
    if server is None:
        return  # nothing this configuration tunes
    logs, config_sha256 = found.log_dir, found.config_sha256
    runtime, _ = stable_runtime(server, logs, db, config_sha256)
    tuning = found.tuning.model_copy(update={"canary_port": canary_port})
    adapter = local_adapter(
        server, runtime, db, tuning=tuning, log_dir=logs, config_sha256=config_sha256
    )
    asyncio.run(recover_at_startup(db, adapter))


def register(app: typer.Typer) -> None:
    """Add `tune` (with `tune report`) and `trials` to the kvpilot CLI."""
    tune_app.command("report")(report)
    app.add_typer(tune_app, name="tune")
    app.command("trials")(trials_command)
