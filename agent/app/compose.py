"""`kvpilot run --config`: wires the sidecar from its configuration and runs it to a signal."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from kvpilot.agent.app.api import api_routes
from kvpilot.agent.app.control_token import ControlToken
from kvpilot.agent.app.deployment_settings import DeploymentSettings
from kvpilot.agent.app.exposition import build_registry, sidecar_families, tuning_families
from kvpilot.agent.app.fleet_keep import DeploymentKeeping
from kvpilot.agent.app.fleet_start import take_over_kept_guards
from kvpilot.agent.app.http import build_app
from kvpilot.agent.app.lifecycle import (
    NO_RELOAD,
    LoopSettings,
    bind_listener,
    own_signals,
    serve_and_tick,
)
from kvpilot.agent.app.parts import (
    PodPlace,
    build_notifiers,
    build_runtime,
    control_ports,
    deployment_settings,
    pod_place,
    scheduled_tuning_of,
    server_of,
    tick_settings,
    tuned_server,
)
from kvpilot.agent.app.reload import Reloader, reload_routes
from kvpilot.agent.app.start_up import adopt_orphans, start_local
from kvpilot.agent.config import AgentConfig, PodRuntimeConfig
from kvpilot.agent.remediation import Remediator
from kvpilot.agent.remediation.oom.guard import OomGuard
from kvpilot.agent.remediation.oom.range import planner_range
from kvpilot.agent.remediation.prefix_cache import HttpPrefixCacheReset
from kvpilot.agent.remediation.preflight import MemoryPreflight
from kvpilot.agent.runtimes import LocalRuntime, Runtime, RuntimeFailure
from kvpilot.agent.runtimes.kubernetes.pod import PodRuntime
from kvpilot.agent.runtimes.kubernetes.runtime import KubernetesRuntime
from kvpilot.agent.runtimes.kubernetes.switch import SwitchWatch, read_layers
from kvpilot.agent.runtimes.offloop import in_daemon_thread
from kvpilot.agent.runtimes.probe import StartFailed
from kvpilot.agent.state import StateError, StateStore, open_exclusive
from kvpilot.agent.state.write_failures import WriteFailures
from kvpilot.agent.tick.after import AfterTick, CompletedRuns
from kvpilot.agent.tick.alert_commit import AlertCommit
from kvpilot.agent.tick.sidecar import Sidecar
from kvpilot.agent.tick.watched import WatchedServers
from kvpilot.agent.tuning.best import BestConfig, config_studies, remember_promotion
from kvpilot.agent.tuning.promoted import (
    PROMOTED_FACT,
    Why,
    live_argv,
    record_running_config,
    tuned_instance,
)
from kvpilot.agent.tuning.retune import retune_watch, stable_name
from kvpilot.agent.tuning.schedule import (
    ScheduledTuning,
)
from kvpilot.agent.tuning.workload.choice import WorkloadChoice, window_choice
from kvpilot.agent.tuning.workload.keep import WindowKeeper
from kvpilot.agent.tuning.workload.window import WorkloadWindow
from kvpilot.collectors.nvml import NvmlCollector
from kvpilot.collectors.procfs import read_mem_available_bytes

log = logging.getLogger(__name__)


async def run_sidecar(
    config: AgentConfig,
    *,
    stop: asyncio.Event | None = None,
    config_sha256: str | None = None,
    on_tick: Callable[[Sidecar], None] | None = None,
    reload_config: Callable[[], AgentConfig] | None = None,
    on_tuning: Callable[[ScheduledTuning], None] | None = None,
) -> None:
    """The sidecar to a signal. `config_sha256` (the YAML's hash) lets promoted flags hold
    while the file is unchanged; without it the configured flags run. `on_tick` sees the
    sidecar after each tick (the demo's live view). `reload_config` reads the configuration
    again, for SIGHUP and `POST /-/reload` (without it a reload is refused). `on_tuning` gets
    the scheduled tuning once built, so that a caller can fire a session itself (the demo).

    Raises ListenError before anything starts when the listen address cannot be bound, and
    StartFailed, after a clean shutdown, when a local server exits before it was first ready.
    """
    stop = stop or asyncio.Event()
    own_signals(stop)  # before a server is adopted or started: a signal then stops it
    sock = bind_listener(config.listen.host, config.listen.port)
    failed: list[StartFailed] = []
    try:
        api = config.api.listen
        control_sock = bind_listener(api.host, api.port) if api is not None else None
        try:
            listeners = (sock, control_sock)
            await _run(
                config, listeners, stop, failed, config_sha256, on_tick, reload_config, on_tuning
            )
        finally:
            if control_sock is not None:
                control_sock.close()
    finally:
        sock.close()
    if failed:
        raise failed[0]


async def _run(
    config: AgentConfig,
    listeners: tuple[socket.socket, socket.socket | None],
    stop: asyncio.Event,
    failed: list[StartFailed],
    config_sha256: str | None,
    on_tick: Callable[[Sidecar], None] | None,
    reload_config: Callable[[], AgentConfig] | None,
    on_tuning: Callable[[ScheduledTuning], None] | None = None,
) -> None:
    """Each part is built once, from the parts below it: the watched servers (the latest
    readings) before the pre-flight and the tuner that read them, the alerts before the
    re-tune watch that restores its own, the after-tick parts before the loop that runs them."""
    api_key = config.runtime.api_key.get_secret_value() if config.runtime.api_key else None
    timeout = httpx.Timeout(5.0, connect=2.0)
    async with httpx.AsyncClient(timeout=timeout) as client, contextlib.AsyncExitStack() as ends:
        store = ends.enter_context(_own_state_or_exit(config))  # closed after all the rest
        place = _pod_place_or_exit(config)
        annotated = deployment_settings(place) if place is not None else None
        if annotated is not None:  # the Deployment's annotations over the shared ConfigMap
            config = await in_daemon_thread(annotated.layer, config)
        runtime = _runtime_or_exit(config, promoted_argv(config, store, config_sha256), place)
        # Each clean-up is owed from the moment its part exists (they run in reverse):
        # a failure while composing still stops a server adopted or started by then.
        ends.push_async_callback(runtime.aclose, drain_timeout_s=config.runtime.drain_timeout_s)
        settings = tick_settings(config)
        watched = WatchedServers(settings, NvmlCollector(server_pids=lambda: _all_pids(runtime)))
        ends.push_async_callback(watched.aclose)
        section = config.remediation
        preflight = MemoryPreflight(
            latest_nvml=watched.latest_nvml,
            cache_config=watched.cache_config,
            margin_ratio=section.preflight.margin_ratio,
            # The local runtime marks every start: a holder that carries an earlier start's
            # mark is named as this server's leftover.
            server_marks=(runtime.server_marks if isinstance(runtime, LocalRuntime) else _no_marks),
        )
        learned = WorkloadWindow(config.tuning.learn.window_s)  # the stable server's traffic
        keeper = WindowKeeper(learned, store)  # the window outlives a restart of kvpilot
        if config.tuning.learn.enabled:
            log.info("learned workload: %s", keeper.restore())

        tuned = tuned_server(config)

        def workload_now() -> WorkloadChoice | None:  # what a tuning run would replay now
            return window_choice(config.tuning, tuned, learned.shape())

        def stable_version() -> str | None:
            return watched.vllm_version(stable_name(runtime.instances()))

        studies = config_studies(
            config.tuning, server_of(config), watched.vllm_version, workload_now
        )
        better = BestConfig(store.db, runtime.instances, studies)
        light_step = (
            HttpPrefixCacheReset(api_key=api_key) if section.light_step_reset_prefix_cache else None
        )
        remediator = Remediator(
            runtime,
            store,
            section,
            preflight=preflight,
            light_step=light_step,
            runtime_drain_timeout_s=config.runtime.drain_timeout_s,
            better_config=better,  # the ladder's promote
            on_promoted=remember_promotion(tuned, store, config_sha256),
            oom=_oom_guard(config, runtime, watched),
        )
        if isinstance(runtime, PodRuntime):  # a replaced pod's budget and breaker
            await take_over_kept_guards(runtime, remediator)
        completed_runs = CompletedRuns()
        tuning = scheduled_tuning_of(
            config,
            config_sha256,
            (runtime, remediator, store),
            api_key=api_key,
            vllm_version=stable_version,
            workload=workload_now,
            completed_runs=completed_runs,
        )
        alerts = AlertCommit(settings, store, wall_clock=time.time, write_failures=WriteFailures())
        retune = retune_watch(
            config.tuning.retune,
            store,
            instances=runtime.instances,
            latest_vllm=watched.latest_vllm,
            better=better,
            schedule=tuning,
            restored=alerts.tracker.alerts(),
            workload_key=lambda: chosen.key if (chosen := workload_now()) else None,
        )
        after = AfterTick(
            retune=retune,
            completed_runs=completed_runs,
            learned=learned if config.tuning.learn.enabled else None,
            keeper=keeper if config.tuning.learn.enabled else None,
        )
        api_at = config.api_listen()
        external_url = f"http://{api_at.host}:{api_at.port}"
        sidecar = Sidecar(
            settings,
            store=store,
            runtime=runtime,
            remediator=remediator,
            notifiers=build_notifiers(config.notifiers, client, external_url),
            watched=watched,
            alerts=alerts,
            after=after,
        )
        ends.push_async_callback(sidecar.delivery.aclose)
        ends.push_async_callback(sidecar.aclose)  # remediations under way: recorded interrupted
        sidecar.reconcile()
        if isinstance(runtime, PodRuntime) and runtime.restart_gate is not None:
            # After reconcile (the pod's own vetoes): the Deployment's vetoes and workload.
            gate = runtime.restart_gate
            keeping = DeploymentKeeping(
                gate.kept,
                gate.events,
                remediator.vetoes,
                learned if config.tuning.learn.enabled else None,
                min_requests=config.tuning.learn.min_requests,
            )
            log.info("learned workload: %s", await keeping.start())
            ends.callback(sidecar.tasks.spawn(keeping.run(), "deployment-keeping").cancel)
        if isinstance(runtime, KubernetesRuntime):  # the switch's Deployment and namespace layers
            target, api_client = runtime.target, runtime.api_client
            switch = SwitchWatch(
                remediator.mode,
                lambda namespace_too: read_layers(
                    api_client, target.namespace, target.deployment, namespace_too=namespace_too
                ),
            )
            ends.callback(sidecar.tasks.spawn(switch.run(), "mode-switch").cancel)
        if isinstance(runtime, LocalRuntime):
            adopt_orphans(runtime, store)
        if tuning is not None and on_tuning is not None:
            on_tuning(tuning)
        starting = sidecar.tasks.spawn(
            start_local(config.runtime, runtime, remediator, tuning, stop, failed), "start-servers"
        )
        reloader = None
        if reload_config is not None:
            reloader = Reloader(
                reload_config,
                config,
                sidecar,
                lambda cfgs: build_notifiers(cfgs, client, external_url),
                audit=store,
                mode=remediator.mode,
                layer=_layer_of(annotated),
            )
        own = sidecar_families(sidecar.counters, reloader)

        def extra(out: Any) -> None:
            own(out)
            tuning_families(sidecar.tuning_families())(out)

        registry = build_registry(
            watched.servers, extra, vllm_families=config.exposition.vllm_families
        )
        config.api.control_token()  # a token file that cannot be read stops the start
        token = ControlToken(config.api.token, config.api.token_file)
        stale_after_s = max(10.0, 5 * config.interval_s)
        control_routes = [
            *api_routes(control_ports(config, sidecar, tuning, annotated), token, window=learned),
            *(reload_routes(reloader, token) if reloader else ()),
        ]
        sock, control_sock = listeners
        # With a listener of its own, the API answers only there: the port that Prometheus
        # scrapes through the Service serves /metrics and /healthz alone.
        shared = control_routes if control_sock is None else []
        app = build_app(
            sidecar,
            registry,
            clock=sidecar.clock,
            stale_after_s=stale_after_s,
            extra_routes=shared,
        )
        control = None
        if control_sock is not None:
            control_app = build_app(
                sidecar,
                registry,
                clock=sidecar.clock,
                stale_after_s=stale_after_s,
                extra_routes=control_routes,
            )
            control = (control_app, control_sock)
        loop = LoopSettings(
            listen_host=config.listen.host,
            listen_port=config.listen.port,
            interval_s=config.interval_s,
        )

        async def tick() -> None:
            await sidecar.tick()
            if on_tick is not None:
                on_tick(sidecar)

        try:
            await serve_and_tick(
                tick,
                app,
                loop,
                stop=stop,
                add_jobs=tuning.add_to if tuning else None,
                overruns=sidecar.overruns,
                sock=sock,
                reload=_on_sighup(token, reloader),  # it logs its outcome
                control=control,
            )
        finally:
            if config.tuning.learn.enabled:
                keeper.save()
            if tuning is not None:
                await tuning.aclose()  # its rollout stops the canary, restores the stable
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await starting


def _on_sighup(token: ControlToken, reloader: Reloader | None) -> Callable[[], Awaitable[object]]:
    """SIGHUP reads the control token's file again, and reloads where a reloader exists."""

    async def on_sighup() -> object:
        token.reread()
        if reloader is None:
            log.warning("SIGHUP: the control token is read again; %s", NO_RELOAD)
            return None
        return await reloader.reload()

    return on_sighup


def _no_marks(name: str) -> frozenset[str]:
    """Runtimes that start nothing themselves put no mark in a server's environment."""
    return frozenset()


def _runtime_or_exit(
    config: AgentConfig, promoted: dict[str, tuple[str, ...]], place: PodPlace | None = None
) -> Runtime:
    """The configured runtime, or one plain message (the pod runtime's namespace or API
    server not found) and exit 1, before anything listens."""
    try:
        return build_runtime(config, promoted, place)
    except RuntimeFailure as exc:
        raise SystemExit(f"kvpilot: {exc}") from None


def _pod_place_or_exit(config: AgentConfig) -> PodPlace | None:
    """The pod runtime's place (its Deployment), None for the other runtimes; or one plain
    message and exit 1, as `_runtime_or_exit`."""
    if not isinstance(config.runtime, PodRuntimeConfig):
        return None
    try:
        return pod_place(config.runtime, os.environ)
    except RuntimeFailure as exc:
        raise SystemExit(f"kvpilot: {exc}") from None


def _layer_of(
    settings: DeploymentSettings | None,
) -> Callable[[AgentConfig], Awaitable[AgentConfig]] | None:
    """A reload's step that lays the Deployment's settings over the file's again."""
    if settings is None:
        return None

    async def layer(shared: AgentConfig) -> AgentConfig:
        return await in_daemon_thread(settings.layer, shared)

    return layer


def _own_state_or_exit(config: AgentConfig) -> StateStore:
    """The state directory for this agent alone (held until the store closes), its database
    checked; or one plain message naming the problem and the remedy, and exit 1, before
    anything listens or starts."""
    try:
        return open_exclusive(config.state_dir)
    except StateError as exc:
        raise SystemExit(f"kvpilot: {exc}") from None


def promoted_argv(
    config: AgentConfig, store: StateStore, config_sha256: str | None
) -> dict[str, tuple[str, ...]]:
    """The tuned instance's live flags: the tuner's promoted ones while the YAML they were
    promoted under holds. Notes the YAML's hash, under which the live-flags metric labels
    what runs."""
    record_running_config(store, config_sha256, time.time())
    inst = tuned_instance(config.runtime)
    if inst is None:
        return {}
    live = live_argv(inst.argv, store.get_fact(PROMOTED_FACT), config_sha256)
    if live.why is not Why.CONFIGURED:
        log.info("instance %s runs its %s flags", inst.name, live.describe())
    return {inst.name: live.argv}


def _all_pids(runtime: Runtime) -> frozenset[int]:
    return frozenset(pid for instance in runtime.instances() for pid in instance.pids)


def _oom_guard(config: AgentConfig, runtime: Runtime, watched: WatchedServers) -> OomGuard | None:
    """The OOM guard; the host's free memory bounds the KV budget while NVML sees no GPU."""
    section = config.remediation.oom
    if not section.enabled:
        return None

    def available() -> int | None:
        gpus = getattr(
            watched.latest_nvml(), "gpus", ()
        )  # a SourceError or nothing yet: no GPU seen
        return None if gpus else read_mem_available_bytes()

    model_config = getattr(config.runtime, "served_model_config", None)
    return OomGuard(
        section,
        runtime,
        planner_range(section, model_config=model_config, available_bytes=available),
    )
