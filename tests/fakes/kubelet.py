"""A fake kubelet for the fake API server: a real CPU vLLM for each pod it schedules.

No container runtime runs on these machines; this stands in for the kubelet (and the
scheduler) of one node. Every `poll_s` it reads the fake's live pods (through the fake's
own state, under its lock, as a watch would deliver them). For a new pod it starts the
pod's `vllm` container command as a real process (`python` is this interpreter, `--host`
is the pod's own loopback address 127.0.0.N, the kvpool plugin off, pinned to a free core)
in its own process group; once vLLM answers /health it marks the pod ready; a process that
exits first marks the pod crash-looping with the log tail as its termination message. A pod
that is gone (deleted, replaced by a rollout, its Deployment being deleted) has its process
group stopped (SIGTERM, SIGKILL after the grace). It never runs more than `max_servers` at
once: a pod beyond that is refused and recorded in `errors`. `close()` stops everything.

`KubeletApi` is the fake API server for it: its pods turn ready only when the kubelet says
so, and a Deployment's available replicas are its ready pods, as the Deployment controller
counts them (the plain fake calls every replica available at once).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvpilot.rig.server import ServerSpec, build_env, stop_process_group
from tests.fakes.k8s_apiserver import FakeKubernetesApi

NEVER = 10**9  # pod lists after which the plain fake would call a pod ready: never


def _ready(pod: dict[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or ()
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


class KubeletApi(FakeKubernetesApi):
    """The fake API server whose pods only the kubelet makes ready (see the module doc)."""

    def __init__(self, kubelet: FakeKubelet, **kwargs: Any) -> None:
        super().__init__(pod_ip=kubelet.pod_ip, ready_lists=NEVER, **kwargs)
        kubelet.api = self

    def _settle(self, entry: Any) -> None:
        super()._settle(entry)
        ready = sum(1 for pod in entry.pods if _ready(pod))
        entry.obj["status"].update(readyReplicas=ready, availableReplicas=ready)


@dataclass
class PodProcess:
    """One pod's vLLM process."""

    pod: str
    role: str
    ip: str
    argv: tuple[str, ...]
    process: subprocess.Popen[bytes]
    log_path: Path
    cpus: tuple[int, ...]
    started_s: float
    ready_s: float | None = None

    def log_tail(self, limit: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-limit:]
        except OSError as exc:
            return f"(log unreadable: {exc})"


@dataclass
class FakeKubelet:
    """One node's kubelet over the fake API server (see the module doc)."""

    namespace: str
    container: str = "vllm"
    cpus: tuple[int, ...] = (0, 1)
    max_servers: int = 2
    poll_s: float = 0.25
    grace_s: float = 15.0
    api: FakeKubernetesApi | None = None
    running: dict[str, PodProcess] = field(default_factory=dict)
    started: list[PodProcess] = field(default_factory=list)  # every start, in order
    stopped: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    _ips: dict[str, str] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _logs: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="kubelet-")))

    def pod_ip(self, pod: dict[str, Any]) -> str:
        """The pod's own loopback address, 127.0.0.2 on, one per pod for its lifetime."""
        name = pod["metadata"]["name"]
        if name not in self._ips:
            self._ips[name] = f"127.0.0.{len(self._ips) + 2}"
        return self._ips[name]

    def __enter__(self) -> FakeKubelet:
        self._thread = threading.Thread(target=self._run, name="fake-kubelet", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.grace_s + 30)
        for name in list(self.running):
            self._stop_pod(name)

    def wait_ready(self, role: str, timeout_s: float = 240.0) -> PodProcess:
        """The running pod of `role` once its vLLM answers, or an error at the deadline."""
        deadline = time.monotonic() + timeout_s
        while True:
            found = [p for p in self.running.values() if p.role == role and p.ready_s]
            if found:
                return found[0]
            if self.errors or time.monotonic() > deadline:
                raise AssertionError(f"no ready {role} pod: {self.errors or 'deadline passed'}")
            time.sleep(0.1)

    # -- the sync loop -------------------------------------------------------------------

    def _run(self) -> None:
        with httpx.Client(timeout=1.0) as http:
            while not self._stop.is_set():
                try:
                    self._sync(http)
                except Exception as exc:  # a bug here must fail the test, not hang it
                    self.errors.append(f"kubelet: {exc!r}")
                self._stop.wait(self.poll_s)

    def _pods(self) -> dict[str, dict[str, Any]]:
        assert self.api is not None
        with self.api._lock:
            return {p["metadata"]["name"]: p for p in self.api._live_pods(self.namespace)}

    def _sync(self, http: httpx.Client) -> None:
        pods = self._pods()
        for name in [n for n in self.running if n not in pods]:
            self._stop_pod(name)  # stopped before anything starts: never over the limit
        for name, pod in pods.items():
            if name not in self.running and name not in self.stopped:
                self._start_pod(pod)
        for proc in list(self.running.values()):
            if proc.ready_s is None:
                self._check(proc, http)

    def _start_pod(self, pod: dict[str, Any]) -> None:
        name = pod["metadata"]["name"]
        if len(self.running) >= self.max_servers:
            message = f"pod {name} refused: {self.max_servers} servers run already"
            if message not in self.errors:
                self.errors.append(message)
            return
        container = next(c for c in pod["spec"]["containers"] if c["name"] == self.container)
        ip = self.pod_ip(pod)
        argv = _argv(container.get("command") or (), container.get("args") or (), ip)
        busy = {cpu for p in self.running.values() for cpu in p.cpus}
        cpus = tuple(c for c in self.cpus if c not in busy)[:1] or self.cpus[:1]
        env = build_env(ServerSpec(port=0, plugin_enabled=False))
        log_path = self._logs / f"{name}.log"
        with log_path.open("ab") as log:
            process = subprocess.Popen(  # the pod's own argv, never a shell
                argv,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=lambda: os.sched_setaffinity(0, cpus),
            )
        role = pod["metadata"]["labels"].get("kvpilot.dev/role", "")
        proc = PodProcess(name, role, ip, argv, process, log_path, cpus, time.monotonic())
        self.running[name] = proc
        self.started.append(proc)

    def _check(self, proc: PodProcess, http: httpx.Client) -> None:
        assert self.api is not None
        if proc.process.poll() is not None:
            self.errors.append(f"pod {proc.pod}: vLLM exited with {proc.process.returncode}")
            with self.api._lock:  # crash-looping, vLLM's last words as its message
                self.api.crash[proc.role] = ("CrashLoopBackOff", proc.log_tail())
                _, pod = self.api._find_pod(self.namespace, proc.pod)
                if pod is not None:
                    self.api._make_ready(pod)
            self.running.pop(proc.pod)
            self.stopped.append(proc.pod)
            return
        port = _flag(proc.argv, "--port")
        with contextlib.suppress(httpx.HTTPError):
            if http.get(f"http://{proc.ip}:{port}/health").status_code == 200:
                proc.ready_s = time.monotonic()
                with contextlib.suppress(KeyError):  # deleted in between
                    self.api.set_pod_ready(self.namespace, proc.pod, True)

    def _stop_pod(self, name: str) -> None:
        proc = self.running.pop(name)
        stop_process_group(proc.process, self.grace_s)
        self.stopped.append(name)


def _flag(argv: tuple[str, ...], name: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def _argv(command: Any, args: Any, ip: str) -> tuple[str, ...]:
    """The container's command line on this node: this Python, the pod's address."""
    out: list[str] = []
    skip = False
    for arg in [*command, *args]:
        if skip:
            skip = False
            continue
        if arg == "--host":
            skip = True
            continue
        if not arg.startswith("--host="):
            out.append(arg)
    if out and Path(out[0]).name in ("python", "python3"):
        out[0] = sys.executable
    return (*out, "--host", ip)
