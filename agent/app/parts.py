"""Builds the sidecar's parts from the validated configuration: the runtime, the notifiers."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import httpx

from kvpilot.agent.config import (
    AgentConfig,
    AlertmanagerNotifierConfig,
    AttachRuntimeConfig,
    LocalRuntimeConfig,
    NotifierConfig,
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
    assert isinstance(runtime, ProcessRuntimeConfig)
    kvpool_url = None
    if runtime.kvpool_port is not None:
        host = runtime.host or "127.0.0.1"
        kvpool_url = f"http://{f'[{host}]' if ':' in host else host}:{runtime.kvpool_port}"
    api_key = runtime.api_key.get_secret_value() if runtime.api_key else None
    target = ProcessTarget(
        name=runtime.name, port=runtime.port, host=runtime.host,
        cmdline_regex=runtime.cmdline_regex, kvpool_url=kvpool_url, api_key=api_key,
    )  # fmt: skip
    return ProcessRuntime([target])


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
                cfg.name, cfg.url, client, external_url=external_url,
                secret=cfg.hmac_secret, headers=dict(cfg.headers), timeout_s=cfg.timeout_s,
            )  # fmt: skip
        elif isinstance(cfg, AlertmanagerNotifierConfig):
            auth = cfg.auth
            notifiers[cfg.name] = AlertmanagerNotifier(
                cfg.name, cfg.url, client,
                # Each push is valid for a while; the repeat interval re-pushes before then.
                resend_validity_s=4 * cfg.repeat_interval_s,
                username=auth.username if auth else None,
                password=auth.password if auth else None,
                bearer_token=auth.bearer_token if auth else None,
                headers=dict(cfg.headers), timeout_s=cfg.timeout_s,
            )  # fmt: skip
        elif isinstance(cfg, SlackNotifierConfig):
            notifiers[cfg.name] = SlackNotifier(cfg.name, cfg.url, client, timeout_s=cfg.timeout_s)
    return notifiers
