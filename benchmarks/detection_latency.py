"""Detection latency: from the first preemption (the plugin's engine-side timestamp) to the
webhook received, for kvpilot at 1 s ticks and, in the same run, for a standard Prometheus +
Alertmanager pipeline at their default intervals evaluating the equivalent rule.

    .venv/bin/python benchmarks/detection_latency.py            # both pipelines
    .venv/bin/python benchmarks/detection_latency.py --kvpilot-only

Everything is real and local: the CPU vLLM with the kvpool plugin (started by `kvpilot run
--config` under the local runtime), Debian's Prometheus and Alertmanager, one HTTP receiver
that records when each webhook arrived. Goal: kvpilot under 5 s. Prometheus's defaults
(scrape and evaluation every 1 m, Alertmanager's group_wait 30 s) put it near a minute or
more; the ratio is printed. A benchmark only: it takes minutes and is not part of CI.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvpilot.collectors.promtext import parse_samples  # noqa: E402
from kvpilot.rig.server import ServerSpec, build_argv, free_kvpool_port, free_port  # noqa: E402
from kvpilot.tuner.load.generator import LengthDist, Workload, run_load  # noqa: E402

KV_BYTES = 64 * 32 * 1024  # 63 usable blocks of 32 tokens: the load below preempts


class Arrivals:
    """A webhook receiver noting the wall time each VllmPreemptionSpike firing arrived, by path."""

    def __init__(self) -> None:
        self.port = free_port()
        self.first: dict[str, float] = {}
        self._lock = threading.Lock()
        arrivals = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                now = time.time()
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self.send_response(200)
                self.end_headers()
                try:
                    alerts = json.loads(body).get("alerts", [])
                except ValueError:
                    return
                firing = any(
                    a.get("status") == "firing"
                    and a.get("labels", {}).get("alertname") == "VllmPreemptionSpike"
                    for a in alerts
                )
                if firing:
                    with arrivals._lock:
                        arrivals.first.setdefault(self.path, now)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def close(self) -> None:
        self._server.shutdown()


def _start(argv: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    with log.open("ab") as out:
        return subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )


def _stop(process: subprocess.Popen | None) -> None:
    if process is None or process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def _wait(what: str, probe, timeout_s: float, poll_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            value = probe()
            if value:
                return value
        except httpx.HTTPError:
            pass
        time.sleep(poll_s)
    raise SystemExit(f"timed out waiting for {what}")


def _agent_config(tmp: Path, spec: ServerSpec, port: int, hook: str) -> Path:
    config = {
        "listen": {"port": port},
        "interval_s": 1.0,
        "state_dir": str(tmp / "state"),
        "runtime": {
            "kind": "local",
            "instances": [
                {
                    "name": "vllm",
                    "argv": build_argv(spec),
                    "env": {"HF_HUB_OFFLINE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"},
                    "kvpool_port": spec.kvpool_port,
                }
            ],
        },
        # The product's rule, defaults except the action: detection is what is measured.
        "rules": {"preemption_spike": {"action": "alert"}},
        "notifiers": [{"kind": "webhook", "url": hook}],
    }
    path = tmp / "kvpilot.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _prometheus(tmp: Path, kvpool: str, alertmanager_port: int) -> list[str]:
    rules = tmp / "rules.yml"
    # The equivalent rule on the plugin's lag-free counter: any preemption, no `for`.
    rules.write_text(
        yaml.safe_dump(
            {
                "groups": [
                    {
                        "name": "kvpilot-equivalent",
                        "rules": [
                            {
                                "alert": "VllmPreemptionSpike",
                                "expr": "increase(kvpool_preemptions_total[2m]) > 0",
                            }
                        ],
                    }
                ]
            }
        )
    )
    config = tmp / "prometheus.yml"
    config.write_text(
        yaml.safe_dump(
            {
                # No global intervals: Prometheus's defaults (1 m scrape, 1 m evaluation).
                "rule_files": [str(rules)],
                "alerting": {
                    "alertmanagers": [
                        {"static_configs": [{"targets": [f"127.0.0.1:{alertmanager_port}"]}]}
                    ]
                },
                "scrape_configs": [
                    {"job_name": "kvpool", "static_configs": [{"targets": [kvpool]}]}
                ],
            }
        )
    )
    return [
        shutil.which("prometheus") or "/usr/bin/prometheus",
        f"--config.file={config}",
        f"--storage.tsdb.path={tmp / 'tsdb'}",
        f"--web.listen-address=127.0.0.1:{free_port()}",
    ]


def _alertmanager(tmp: Path, port: int, hook: str) -> list[str]:
    config = tmp / "alertmanager.yml"
    # Alertmanager's defaults: group_wait 30 s, group_interval 5 m.
    config.write_text(
        yaml.safe_dump(
            {
                "route": {"receiver": "hook"},
                "receivers": [{"name": "hook", "webhook_configs": [{"url": hook}]}],
            }
        )
    )
    binary = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
    return [
        binary or "prometheus-alertmanager",
        f"--config.file={config}",
        f"--storage.path={tmp / 'am'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--cluster.listen-address=",
    ]


def _first_preemption(kvpool_url: str) -> tuple[float, int]:
    """Poll the plugin at 20 Hz until it has counted a preemption; its engine-side stamp."""

    def probe() -> tuple[float, int] | None:
        text = httpx.get(f"{kvpool_url}/metrics", timeout=2).text
        samples = {s.name: s.value for s in parse_samples(text, prefixes=("kvpool_",))}
        count = int(samples.get("kvpool_preemptions_total", 0))
        stamp = samples.get("kvpool_last_preemption_timestamp_seconds")
        return (stamp, count) if count > 0 and stamp else None

    return _wait("the first preemption", probe, 600, poll_s=0.05)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--kvpilot-only", action="store_true", help="skip Prometheus + Alertmanager"
    )
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kvpilot-detection-"))
    arrivals = Arrivals()
    spec = ServerSpec(
        port=free_port(), kvpool_port=free_kvpool_port(), kv_cache_memory_bytes=KV_BYTES
    )
    agent_port = free_port()
    processes: list[subprocess.Popen] = []
    try:
        config = _agent_config(tmp, spec, agent_port, arrivals.url("/kvpilot"))
        agent = [sys.executable, "-m", "kvpilot.agent", "run", "--config", str(config)]
        processes.append(_start(agent, tmp / "agent.log"))
        kvpool_url = f"http://127.0.0.1:{spec.kvpool_port}"
        if not args.kvpilot_only:
            am_port = free_port()
            processes.append(
                _start(_alertmanager(tmp, am_port, arrivals.url("/prometheus")), tmp / "am.log")
            )
            processes.append(
                _start(_prometheus(tmp, f"127.0.0.1:{spec.kvpool_port}", am_port), tmp / "prom.log")
            )
        _wait(
            "vLLM healthy",
            lambda: httpx.get(f"{spec.url}/health", timeout=2).status_code == 200,
            600,
        )
        _wait(
            "the plugin",
            lambda: httpx.get(f"{kvpool_url}/metrics", timeout=2).status_code == 200,
            60,
        )
        if not args.kvpilot_only:
            time.sleep(70)  # let Prometheus take a scrape of the quiet counter first
        workload = Workload(
            num_requests=64,
            concurrency=64,
            prompt_len=LengthDist.uniform(200, 300),
            output_len=LengthDist.fixed(150),
            seed=5,
            request_timeout_s=600,
        )
        load = threading.Thread(
            target=lambda: asyncio.run(run_load(spec.url, workload)), daemon=True
        )
        load.start()
        first_s, count = _first_preemption(kvpool_url)
        kvpilot_at = _wait("kvpilot's webhook", lambda: arrivals.first.get("/kvpilot"), 120)
        kvpilot_s = kvpilot_at - first_s
        print(f"first preemption (engine clock, {count} counted when seen): {first_s:.3f}")
        print(f"kvpilot (1 s ticks): {kvpilot_s:.2f} s from the first preemption to the webhook")
        if not args.kvpilot_only:
            prom_at = _wait(
                "Alertmanager's webhook", lambda: arrivals.first.get("/prometheus"), 600
            )
            prom_s = prom_at - first_s
            print(f"Prometheus + Alertmanager (defaults): {prom_s:.2f} s")
            print(f"ratio prometheus / kvpilot: {prom_s / kvpilot_s:.1f}x")
        print("goal (kvpilot under 5 s):", "met" if kvpilot_s < 5 else "MISSED")
    finally:
        for process in reversed(processes):
            _stop(process)
        arrivals.close()


if __name__ == "__main__":
    main()
