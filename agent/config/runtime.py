"""The `runtime:` section: where vLLM lives (local, process, pod, attach)."""

from __future__ import annotations

import ipaddress
import re
import socket
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    SecretStr,
    field_validator,
    model_validator,
)

from kvpilot.agent.config.base import (
    NAME,
    Port,
    check_http_url,
    require_unique,
)
from kvpilot.agent.config.kubernetes import KubernetesConfig
from kvpilot.agent.strict_model import StrictModel
from kvpilot.collectors.addresses import LOCALHOST_NAMES, WILDCARD_HOSTS
from kvpilot.collectors.secrets import mask_url
from kvpilot.collectors.vllm_argv import (
    CLI_MODULE,
    NotAVllmServer,
    ServerArgs,
    is_vllm_server,
    launch_form,
    parse_server_argv,
)


class InstanceConfig(StrictModel):
    """One vLLM server that the `local` runtime starts and supervises."""

    name: str = Field(pattern=NAME, description="Unique instance name, used in labels.")
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


class _RuntimeBase(StrictModel):
    api_key: SecretStr | None = Field(
        None, description="The vLLM server's --api-key, sent on probes (never logged)."
    )
    drain_timeout_s: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="After SIGTERM, how long vLLM may drain before SIGKILL (at most an hour).",
    )
    ready_timeout_s: float = Field(
        240.0,
        gt=0,
        le=86400,
        description="How long a (re)started server may take to become healthy (at most a day).",
    )

    @property
    def started_instances(self) -> tuple[InstanceConfig, ...]:
        """The servers kvpilot starts itself, with their configured flags: none but the
        local runtime's (the others' servers are started by something else)."""
        return ()

    @property
    def tunes_on_schedule(self) -> bool:
        """Whether `tuning.schedule` can run here: kvpilot starts the canary itself (the local
        runtime) or as a Deployment (the pod runtime)."""
        return False

    @property
    def needed_extra(self) -> str | None:
        """The extra of pyproject.toml this runtime's client comes from, or None."""
        return None

    def summary_lines(self) -> list[str]:
        """How `kvpilot config check` describes this runtime, secrets masked."""
        raise NotImplementedError


class LocalRuntimeConfig(_RuntimeBase):
    """kvpilot starts, supervises and restarts the vLLM servers itself."""

    kind: Literal["local"] = Field(description="The embedded runtime.")
    instances: tuple[InstanceConfig, ...] = Field(min_length=1, description="The servers to start.")

    @property
    def started_instances(self) -> tuple[InstanceConfig, ...]:
        return self.instances

    @property
    def tunes_on_schedule(self) -> bool:
        return True

    def summary_lines(self) -> list[str]:
        lines = [f"runtime: local, {len(self.instances)} instance(s)"]
        for inst in self.instances:
            kvpool = f", kvpool :{inst.kvpool_port}" if inst.kvpool_port else ""
            form = launch_form(inst.argv)
            lines.append(f"  {inst.name} ({inst.role}) {mask_url(inst.url)}, {form} form{kvpool}")
        return lines

    @model_validator(mode="after")
    def _distinct(self) -> LocalRuntimeConfig:
        require_unique("instance name", [i.name for i in self.instances])
        require_unique("server address", [f"{i.host}:{i.port}" for i in self.instances])
        for i, a in enumerate(self.instances):
            for b in self.instances[i + 1 :]:
                if a.port == b.port and _binds_overlap(a.server_args.host, b.server_args.host):
                    raise ValueError(
                        f"instances {a.name!r} and {b.name!r} both listen on port {a.port} "
                        f"(--host {a.server_args.host or 'absent'} and "
                        f"{b.server_args.host or 'absent'} share an address)"
                    )
        kvpool = [i.kvpool_port for i in self.instances if i.kvpool_port is not None]
        require_unique("kvpool_port", kvpool)
        clash = set(kvpool) & {i.port for i in self.instances}
        if clash:
            raise ValueError(f"kvpool_port {min(clash)} is also a server's --port")
        return self


class _ProcessFields(_RuntimeBase):
    """How the server is found among the processes: shared by the process and pod runtimes.

    The server is the one process (the root of its tree) whose command line is a vLLM launch
    form with `--port` equal to `port` and, when set, listening where `host` says and matching
    `cmdline_regex`. When none or several match, nothing is signalled.
    """

    name: str = Field("vllm", pattern=NAME, description="Instance name, used in labels.")
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
    expected_uid: int | None = Field(
        None,
        ge=0,
        description="The user id the server runs as (real and effective); a process of "
        "another user is never the server. Unset: the agent's own uid. Images that run vLLM "
        "as root need 0 here.",
    )

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
        if bare in WILDCARD_HOSTS:
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


class ProcessRuntimeConfig(_ProcessFields):
    """Attach to a vLLM server that something else supervises (kubelet, systemd)."""

    kind: Literal["process"] = Field(description="Find the server by its command line.")

    def summary_lines(self) -> list[str]:
        return [f"runtime: process, {self.name} at {mask_url(self.url)}"]


class PodRuntimeConfig(_ProcessFields):
    """The sidecar in vLLM's pod: vLLM is restarted by signal (as the process runtime does),
    the Kubernetes API runs the tuner's canary Deployments and promotions."""

    kind: Literal["pod"] = Field(description="The sidecar container beside vLLM in one pod.")
    served_model_config: Path | None = Field(
        None,
        alias="model_config",
        description="The model's config.json (or its folder), for the planner. Unset: the "
        "folder --model names when it is mounted, else the Hugging Face cache (HF_HUB_CACHE, "
        "else HF_HOME/hub) snapshot of the model id.",
    )
    kubernetes: KubernetesConfig = Field(
        default_factory=KubernetesConfig, description="The Deployment and how to change it."
    )

    @property
    def tunes_on_schedule(self) -> bool:
        return True

    @property
    def needed_extra(self) -> str | None:
        return "kubernetes"

    def summary_lines(self) -> list[str]:
        k8s = self.kubernetes
        deployment = k8s.deployment or "(the pod's own, from its ownerReferences)"
        where = f"{k8s.namespace or '(the pod namespace)'}/{deployment}"
        return [
            f"runtime: pod, {self.name} at {mask_url(self.url)}, Deployment {where}, "
            f"promote {k8s.promote}, restart by {k8s.restart}"
        ]


_EVERY_ADDRESS = "*"
_LOCALHOST = frozenset({"127.0.0.1", "::1"})  # what `localhost` resolves to, by convention


def _bound_addresses(host: str | None) -> frozenset[str]:
    """The addresses a `--host` binds, as far as can be told without resolving names."""
    if host is None:
        return frozenset({_EVERY_ADDRESS})
    bare = host.removeprefix("[").removesuffix("]").lower()
    if bare in WILDCARD_HOSTS:
        return frozenset({_EVERY_ADDRESS})
    if bare in LOCALHOST_NAMES:
        return _LOCALHOST
    try:
        return frozenset({str(ipaddress.ip_address(bare))})
    except ValueError:
        pass
    if re.fullmatch(r"[0-9.]+", bare):  # 127.000.000.001, 127.1: what inet_aton reads
        try:
            return frozenset({socket.inet_ntoa(socket.inet_aton(bare))})
        except OSError:
            pass
    return frozenset({bare})  # another name: equal only to itself


def _binds_overlap(a: str | None, b: str | None) -> bool:
    """Whether two servers with these `--host`s cannot both bind one port."""
    left, right = _bound_addresses(a), _bound_addresses(b)
    return _EVERY_ADDRESS in left or _EVERY_ADDRESS in right or bool(left & right)


def _is_ipv6(text: str) -> bool:
    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        return False
    return True


class AttachedServerConfig(StrictModel):
    """One server the `attach` runtime watches by its URL."""

    name: str = Field(pattern=NAME, description="Unique server name, used in labels.")
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
        return None if url is None else check_http_url(url).rstrip("/")


class AttachRuntimeConfig(_RuntimeBase):
    """Watch servers by URL: collect, alert and notify; never signal or restart them."""

    kind: Literal["attach"] = Field(description="Servers known only by their URLs.")
    servers: tuple[AttachedServerConfig, ...] = Field(
        min_length=1, description="The servers to watch."
    )

    @model_validator(mode="after")
    def _distinct(self) -> AttachRuntimeConfig:
        require_unique("server name", [s.name for s in self.servers])
        require_unique("server url", [s.url for s in self.servers])
        return self

    def summary_lines(self) -> list[str]:
        return [
            f"runtime: attach (watch only), {len(self.servers)} server(s)",
            *(f"  {s.name} ({s.role}) {mask_url(s.url)}" for s in self.servers),
        ]


RuntimeConfig = Annotated[
    LocalRuntimeConfig | ProcessRuntimeConfig | PodRuntimeConfig | AttachRuntimeConfig,
    Field(discriminator="kind"),
]
