"""Builds the sidecar's parts from the validated configuration: the runtime, the notifiers."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import cast

import httpx

from kvpilot.agent.config import (
    AgentConfig,
    AlertmanagerNotifierConfig,
    AttachRuntimeConfig,
    LocalRuntimeConfig,
    NotifierConfig,
    PodRuntimeConfig,
    ProcessRuntimeConfig,
    SlackNotifierConfig,
    WebhookNotifierConfig,
)
from kvpilot.agent.notify import (
    AlertmanagerNotifier,
    Notifier,
    SlackNotifier,
    WebhookNotifier,
)
from kvpilot.agent.runtimes import (
    AttachedServer,
    AttachRuntime,
    LocalInstanceSpec,
    LocalRuntime,
    ProcessRuntime,
    ProcessTarget,
    Runtime,
)
from kvpilot.agent.runtimes.kubernetes.api import make_api_client, pod_name, pod_namespace
from kvpilot.agent.runtimes.kubernetes.handover_configmap import HandoverConfigMap
from kvpilot.agent.runtimes.kubernetes.pod import API_READ_INTERVAL_S, PodRuntime
from kvpilot.agent.runtimes.kubernetes.values import KubernetesTarget


def build_runtime(
    config: AgentConfig, argv_overrides: Mapping[str, tuple[str, ...]] | None = None
) -> Runtime:
    """The configured runtime; `argv_overrides` replaces instances' argv (promoted flags)."""
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
        return cast(Runtime, build_pod_runtime(config, runtime, os.environ))
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


def build_pod_runtime(
    config: AgentConfig,
    runtime: PodRuntimeConfig,
    environ: Mapping[str, str],
    *,
    api_client: object | None = None,
) -> PodRuntime:
    """The pod runtime: vLLM beside the sidecar restarted by signal (the process runtime),
    the Deployment changed through the API (canaries, promotions, the tuning Lease).
    RuntimeFailure when the namespace or the API server's configuration cannot be found."""
    k8s = runtime.kubernetes
    target = KubernetesTarget(
        namespace=k8s.namespace or pod_namespace(environ),
        deployment=k8s.deployment,
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
    )
    client = api_client if api_client is not None else make_api_client(k8s.api_url)
    built = PodRuntime(
        target,
        client,
        process_runtime=ProcessRuntime([_process_target(runtime)]),
        identity=pod_name(environ),
        lease_duration_s=k8s.lease_duration_s,
    )
    built.api_read_interval_s = API_READ_INTERVAL_S
    if k8s.handover == "configmap":
        built.handover_map = HandoverConfigMap(
            client, namespace=target.namespace, deployment=target.deployment
        )
    return built


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
