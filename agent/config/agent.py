"""The whole configuration (`kvpilot run --config FILE`) and its top-level sections."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import (
    BaseModel,
    Field,
    SecretStr,
    model_validator,
)

from kvpilot.agent.config.base import (
    Port,
    require_unique,
)
from kvpilot.agent.config.errors import ConfigError
from kvpilot.agent.config.exposition import ExpositionConfig
from kvpilot.agent.config.gpu import GpuConfig
from kvpilot.agent.config.notifiers import NotifierConfig, SlackNotifierConfig
from kvpilot.agent.config.remediation import RemediationConfig
from kvpilot.agent.config.runtime import RuntimeConfig
from kvpilot.agent.config.tuning import TuningConfig
from kvpilot.agent.config.tuning_reach import unreachable_tuning
from kvpilot.agent.rules.config import RulesConfig, with_runtime_defaults
from kvpilot.agent.strict_model import StrictModel
from kvpilot.collectors.safe_files import MAX_TOKEN_FILE_BYTES, read_small_file
from kvpilot.collectors.secrets import argv_secrets, env_secrets, url_secrets

log = logging.getLogger(__name__)


# No exporter in Prometheus's port registry (9100-9999, where dcgm-exporter's 9400 runs on
# the same GPU nodes) and no common serving or observability component claims these two.
DEFAULT_PORT = 8474
DEFAULT_API_PORT = 8475


class ListenConfig(StrictModel):
    """Where the agent serves /metrics, health and its HTTP API.

    Also given as one string, `HOST:PORT` (`[::1]:8474` for IPv6), as in
    `KVPILOT_LISTEN=0.0.0.0:8474`."""

    host: str = Field("127.0.0.1", description="Address to bind; loopback unless you mean it.")
    port: Port = Field(
        DEFAULT_PORT,
        description="TCP port for /metrics and /healthz (and /api/v1 unless api.listen is set).",
    )

    @model_validator(mode="before")
    @classmethod
    def _host_port_string(cls, value: Any) -> Any:
        return parse_host_port(value) if isinstance(value, str) else value


def parse_host_port(text: str) -> dict[str, Any]:
    """`HOST:PORT` or `[V6]:PORT` as the listen section's mapping; ValueError says the form."""
    host, sep, port = text.strip().rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isascii() or not port.isdigit():
        raise ValueError(f"expected HOST:PORT (e.g. 0.0.0.0:{DEFAULT_PORT}), got {text!r}")
    return {"host": host, "port": int(port)}


# A tick less often than every five minutes leaves nothing to alert on in time; more often than
# ten times a second, the agent spends its CPU on itself.
MIN_INTERVAL_S = 0.1
MAX_INTERVAL_S = 300.0


class ApiConfig(StrictModel):
    """The control API's token: POST endpoints are refused while neither is set."""

    token: SecretStr | None = Field(
        None, description="Bearer token required by the POST endpoints (never logged)."
    )
    token_file: Path | None = Field(
        None, description="A file holding the token (e.g. a mounted Kubernetes Secret)."
    )
    listen: ListenConfig | None = Field(
        None,
        description="A listener of its own for /api/v1 and /-/reload (e.g. 127.0.0.1:"
        f"{DEFAULT_API_PORT}), so that the port Prometheus scrapes serves /metrics and "
        "/healthz only. Default: the API shares the main listener.",
    )

    @model_validator(mode="after")
    def _one_source(self) -> ApiConfig:
        if self.token is not None and self.token_file is not None:
            raise ValueError("set token or token_file, not both")
        return self

    def control_token(self) -> SecretStr | None:
        """The token, read from `token_file` when that is how it is given."""
        if self.token_file is None:
            return self.token
        try:
            # Bounded and non-blocking: a FIFO or /dev/zero there must not hang start-up.
            text = read_small_file(self.token_file, MAX_TOKEN_FILE_BYTES).decode().strip()
        except OSError as exc:  # not UTF-8 is said by the loader, with the byte offset
            raise ConfigError([f"api.token_file: cannot read {self.token_file}: {exc}"]) from exc
        if not text:
            raise ConfigError([f"api.token_file: {self.token_file} is empty"])
        return SecretStr(text)


class RetentionConfig(StrictModel):
    """How long rows are kept in the state database."""

    outbox_days: float = Field(7.0, gt=0, description="Delivered or abandoned notifications.")
    audit_days: float = Field(90.0, gt=0, description="Audit records.")
    remediations_days: float = Field(90.0, gt=0, description="Finished remediations.")
    silences_days: float = Field(30.0, gt=0, description="Silences after they end.")


class ScrapeConfig(StrictModel):
    """Limits on every read of a server's sources (vLLM /metrics, the kvpool plugin), as
    Prometheus's scrape limits: a source past one is an error of that kind for the tick
    (`timeout`, `too_large`, `too_many_samples`, counted in kvpilot_collector_errors_total);
    the other sources, servers and rules carry on."""

    timeout_s: float | None = Field(
        None,
        gt=0,
        le=60,
        description="Deadline for a source's whole response (connection, headers and body). "
        "Default: the tick interval, at least 2 s and at most 5 s.",
    )
    body_size_limit_bytes: int = Field(
        16 * 1024 * 1024,
        gt=0,
        le=1 << 30,
        description="Largest body read; the read stops past it (a vLLM /metrics body is about "
        "60 KiB per engine).",
    )
    sample_limit: int = Field(
        100_000,
        gt=0,
        le=10_000_000,
        description="Most sample lines in one exposition (about 600 per vLLM engine).",
    )

    def deadline_s(self, interval_s: float) -> float:
        """The deadline in force: `timeout_s`, or the interval kept within 2..5 s."""
        if self.timeout_s is not None:
            return self.timeout_s
        return min(max(interval_s, 2.0), 5.0)


class AgentConfig(StrictModel):
    """kvpilot's configuration (`kvpilot run --config FILE`)."""

    listen: ListenConfig = Field(default_factory=ListenConfig, description="HTTP listener.")
    api: ApiConfig = Field(default_factory=ApiConfig, description="Control API security.")
    interval_s: float = Field(
        1.0,
        ge=MIN_INTERVAL_S,
        le=MAX_INTERVAL_S,
        description=f"Seconds between collection ticks ({MIN_INTERVAL_S:g} to "
        f"{MAX_INTERVAL_S:g}: /healthz goes stale after five intervals).",
    )
    state_dir: Path = Field(
        Path("kvpilot-state"), description="Holds kvpilot.db and the servers' logs."
    )
    runtime: RuntimeConfig = Field(description="Where vLLM lives.")
    rules: RulesConfig = Field(default_factory=RulesConfig, description="Alerting rules.")
    notifiers: tuple[NotifierConfig, ...] = Field(
        (), description="Where alerts are sent; every one receives every alert."
    )
    remediation: RemediationConfig = Field(
        default_factory=RemediationConfig, description="Remediation guards."
    )
    retention: RetentionConfig = Field(
        default_factory=RetentionConfig, description="State retention."
    )
    tuning: TuningConfig = Field(
        default_factory=TuningConfig, description="Tuning runs and their schedule."
    )
    scrape: ScrapeConfig = Field(
        default_factory=ScrapeConfig, description="Limits on every read of a source."
    )
    gpu: GpuConfig = Field(
        default_factory=GpuConfig,
        description="GPU facts where NVML cannot give them (dcgm-exporter through Prometheus).",
    )
    exposition: ExpositionConfig = Field(
        default_factory=ExpositionConfig, description="What kvpilot's /metrics carries."
    )

    def api_listen(self) -> ListenConfig:
        """Where the control API answers: its own listener, or the main one."""
        return self.api.listen or self.listen

    @model_validator(mode="before")
    @classmethod
    def _liveness_actions_by_runtime(cls, data: Any) -> Any:
        # A stall or starvation is restarted by default only where kvpilot owns the server.
        if not isinstance(data, Mapping) or not isinstance(data.get("runtime"), Mapping):
            return data
        rules = with_runtime_defaults(data.get("rules"), data["runtime"].get("kind"))
        return data if rules is None else {**data, "rules": rules}

    @model_validator(mode="after")
    def _distinct_listeners(self) -> AgentConfig:
        api = self.api.listen
        if api is not None and api.port == self.listen.port:
            raise ValueError(f"api.listen and listen both want port {api.port}")
        return self

    @model_validator(mode="after")
    def _distinct_notifiers(self) -> AgentConfig:
        require_unique("notifier name", [n.name for n in self.notifiers])
        return self

    @model_validator(mode="after")
    def _schedule_needs_the_local_runtime(self) -> AgentConfig:
        if self.tuning.schedule is not None and not self.runtime.tunes_on_schedule:
            raise ValueError(
                "tuning.schedule needs the local runtime (kvpilot starts the canary itself) "
                "or the pod runtime (canary Deployments)"
            )
        return self


def config_warnings(config: AgentConfig) -> tuple[str, ...]:
    """Settings that are valid but deserve a word to the operator."""
    notes = []
    if config.remediation.light_step_reset_prefix_cache:
        notes.append(
            "remediation.light_step_reset_prefix_cache needs VLLM_SERVER_DEV_MODE=1 on the "
            "server, which exposes unauthenticated admin endpoints: keep its port private"
        )
    for instance in config.runtime.started_instances:
        if "--api-key" in instance.argv or any(a.startswith("--api-key=") for a in instance.argv):
            notes.append(
                f"runtime.instances[{instance.name}]: --api-key in argv is visible to "
                "every user of the machine; set runtime.api_key instead"
            )

    unreachable = unreachable_tuning(config.tuning)
    if unreachable is not None:
        notes.append(unreachable)

    api = config.api_listen()
    if api.host not in {"127.0.0.1", "::1", "localhost"}:
        where = "api.listen.host" if config.api.listen else "listen.host"
        notes.append(f"{where} {api.host!r} exposes the API beyond loopback")
    return tuple(notes)


def secret_values(config: AgentConfig) -> tuple[str, ...]:
    """Every secret in the configuration, so that logging can mask them wherever they appear:
    the SecretStr fields, the secret parts of every URL (a Slack webhook's path included),
    the values of secret flags in argv and of secret-named variables in env."""
    found: list[str] = []

    def walk(value: Any, field: str = "", slack: bool = False) -> None:
        if isinstance(value, SecretStr):
            found.append(value.get_secret_value())
            if field.endswith("url"):
                found.extend(url_secrets(value.get_secret_value(), path_is_secret=slack))
        elif isinstance(value, str) and field.endswith("url"):
            found.extend(url_secrets(value, path_is_secret=slack))
        elif field == "argv" and isinstance(value, tuple):
            found.extend(argv_secrets(value))
        elif field == "env" and isinstance(value, dict):
            found.extend(env_secrets(value))
        elif isinstance(value, BaseModel):
            for name in type(value).model_fields:
                walk(getattr(value, name), name, isinstance(value, SlackNotifierConfig))
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif isinstance(value, list | tuple):
            for item in value:
                walk(item)

    walk(config)
    token = config.api.control_token()
    if token is not None:
        found.append(token.get_secret_value())
    return tuple(dict.fromkeys(s for s in found if s))
