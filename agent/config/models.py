"""The agent's settings: pydantic models, loaded from YAML plus `KVPILOT_*` environment overrides.

Relative paths are relative to the agent's working directory. Secrets are `SecretStr` and
never appear in errors, summaries or logs.
"""

from __future__ import annotations

import ipaddress
import logging
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from kvpilot.agent.config.errors import ConfigError, env_value, format_validation_error, suggest
from kvpilot.agent.config.tuning import TuningConfig
from kvpilot.agent.rules.config import RulesConfig
from kvpilot.collectors.vllm_argv import (
    CLI_MODULE,
    NotAVllmServer,
    ServerArgs,
    is_vllm_server,
    parse_server_argv,
)

log = logging.getLogger(__name__)

ENV_PREFIX = "KVPILOT_"
ENV_NESTING = "__"
_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$"


# Addresses that mean "every interface": a server may listen there, the agent never dials them.
_WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::"})  # noqa: S104 (recognised, not bound)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


Port = Annotated[int, Field(ge=1, le=65535)]


class ListenConfig(_Model):
    """Where the agent serves /metrics, health and its HTTP API."""

    host: str = Field("127.0.0.1", description="Address to bind; loopback unless you mean it.")
    port: Port = Field(9400, description="TCP port for /metrics, /healthz and /api/v1.")


class ApiConfig(_Model):
    """The control API's token: POST endpoints are refused while neither is set."""

    token: SecretStr | None = Field(
        None, description="Bearer token required by the POST endpoints (never logged)."
    )
    token_file: Path | None = Field(
        None, description="A file holding the token (e.g. a mounted Kubernetes Secret)."
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
            text = self.token_file.read_text().strip()
        except OSError as exc:
            raise ConfigError([f"api.token_file: cannot read {self.token_file}: {exc}"]) from exc
        if not text:
            raise ConfigError([f"api.token_file: {self.token_file} is empty"])
        return SecretStr(text)


class InstanceConfig(_Model):
    """One vLLM server that the `local` runtime starts and supervises."""

    name: str = Field(pattern=_NAME, description="Unique instance name, used in labels.")
    role: Literal["stable", "canary"] = Field(
        "stable", description="Canary instances are never remediated (the tuner's judge acts)."
    )
    argv: tuple[str, ...] = Field(
        min_length=2,
        description="The server's command as a list of arguments, never through a shell: "
        "`[vllm, serve, MODEL, ...]` or `[python, -m, vllm.entrypoints.openai.api_server, ...]`.",
    )
    env: dict[str, str] = Field(
        default_factory=dict, description="Extra environment variables for the server."
    )
    kvpool_port: Port | None = Field(
        None, description="Port for the kvpool plugin (KVPILOT_KVPOOL_PORT); unset: plugin idle."
    )
    log_dir: Path | None = Field(
        None, description="Where the server's output goes; default: STATE_DIR/logs."
    )
    cpus: tuple[Annotated[int, Field(ge=0)], ...] = Field(
        (), description="Pin the server and its processes to these CPU numbers; empty: any."
    )

    @field_validator("argv", mode="before")
    @classmethod
    def _argv_is_a_list(cls, value: Any) -> Any:
        if isinstance(value, str):
            raise ValueError(
                "argv must be a list of arguments, not a string "
                "(commands never pass through a shell)"
            )
        return value

    @field_validator("argv")
    @classmethod
    def _argv_starts_vllm(cls, argv: tuple[str, ...]) -> tuple[str, ...]:
        if not is_vllm_server(argv):
            raise ValueError(
                "argv must start a vLLM server: [vllm, serve, MODEL, ...], "
                f"[python, -m, {CLI_MODULE}, serve, MODEL, ...] or "
                "[python, -m, vllm.entrypoints.openai.api_server, --model, MODEL, ...]"
            )
        try:
            parse_server_argv(argv)
        except NotAVllmServer as exc:  # e.g. a --port no server can listen on
            raise ValueError(str(exc)) from None
        return argv

    @property
    def server_args(self) -> ServerArgs:
        """What the argv says about the server, read as the runtime reads it."""
        return parse_server_argv(self.argv)

    @property
    def host(self) -> str:
        """The address the agent reaches the server on (loopback for a wildcard bind)."""
        return self.server_args.probe_host.removeprefix("[").removesuffix("]")

    @property
    def port(self) -> int:
        """The server's `--port` (vLLM's default, 8000, when absent)."""
        return self.server_args.port

    @property
    def url(self) -> str:
        return self.server_args.url


class _RuntimeBase(_Model):
    api_key: SecretStr | None = Field(
        None, description="The vLLM server's --api-key, sent on probes (never logged)."
    )
    drain_timeout_s: float = Field(
        30.0, gt=0, description="After SIGTERM, how long vLLM may drain before SIGKILL."
    )
    ready_timeout_s: float = Field(
        240.0, gt=0, description="How long a (re)started server may take to become healthy."
    )


class LocalRuntimeConfig(_RuntimeBase):
    """kvpilot starts, supervises and restarts the vLLM servers itself."""

    kind: Literal["local"] = Field(description="The embedded runtime.")
    instances: tuple[InstanceConfig, ...] = Field(min_length=1, description="The servers to start.")

    @model_validator(mode="after")
    def _distinct(self) -> LocalRuntimeConfig:
        _require_unique("instance name", [i.name for i in self.instances])
        _require_unique("server address", [f"{i.host}:{i.port}" for i in self.instances])
        kvpool = [i.kvpool_port for i in self.instances if i.kvpool_port is not None]
        _require_unique("kvpool_port", kvpool)
        clash = set(kvpool) & {i.port for i in self.instances}
        if clash:
            raise ValueError(f"kvpool_port {min(clash)} is also a server's --port")
        return self


class ProcessRuntimeConfig(_RuntimeBase):
    """Attach to a vLLM server that something else supervises (kubelet, systemd).

    The server is the one process (the root of its tree) whose command line is a vLLM launch
    form with `--port` equal to `port` and, when set, listening where `host` says and matching
    `cmdline_regex`. When none or several match, nothing is signalled.
    """

    kind: Literal["process"] = Field(description="Find the server by its command line.")
    name: str = Field("vllm", pattern=_NAME, description="Instance name, used in labels.")
    cmdline_regex: str | None = Field(
        None,
        description="A regular expression searched (not anchored) in the process's arguments "
        "joined by single spaces; only a process it is found in is the server. Unset: any vLLM "
        "server in either launch form (with the port, and host if set).",
    )
    host: str | None = Field(
        None,
        description="Where the agent reaches the server. Set: only a server listening there "
        "matches: its --host equals this (as text, case and IPv6 brackets aside; names are not "
        "resolved), or is absent, 0.0.0.0 or :: (every address, vLLM's default). Unset: any "
        "--host, reached where it listens (loopback for every address).",
    )
    port: Port = Field(description="The server's --port (8000 when absent); tells servers apart.")
    kvpool_port: Port | None = Field(None, description="The kvpool plugin's port, if enabled.")

    @field_validator("cmdline_regex")
    @classmethod
    def _compiles(cls, pattern: str | None) -> str | None:
        if pattern is not None:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"not a regular expression: {exc}") from exc
        return pattern

    @field_validator("host")
    @classmethod
    def _an_address(cls, host: str | None) -> str | None:
        if host is None:
            return None
        bare = host.removeprefix("[").removesuffix("]")
        if bare in _WILDCARD_HOSTS:
            raise ValueError(
                "host is where the agent reaches the server, not a wildcard (a server listening "
                "on every address matches any host; leave host unset to match any --host)"
            )
        if not (_is_ipv6(bare) if ":" in bare else re.fullmatch(r"[A-Za-z0-9_.-]+", bare)):
            raise ValueError("must be a host name or an IP address (no scheme, port or path)")
        return bare

    @property
    def url(self) -> str:
        host = self.host or "127.0.0.1"
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}"


def _is_ipv6(text: str) -> bool:
    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        return False
    return True


class AttachedServerConfig(_Model):
    """One server the `attach` runtime watches by its URL."""

    name: str = Field(pattern=_NAME, description="Unique server name, used in labels.")
    url: str = Field(description="The server's base URL, e.g. http://127.0.0.1:8000.")
    kvpool_url: str | None = Field(None, description="The kvpool plugin's URL, if enabled.")
    role: Literal["stable", "canary"] = Field("stable", description="Labels only.")
    pids: tuple[Annotated[int, Field(gt=0)], ...] = Field(
        (), description="The server's PIDs, to tell its GPU memory apart in NVML."
    )
    served_model_config: Path | None = Field(
        None,
        description="The served model's config.json: the planner's prediction is compared "
        "with the server's KV blocks.",
    )

    @field_validator("url", "kvpool_url")
    @classmethod
    def _http(cls, url: str | None) -> str | None:
        return None if url is None else _check_http_url(url).rstrip("/")


class AttachRuntimeConfig(_RuntimeBase):
    """Watch servers by URL: collect, alert and notify; never signal or restart them."""

    kind: Literal["attach"] = Field(description="Servers known only by their URLs.")
    servers: tuple[AttachedServerConfig, ...] = Field(
        min_length=1, description="The servers to watch."
    )

    @model_validator(mode="after")
    def _distinct(self) -> AttachRuntimeConfig:
        _require_unique("server name", [s.name for s in self.servers])
        _require_unique("server url", [s.url for s in self.servers])
        return self


RuntimeConfig = Annotated[
    LocalRuntimeConfig | ProcessRuntimeConfig | AttachRuntimeConfig, Field(discriminator="kind")
]


def _require_unique(what: str, values: list[Any]) -> None:
    seen: set[Any] = set()
    for value in values:
        if value in seen:
            raise ValueError(f"{what} {value!r} appears twice")
        seen.add(value)


def _check_http_url(url: str) -> str:
    if not re.match(r"^https?://[^/\s]+", url):
        raise ValueError("must be an http:// or https:// URL")
    return url


_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # RFC 9110's token


def _check_headers(headers: dict[str, SecretStr]) -> dict[str, SecretStr]:
    """Header names and values that make a valid request; values are never shown."""
    for name, value in headers.items():
        if not _HEADER_NAME.fullmatch(name):
            raise ValueError(f"{name!r} is not a header name (letters, digits, -_.!#$%&'*+^`|~)")
        text = value.get_secret_value()
        if "\r" in text or "\n" in text:
            raise ValueError(f"header {name!r}: the value has a line break")
        if any((ord(c) < 32 and c != "\t") or ord(c) == 127 for c in text):
            raise ValueError(f"header {name!r}: the value has a control character")
    return headers


class _NotifierBase(_Model):
    name: str = Field(
        "",  # filled with the kind before validation; the schema shows it as optional
        pattern=_NAME,
        description="Unique name; keys this receiver's outbox rows (default: the kind).",
    )
    timeout_s: float = Field(
        10.0,
        gt=0,
        allow_inf_nan=False,
        description="Seconds one request may take, connecting to answer, before it is retried.",
    )
    send_resolved: bool = Field(True, description="Also notify when an alert resolves.")

    @field_validator("timeout_s", mode="before")
    @classmethod
    def _seconds_not_a_flag(cls, value: Any) -> Any:
        if isinstance(value, bool):  # pydantic would read true as 1 s
            raise ValueError("must be a number of seconds, not true or false")
        return value

    @model_validator(mode="before")
    @classmethod
    def _default_name(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and "name" not in data and isinstance(data.get("kind"), str):
            return {**data, "name": data["kind"]}
        return data


class WebhookNotifierConfig(_NotifierBase):
    """Posts Alertmanager's webhook payload (version 4) to any receiver written for it."""

    kind: Literal["webhook"] = Field(description="Alertmanager-compatible webhook.")
    url: str = Field(description="The receiver's URL.")
    headers: dict[str, SecretStr] = Field(
        default_factory=dict, description="Extra request headers (values are secrets)."
    )
    hmac_secret: SecretStr | None = Field(
        None, description="Signs each body with HMAC-SHA256 when set (never logged)."
    )
    repeat_interval_s: float = Field(
        4 * 3600.0, gt=0, description="Re-send a still-firing alert this often."
    )

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        return _check_http_url(url)

    @field_validator("headers")
    @classmethod
    def _valid_headers(cls, headers: dict[str, SecretStr]) -> dict[str, SecretStr]:
        return _check_headers(headers)


class AlertmanagerAuth(_Model):
    """Basic or bearer authentication for Alertmanager's API."""

    username: str | None = Field(None, description="Basic-auth user.")
    password: SecretStr | None = Field(None, description="Basic-auth password.")
    bearer_token: SecretStr | None = Field(None, description="Bearer token.")

    @model_validator(mode="after")
    def _one_scheme(self) -> AlertmanagerAuth:
        basic = self.username is not None or self.password is not None
        if basic and self.bearer_token is not None:
            raise ValueError("use basic auth (username, password) or bearer_token, not both")
        if basic and (self.username is None or self.password is None):
            raise ValueError("basic auth needs both username and password")
        return self


class AlertmanagerNotifierConfig(_NotifierBase):
    """Pushes alerts to a real Alertmanager through `/api/v2/alerts`."""

    kind: Literal["alertmanager"] = Field(description="Alertmanager's v2 API.")
    url: str = Field(description="Alertmanager's base URL, e.g. http://alertmanager:9093.")
    auth: AlertmanagerAuth | None = Field(None, description="Credentials, if required.")
    headers: dict[str, SecretStr] = Field(
        default_factory=dict,
        description="Extra headers on every push, e.g. X-Scope-OrgID for a multi-tenant "
        "Alertmanager (values are secrets; Authorization only without auth).",
    )
    repeat_interval_s: float = Field(
        60.0,
        gt=0,
        description="Re-push firing alerts this often (Alertmanager resolves an alert whose "
        "endsAt passes without a re-push).",
    )

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        return _check_http_url(url)

    @field_validator("headers")
    @classmethod
    def _valid_headers(
        cls, headers: dict[str, SecretStr], info: ValidationInfo
    ) -> dict[str, SecretStr]:
        if info.data.get("auth") is not None and "authorization" in {k.lower() for k in headers}:
            raise ValueError("auth sets the Authorization header: remove it from headers")
        return _check_headers(headers)


class SlackNotifierConfig(_NotifierBase):
    """Slack-compatible incoming-webhook text."""

    # Fields that once were, and why they went: the error says so instead of "unknown field".
    retired_fields: ClassVar[dict[str, str]] = {
        "channel": "Slack app incoming webhooks post to the channel chosen when the webhook "
        "was created and ignore a channel field; remove it (one webhook per channel)",
    }

    kind: Literal["slack"] = Field(description="Slack-compatible incoming webhook.")
    url: SecretStr = Field(
        description="The incoming-webhook URL (a secret: it holds the token); it posts to the "
        "channel chosen when the webhook was created."
    )
    repeat_interval_s: float = Field(
        4 * 3600.0, gt=0, description="Re-send a still-firing alert this often."
    )

    @field_validator("url")
    @classmethod
    def _slack_url(cls, url: SecretStr) -> SecretStr:
        _check_http_url(url.get_secret_value())
        return url


NotifierConfig = Annotated[
    WebhookNotifierConfig | AlertmanagerNotifierConfig | SlackNotifierConfig,
    Field(discriminator="kind"),
]


class BudgetConfig(_Model):
    """At most `max_restarts` restarts of one instance per sliding window."""

    max_restarts: int = Field(3, ge=0, description="Restarts allowed per window (0: none).")
    window_s: float = Field(3600.0, gt=0, description="The sliding window's length.")


class CircuitBreakerConfig(_Model):
    """Stops restarting (and pages) when restarts do not keep the condition away."""

    failures_to_open: int = Field(
        2, ge=1, description="Failed restarts in a row that open the breaker."
    )
    hold_s: float = Field(
        600.0,
        gt=0,
        description="A restart failed when its condition fires again within this time.",
    )
    open_for_s: float | None = Field(
        None, gt=0, description="Close again after this long; unset: until an operator closes it."
    )


class PreflightConfig(_Model):
    """Checks that the server will have the memory to start again before stopping it."""

    enabled: bool = Field(True, description="Run the memory check before every restart.")
    unknown_blocks_restart: bool = Field(
        False, description="When the memory cannot be measured, refuse the restart."
    )
    margin_ratio: float = Field(
        0.05, ge=0, le=1, description="Headroom required beyond the server's own budget."
    )


class RemediationConfig(_Model):
    """The remediation ladder's guards and timings."""

    dry_run: bool = Field(False, description="Decide and audit, but never act.")
    cooldown_s: float = Field(300.0, ge=0, description="Minimum time between two actions.")
    budget: BudgetConfig = Field(default_factory=BudgetConfig, description="Restart budget.")
    circuit_breaker: CircuitBreakerConfig = Field(
        default_factory=CircuitBreakerConfig, description="When restarting stops helping."
    )
    preflight: PreflightConfig = Field(
        default_factory=PreflightConfig, description="Memory check before a restart."
    )
    drain_timeout_s: float = Field(
        60.0,
        ge=0,
        description="Before a restart, wait up to this long for running requests to finish "
        "(0: rely on the server's own SIGTERM drain).",
    )
    verify_timeout_s: float = Field(
        300.0, gt=0, description="After a restart: healthy and a probe answered, within this."
    )
    light_step_reset_prefix_cache: bool = Field(
        False,
        description="Try vLLM's /reset_prefix_cache before restarting. Needs "
        "VLLM_SERVER_DEV_MODE=1, whose endpoints are unauthenticated.",
    )


class RetentionConfig(_Model):
    """How long rows are kept in the state database."""

    outbox_days: float = Field(7.0, gt=0, description="Delivered or abandoned notifications.")
    audit_days: float = Field(90.0, gt=0, description="Audit records.")
    remediations_days: float = Field(90.0, gt=0, description="Finished remediations.")
    silences_days: float = Field(30.0, gt=0, description="Silences after they end.")


class AgentConfig(_Model):
    """kvpilot's configuration (`kvpilot run --config FILE`)."""

    listen: ListenConfig = Field(default_factory=ListenConfig, description="HTTP listener.")
    api: ApiConfig = Field(default_factory=ApiConfig, description="Control API security.")
    interval_s: float = Field(1.0, gt=0, description="Seconds between collection ticks.")
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

    @model_validator(mode="after")
    def _distinct_notifiers(self) -> AgentConfig:
        _require_unique("notifier name", [n.name for n in self.notifiers])
        return self

    @model_validator(mode="after")
    def _schedule_needs_the_local_runtime(self) -> AgentConfig:
        if self.tuning.schedule is not None and not isinstance(self.runtime, LocalRuntimeConfig):
            raise ValueError(
                "tuning.schedule needs the local runtime (kvpilot starts the canary itself)"
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
    if isinstance(config.runtime, LocalRuntimeConfig):
        for instance in config.runtime.instances:
            if "--api-key" in instance.argv or any(
                a.startswith("--api-key=") for a in instance.argv
            ):
                notes.append(
                    f"runtime.instances[{instance.name}]: --api-key in argv is visible to "
                    "every user of the machine; set runtime.api_key instead"
                )
    if config.listen.host not in {"127.0.0.1", "::1", "localhost"}:
        notes.append(f"listen.host {config.listen.host!r} exposes the API beyond loopback")
    return tuple(notes)


def load_config(
    path: Path | None, environ: Mapping[str, str] | None = None, *, warn: bool = True
) -> AgentConfig:
    """The YAML file (if any), then `KVPILOT_*` overrides from `environ`, validated."""
    return validate_config(_read_yaml(path) if path is not None else {}, environ, warn=warn)


def validate_config(
    data: dict[str, Any], environ: Mapping[str, str] | None = None, *, warn: bool = True
) -> AgentConfig:
    """Settings given as data (a parsed YAML, or built from command-line options), then
    `KVPILOT_*` overrides from `environ`, validated."""
    sources: dict[tuple[str, ...], str] = {}
    if environ is not None:
        data, sources = apply_env_overrides(data, environ)
    try:
        config = AgentConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, AgentConfig, data, sources)) from None
    if warn:
        for note in config_warnings(config):
            log.warning("%s", note)
    return config


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError([f"{path}: cannot read: {exc.strerror or exc}"]) from exc
    except UnicodeDecodeError as exc:
        raise ConfigError([f"{path}: not UTF-8 text: {exc.reason} at byte {exc.start}"]) from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError([f"{path}: not valid YAML: {exc}"]) from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([f"{path}: the top level must be a mapping, not {type(data).__name__}"])
    return data


def apply_env_overrides(
    data: dict[str, Any], environ: Mapping[str, str]
) -> tuple[dict[str, Any], dict[tuple[str, ...], str]]:
    """Overlays `KVPILOT_SECTION__FIELD=value` on `data`; returns it and where each came from.

    Variables without `__` whose name is no top-level field belong to other parts of kvpilot
    (e.g. the plugin's `KVPILOT_KVPOOL_PORT`) and are left alone.
    """
    merged = _deep_copy(data)
    sources: dict[tuple[str, ...], str] = {}
    problems: list[str] = []
    top = set(AgentConfig.model_fields)
    for name in sorted(environ):
        if not name.startswith(ENV_PREFIX):
            continue
        parts = [p.lower() for p in name[len(ENV_PREFIX) :].split(ENV_NESTING)]
        if any(not p for p in parts):
            problems.append(f"{name}: empty name segment")
            continue
        if parts[0] not in top:
            if len(parts) > 1:
                problems.append(f"{name}: {parts[0]}: unknown field{suggest(parts[0], top)}")
            continue
        try:
            _set_path(merged, parts, env_value(AgentConfig, parts, environ[name], merged))
        except ValueError as exc:
            problems.append(f"{name}: {exc}")
            continue
        sources[tuple(parts)] = name
    if problems:
        raise ConfigError(problems)
    return merged, sources


def _deep_copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _deep_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_deep_copy(v) for v in value]
    return value


def _set_path(data: dict[str, Any], parts: list[str], value: Any) -> None:
    node: Any = data
    for depth, part in enumerate(parts[:-1]):
        here = ".".join(parts[: depth + 1])
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ValueError(f"{here}: no list item {part} to override")
            node = node[int(part)]
            continue
        child = node.setdefault(part, {})
        if not isinstance(child, dict | list):
            raise ValueError(f"{here} is {type(child).__name__}, not a mapping")
        node = child
    last = parts[-1]
    if isinstance(node, list):
        if not last.isdigit() or int(last) >= len(node):
            raise ValueError(f"{'.'.join(parts)}: no list item {last} to override")
        node[int(last)] = value
    else:
        node[last] = value


def secret_values(config: AgentConfig) -> tuple[str, ...]:
    """Every secret in the configuration, so that logging can mask them wherever they appear."""
    found: list[str] = []

    def walk(value: Any) -> None:
        if isinstance(value, SecretStr):
            found.append(value.get_secret_value())
        elif isinstance(value, BaseModel):
            for name in type(value).model_fields:
                walk(getattr(value, name))
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
    return tuple(s for s in found if s)
