"""Builds the sidecar's parts from the validated configuration: the runtime, the tuned server
as tuning sees it (one way per runtime kind), the notifiers."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import httpx

from kvpilot.agent.app.control_ports import ControlPorts
from kvpilot.agent.app.deployment_settings import DeploymentSettings
from kvpilot.agent.config import (
    AgentConfig,
    AlertmanagerNotifierConfig,
    AttachRuntimeConfig,
    InstanceConfig,
    LocalRuntimeConfig,
    NotifierConfig,
    PodRuntimeConfig,
    ProcessRuntimeConfig,
    SlackNotifierConfig,
    WebhookNotifierConfig,
)
from kvpilot.agent.config.tuning import TuningConfig
from kvpilot.agent.notify import (
    AlertmanagerNotifier,
    Notifier,
    SlackNotifier,
    WebhookNotifier,
)
from kvpilot.agent.remediation import Remediator
from kvpilot.agent.runtimes import (
    AttachedServer,
    AttachRuntime,
    LocalInstanceSpec,
    LocalRuntime,
    ProcessRuntime,
    ProcessTarget,
    Runtime,
    RuntimeFailure,
)
from kvpilot.agent.runtimes.kubernetes.api import make_api_client, pod_name, pod_namespace
from kvpilot.agent.runtimes.kubernetes.fleet.decision_events import DecisionEvents
from kvpilot.agent.runtimes.kubernetes.fleet.gate import pod_gate
from kvpilot.agent.runtimes.kubernetes.fleet.owner import owning_deployment
from kvpilot.agent.runtimes.kubernetes.handover_configmap import HandoverConfigMap
from kvpilot.agent.runtimes.kubernetes.pod import API_READ_INTERVAL_S, PodRuntime
from kvpilot.agent.runtimes.kubernetes.runtime import KubernetesRuntime
from kvpilot.agent.runtimes.kubernetes.values import KubernetesTarget
from kvpilot.agent.state import StateStore
from kvpilot.agent.state.db import Database
from kvpilot.agent.tick.after import CompletedRuns
from kvpilot.agent.tick.settings import TickSettings
from kvpilot.agent.tick.sidecar import Sidecar
from kvpilot.agent.tick.wiring import scrape_limits
from kvpilot.agent.tuning.entry import Tuner
from kvpilot.agent.tuning.local.factory import local_adapter, remediated_restarter
from kvpilot.agent.tuning.local.tuner import LocalTuner
from kvpilot.agent.tuning.pod.canary_cap import namespace_canary_cap
from kvpilot.agent.tuning.pod.tuner import PodTuner
from kvpilot.agent.tuning.promoted import tuned_instance
from kvpilot.agent.tuning.schedule import ScheduledTuning, scheduled_tuning
from kvpilot.agent.tuning.server import ServerOf, TunedServer
from kvpilot.agent.tuning.stagger import stagger_offset_s
from kvpilot.agent.tuning.study import StudyError, build_study, read_gpu, require_server
from kvpilot.agent.tuning.workload.choice import WorkloadChoice

log = logging.getLogger(__name__)


def build_runtime(
    config: AgentConfig,
    argv_overrides: Mapping[str, tuple[str, ...]] | None = None,
    place: PodPlace | None = None,
) -> Runtime:
    """The configured runtime; `argv_overrides` replaces instances' argv (promoted flags);
    `place` is the pod runtime's, where it was found already (`pod_place`)."""
    overrides = argv_overrides or {}
    runtime = config.runtime
    if isinstance(runtime, LocalRuntimeConfig):
        specs = [
            LocalInstanceSpec(
                name=instance.name,
                argv=overrides.get(instance.name, tuple(instance.argv)),
                role=instance.role,
                env=tuple(sorted(instance.env.items())),
                kvpool_port=instance.kvpool_port,
                cpus=instance.cpus,
            )
            for instance in runtime.instances
        ]
        log_dir = _log_dir(config, runtime)
        log_dir.mkdir(parents=True, exist_ok=True)
        return LocalRuntime(specs, log_dir)
    if isinstance(runtime, AttachRuntimeConfig):
        return AttachRuntime(
            [
                AttachedServer(
                    name=s.name,
                    url=s.url,
                    kvpool_url=s.kvpool_url,
                    role=s.role,
                    pids=frozenset(s.pids),
                    model_config=s.served_model_config,
                )
                for s in runtime.servers
            ]
        )
    if isinstance(runtime, PodRuntimeConfig):
        # Runtime's `kind` is a Literal; KubernetesRuntime declares it as a plain string.
        return cast(Runtime, build_pod_runtime(config, runtime, os.environ, place=place))
    assert isinstance(runtime, ProcessRuntimeConfig)
    return ProcessRuntime([_process_target(runtime)])


def _process_target(runtime: ProcessRuntimeConfig | PodRuntimeConfig) -> ProcessTarget:
    kvpool_url = None
    if runtime.kvpool_port is not None:
        host = runtime.host or "127.0.0.1"
        kvpool_url = f"http://{f'[{host}]' if ':' in host else host}:{runtime.kvpool_port}"
    api_key = runtime.api_key.get_secret_value() if runtime.api_key else None
    return ProcessTarget(
        name=runtime.name,
        port=runtime.port,
        host=runtime.host,
        cmdline_regex=runtime.cmdline_regex,
        kvpool_url=kvpool_url,
        api_key=api_key,
        expected_uid=runtime.expected_uid,
    )


@dataclass(frozen=True, slots=True)
class PodPlace:
    """Where the pod runtime's sidecar runs: its API client, namespace, Deployment, pod."""

    api_client: object
    namespace: str
    deployment: str
    pod: str | None  # None: the pod's name is unknown (no downward API)


def pod_place(
    runtime: PodRuntimeConfig, environ: Mapping[str, str], *, api_client: object | None = None
) -> PodPlace:
    """The pod runtime's place: the Deployment configured or found from ownerReferences.
    RuntimeFailure when the namespace or the API server's configuration cannot be found."""
    k8s = runtime.kubernetes
    namespace = k8s.namespace or pod_namespace(environ)
    client = api_client if api_client is not None else make_api_client(k8s.api_url)
    identity = pod_name(environ)
    deployment = k8s.deployment or _own_deployment(client, namespace, identity)
    return PodPlace(client, namespace, deployment, identity)


def deployment_settings(place: PodPlace) -> DeploymentSettings:
    """The Deployment's settings annotations over the shared configuration, for its pod."""
    events = None
    if place.pod is not None:
        events = DecisionEvents(
            place.api_client, namespace=place.namespace, deployment=place.deployment, pod=place.pod
        )
    return DeploymentSettings(
        place.api_client, namespace=place.namespace, deployment=place.deployment, events=events
    )


def build_pod_runtime(
    config: AgentConfig,
    runtime: PodRuntimeConfig,
    environ: Mapping[str, str],
    *,
    api_client: object | None = None,
    place: PodPlace | None = None,
) -> PodRuntime:
    """The pod runtime: vLLM beside the sidecar restarted by signal (the process runtime),
    the Deployment changed through the API (canaries, promotions, the tuning Lease).
    RuntimeFailure as `pod_place` says, unless `place` is given (found already)."""
    k8s = runtime.kubernetes
    if place is None:
        place = pod_place(runtime, environ, api_client=api_client)
    client, namespace, identity = place.api_client, place.namespace, place.pod
    target = KubernetesTarget(
        namespace=namespace,
        deployment=place.deployment,
        container=k8s.container,
        sidecar_container=k8s.sidecar_container,
        port=runtime.port,
        kvpool_port=runtime.kvpool_port,
        stable_url=runtime.url,
        api_key=runtime.api_key.get_secret_value() if runtime.api_key else None,
        promote=k8s.promote,
        restart=k8s.restart,
        state_dir=config.state_dir,
        name=runtime.name,
        promotion_surge=k8s.promotion_surge,
    )
    built = PodRuntime(
        target,
        client,
        process_runtime=ProcessRuntime([_process_target(runtime)]),
        identity=identity,
        lease_duration_s=k8s.lease_duration_s,
    )
    if identity is not None:  # a replica: its restarts take turns with its Deployment's
        built.restart_gate = pod_gate(
            client,
            namespace=namespace,
            deployment=target.deployment,
            pod=identity,
            slots=k8s.restarting_at_once,
        )
    built.api_read_interval_s = API_READ_INTERVAL_S
    if k8s.handover == "configmap":
        built.handover_map = HandoverConfigMap(
            client, namespace=target.namespace, deployment=target.deployment
        )
    return built


def _own_deployment(client: object, namespace: str, pod: str | None) -> str:
    """kubernetes.deployment unset: the pod's own, from its ownerReferences."""
    if pod is None:
        raise RuntimeFailure(
            "kubernetes.deployment is unset and this pod's name is unknown (set POD_NAME from "
            "the downward API, or kubernetes.deployment)"
        )
    return owning_deployment(client, namespace, pod)


def tuned_server(config: AgentConfig) -> TunedServer | None:
    """The server tuning is for where the configuration names it: the local runtime's first
    stable instance, with its configured flags; None elsewhere (the pod's is read from its
    Deployment, `deployment_server`)."""
    inst = tuned_instance(config.runtime)
    if inst is None:
        return None
    return TunedServer(
        inst.name,
        tuple(inst.argv),
        config.runtime.ready_timeout_s,
        config.runtime.drain_timeout_s,
        env=tuple(inst.env.items()),
        kvpool_port=inst.kvpool_port,
        cpus=tuple(inst.cpus),
    )


def deployment_server(runtime: KubernetesRuntime, config: PodRuntimeConfig) -> TunedServer:
    """The pod runtime's stable server as the study sees it: the Deployment's live vLLM argv
    (command and args). Reads the API server; StudyError when the container has none."""
    stable = next(i for i in runtime.instances() if i.role == "stable")
    if not stable.argv:
        target = runtime.target
        raise StudyError(
            f"container {target.container!r} of Deployment "
            f"{target.namespace}/{target.deployment} has no vLLM command line"
        )
    return TunedServer(
        stable.name,
        tuple(stable.argv),
        config.ready_timeout_s,
        config.drain_timeout_s,
        kvpool_port=config.kvpool_port,
        model_config=config.served_model_config,
    )


def server_of(config: AgentConfig) -> ServerOf:
    """The server tuning studies for an instance, by the argv it runs: the configured stable
    instance where kvpilot starts it; elsewhere the server as it runs (a server kvpilot did
    not start: its study is the one of its argv)."""
    configured = tuned_server(config)
    if configured is not None:
        return lambda _name, _argv: configured

    def running(name: str, argv: tuple[str, ...]) -> TunedServer | str:
        try:
            InstanceConfig(name=name, argv=argv, role="stable")  # argv tuning can read
        except ValueError as exc:
            return f"the server's argv is not one tuning can read: {exc}"
        runtime = config.runtime
        return TunedServer(name, argv, runtime.ready_timeout_s, runtime.drain_timeout_s)

    return running


def pod_parts(
    config: AgentConfig, environ: Mapping[str, str]
) -> tuple[PodRuntimeConfig, KubernetesRuntime] | None:
    """The pod runtime's section and runtime when the configuration names it (None for the
    others), for the commands that tune outside the agent. RuntimeFailure as
    `build_pod_runtime` says."""
    if not isinstance(config.runtime, PodRuntimeConfig):
        return None
    return config.runtime, build_pod_runtime(config, config.runtime, environ)


def _never() -> bool:
    return False


def pod_tuner(
    runtime_config: PodRuntimeConfig,
    tuning: TuningConfig,
    runtime: KubernetesRuntime,
    db: Database,
    *,
    remediation_in_progress: Callable[[], bool] = _never,
    api_key: str | None = None,
    vllm_version: Callable[[], str | None] = lambda: None,
    workload: Callable[[], WorkloadChoice | None] = lambda: None,
) -> PodTuner:
    """The pod runtime's tuner under `tuning`: its study of the Deployment's live flags."""
    return PodTuner(
        runtime,
        db,
        stable=lambda: deployment_server(runtime, runtime_config),
        tuning=tuning,
        drain_timeout_s=runtime_config.drain_timeout_s,
        remediation_in_progress=remediation_in_progress,
        api_key=api_key,
        vllm_version=vllm_version,
        workload=workload,
        handover_map=runtime.handover_map if isinstance(runtime, PodRuntime) else None,
    )


def scheduled_tuning_of(
    config: AgentConfig,
    config_sha256: str | None,
    parts: tuple[Runtime, Remediator, StateStore],
    *,
    api_key: str | None,
    vllm_version: Callable[[], str | None],
    workload: Callable[[], WorkloadChoice | None],
    completed_runs: CompletedRuns,
) -> ScheduledTuning | None:
    """The scheduled tuning of the local or the pod runtime; None when no schedule is set
    (or the study cannot be built: collecting and alerting go on without it). Each run that
    completes is marked in `completed_runs`, for the re-tune step."""
    runtime, remediator, store = parts
    schedule = config.tuning.schedule
    if schedule is None:
        return None
    tuner: Tuner
    if isinstance(runtime, LocalRuntime):
        try:
            server = require_server(tuned_server(config))
            build_study(server, config.tuning, read_gpu())  # one that cannot be: said once
        except StudyError as exc:
            log.error("scheduled tuning is off: %s", exc)
            return None
        adapter = local_adapter(
            server,
            runtime,
            store.db,
            tuning=config.tuning,
            log_dir=config.state_dir / "logs",
            config_sha256=config_sha256 or "",
            remediation_in_progress=remediator.in_progress,
            restart_stable=remediated_restarter(remediator, server.name),
        )
        tuner = LocalTuner(
            server,
            runtime,
            adapter,
            store.db,
            tuning=config.tuning,
            api_key=api_key,
            vllm_version=vllm_version,
            workload=workload,
        )
    elif isinstance(runtime, KubernetesRuntime) and isinstance(config.runtime, PodRuntimeConfig):
        tuner = pod_tuner(
            config.runtime,
            config.tuning,
            runtime,
            store.db,
            remediation_in_progress=remediator.in_progress,
            api_key=api_key,
            vllm_version=vllm_version,
            workload=workload,
        )
    else:
        return None
    return scheduled_tuning(
        tuner,
        schedule,
        remediator,
        store,
        mode=remediator.mode.current,
        on_tuned=completed_runs.mark,
        sweep=isinstance(tuner, PodTuner),  # a pod evicted mid-trial leaves its canary
        # A fleet's Deployments take turns across the window; one server needs none.
        offset_s=(
            stagger_offset_s(tuner.runtime.target.deployment, config.tuning.schedule_spread_s)
            if isinstance(tuner, PodTuner)
            else 0
        ),
        canary_turn=_canary_turn(tuner, config.runtime),
        hold_timeout_s=config.tuning.hold_timeout_s if config.tuning.hold_inconclusive else None,
    )


def _canary_turn(
    tuner: Tuner, runtime_config: object
) -> Callable[[], AbstractAsyncContextManager[None]]:
    """A replica's turn among its namespace's canaries; one server alone takes none."""
    if not isinstance(tuner, PodTuner) or not isinstance(runtime_config, PodRuntimeConfig):
        return contextlib.nullcontext
    pod, target = tuner.runtime.pod_name, tuner.runtime.target
    if pod is None:
        return contextlib.nullcontext
    cap = namespace_canary_cap(
        tuner.runtime.api_client,
        namespace=target.namespace,
        deployment=target.deployment,
        pod=pod,
        at_once=runtime_config.kubernetes.canaries_at_once,
    )
    return cap.turn


def _log_dir(config: AgentConfig, runtime: LocalRuntimeConfig) -> Path:

    dirs = {i.log_dir for i in runtime.instances if i.log_dir is not None}
    return next(iter(dirs)) if len(dirs) == 1 else config.state_dir / "logs"


def build_notifiers(
    configs: tuple[NotifierConfig, ...], client: httpx.AsyncClient, external_url: str
) -> Mapping[str, Notifier]:
    notifiers: dict[str, Notifier] = {}
    for cfg in configs:
        if isinstance(cfg, WebhookNotifierConfig):
            notifiers[cfg.name] = WebhookNotifier(
                cfg.name,
                cfg.url,
                client,
                external_url=external_url,
                secret=cfg.hmac_secret,
                headers=dict(cfg.headers),
                timeout_s=cfg.timeout_s,
            )
        elif isinstance(cfg, AlertmanagerNotifierConfig):
            auth = cfg.auth
            notifiers[cfg.name] = AlertmanagerNotifier(
                cfg.name,
                cfg.url,
                client,
                # Each push is valid for a while; the repeat interval re-pushes before then.
                resend_validity_s=4 * cfg.repeat_interval_s,
                username=auth.username if auth else None,
                password=auth.password if auth else None,
                bearer_token=auth.bearer_token if auth else None,
                headers=dict(cfg.headers),
                timeout_s=cfg.timeout_s,
            )
        elif isinstance(cfg, SlackNotifierConfig):
            notifiers[cfg.name] = SlackNotifier(cfg.name, cfg.url, client, timeout_s=cfg.timeout_s)
    return notifiers


def tick_settings(config: AgentConfig) -> TickSettings:
    """The sections the tick reads (the sidecar, its alerts, its watched servers)."""
    api = config.api_listen()
    return TickSettings(
        interval_s=config.interval_s,
        rules=config.rules,
        notifiers=config.notifiers,
        retention=config.retention,
        runtime=config.runtime,
        gpu=config.gpu,
        scrape_limits=scrape_limits(config.scrape, config.interval_s),
        learn_workload=config.tuning.learn.enabled,
        alerts_url=f"http://{api.host}:{api.port}/api/v1/alerts",
    )


def control_ports(
    config: AgentConfig,
    sidecar: Sidecar,
    tuning: ScheduledTuning | None = None,
    settings: DeploymentSettings | None = None,
) -> ControlPorts:
    """What the API reaches of the running loop (the scheduled tuning's held canaries where
    it holds them, the settings taken from the Deployment); the configuration masks its
    secrets."""
    held = tuning.held if tuning is not None else None
    return ControlPorts(
        config,
        sidecar.runtime,
        sidecar.alerts,
        sidecar.remediator,
        sidecar,
        held=held,
        from_deployment=(lambda: settings.from_deployment) if settings is not None else None,
    )
