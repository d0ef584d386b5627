"""A real Prometheus scraping a real CPU vLLM, its kvpool plugin and `kvpilot run` under load.

The agent's NVML collector runs on the fake NVML library (the same fake as the unit tests),
put into the agent's process by `tests/fakes/nvml_site/sitecustomize.py`. One server, one agent and
one Prometheus serve every test here; the load preempts, so the generated rules must fire
`VllmPreemptionSpike`, and every Memory panel's, stat's and annotation's query must return
data, with every scope variable on 'All' over series that carry no cluster, namespace or pod
label (a single Prometheus). The exceptions, each with its reason, are in `EMPTY_HERE`;
Prometheus must still accept their queries, and they must really be empty.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from dashboard_queries import annotation_queries, fill, panel_queries, variable_queries
from prometheus_server import PROMTOOL, PrometheusServer, ScrapeTarget, wait_for

from kvpilot.agent.rules.config import RulesConfig
from kvpilot.collectors.dcgm import DcgmSnapshot, DcgmSource, pod_query
from kvpilot.collectors.errors import SourceError
from kvpilot.collectors.limits import ScrapeLimits
from kvpilot.collectors.scrape_client import ScrapeClient
from kvpilot.dashboards.annotations import KSM_RESTARTS
from kvpilot.dashboards.build import build_dashboards
from kvpilot.dashboards.memory import ALLOCATOR_PANELS
from kvpilot.dashboards.rules import build_rules
from kvpilot.dashboards.vllm_signals import NEEDS_CPU_OFFLOAD
from kvpilot.rig.server import ServerSpec, VllmServer, free_port
from kvpilot.tuner.load.generator import LengthDist, Workload, run_load

pytestmark = pytest.mark.slow

# 63 usable blocks, as conftest's PREEMPTING; an explicit KV budget keeps the CPU backend from
# requiring gpu_memory_utilization x the NUMA node's RAM to be free at start-up. Every block
# sampled for vLLM's residency histograms, so that a short load fills them.
PREEMPTING = ServerSpec(
    port=0,
    kv_cache_memory_bytes=64 * 1024 * 1024,
    num_gpu_blocks_override=64,
    kv_cache_metrics=True,
    extra_args=("--kv-cache-metrics-sample", "1.0"),
)
FAKE_SITE = Path(__file__).resolve().parents[1] / "fakes" / "nvml_site"
GIB = 1 << 30
DCGM_PAYLOAD = Path(__file__).resolve().parents[1] / "fixtures" / "dcgm_exporter" / "metrics.prom"
# The exporter's own pod, as Kubernetes service discovery labels its target.
DCGM_EXPORTER_POD = {
    "namespace": "gpu-operator",
    "pod": "nvidia-dcgm-exporter-7xk2q",
    "container": "nvidia-dcgm-exporter",
}
SCRAPE_INTERVAL_S = 1.0  # PrometheusServer's


@dataclass(frozen=True, slots=True)
class Live:
    server: VllmServer
    agent_url: str
    prometheus: PrometheusServer
    start_s: float  # wall time, for range queries
    end_s: float
    preemptions: float


def _fake_gpus(server_pid: int, neighbour_pid: int) -> dict:
    return {
        "gpus": [
            {
                "uuid": "GPU-fake-0",
                "total_bytes": 80 * GIB,
                "used_bytes": 30 * GIB,
                "reserved_bytes": 512 << 20,
                "utilization_gpu_percent": 55,
                "utilization_memory_percent": 20,
                "processes": [
                    {"pid": server_pid, "used_bytes": 24 * GIB},
                    {"pid": neighbour_pid, "used_bytes": 6 * GIB},
                ],
            }
        ]
    }


def _start_agent(server: VllmServer, folder: Path) -> tuple[subprocess.Popen[bytes], str]:
    description = folder / "fake_nvml.json"
    description.write_text(json.dumps(_fake_gpus(server.pid, os.getpid())))
    port = free_port()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(FAKE_SITE), env.get("PYTHONPATH")]))
    env["KVPILOT_FAKE_NVML"] = str(description)
    argv = [
        sys.executable,
        "-m",
        "kvpilot.agent",
        "run",
        "--vllm-url",
        server.url,
        "--kvpool-url",
        f"http://127.0.0.1:{server.spec.kvpool_port}",
        "--listen",
        f"127.0.0.1:{port}",
        "--server-pid",
        str(server.pid),
    ]
    log = (folder / "agent.log").open("ab")
    process = subprocess.Popen(
        argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    log.close()
    return process, f"http://127.0.0.1:{port}"


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)


def _why_not_exported(server: VllmServer, agent_url: str, folder: Path) -> str:
    """What the agent exported and what failed, the plugin's lines in vLLM's log (a worker
    port that could not be bound says so there) and the agent's log."""
    exported = _metrics(agent_url).splitlines()
    shown = [
        line
        for line in exported
        if line.startswith(("kvpilot_collector_errors_total", "kvpilot_memory_ledger_bytes"))
    ]
    plugin = [line for line in server.log_tail(200_000).splitlines() if "kvpool" in line]
    return (
        "agent never exported the NVML, kvpool and ledger figures\n"
        + "\n".join(shown or ["(no collector errors exported)"])
        + "\nvLLM's kvpool lines:\n"
        + "\n".join(plugin[-20:])
        + "\nagent log:\n"
        + (folder / "agent.log").read_text(errors="replace")[-3000:]
    )


def _metrics(url: str) -> str:
    try:
        return httpx.get(f"{url}/metrics", timeout=5).text
    except httpx.HTTPError:
        return ""


@pytest.fixture(scope="module")
def live(server_pool, tmp_path_factory) -> Iterator[Live]:
    server = server_pool.get(PREEMPTING)
    folder = tmp_path_factory.mktemp("prometheus-live")
    agent, agent_url = _start_agent(server, folder)
    prometheus: PrometheusServer | None = None
    dcgm = _serve(DCGM_PAYLOAD)
    try:
        # The ledger comes from the worker's own port, which the engine publishes: waited
        # for too, so that a panel of it is judged on figures the agent had to give.
        wait_for(
            lambda: all(
                f"{family}{{" in _metrics(agent_url)
                for family in (
                    "kvpilot_gpu_process_memory_bytes",
                    "kvpilot_kvpool_blocks",
                    "kvpilot_memory_ledger_bytes",
                )
            ),
            120,
            lambda: _why_not_exported(server, agent_url, folder),
        )
        rules_file = folder / "kvpilot.rules.yaml"
        # Sized to this Prometheus's one-second scrapes, as `kvpilot rules` is told to.
        rules = build_rules(RulesConfig(), scrape_interval_s=SCRAPE_INTERVAL_S)
        rules_file.write_text(rules.rules_file())
        kvpool = f"127.0.0.1:{server.spec.kvpool_port}"
        prometheus = PrometheusServer(
            folder,
            [
                ScrapeTarget("kvpilot", agent_url.removeprefix("http://")),
                ScrapeTarget("vllm", f"127.0.0.1:{server.spec.port}"),
                ScrapeTarget("kvpool", kvpool),
                # dcgm-exporter as a ServiceMonitor scrapes it (its own pod's labels on the
                # target: the GPUs' pod labels arrive as exported_*), and with honorLabels.
                ScrapeTarget("dcgm-exporter", _address(dcgm), labels=DCGM_EXPORTER_POD),
                ScrapeTarget("dcgm-exporter-honor", _address(dcgm), honor_labels=True),
            ],
            rules_file,
        )
        prometheus.start()
        start_s = time.time()
        # A quiet stretch first: the baseline, and fragmentation while many blocks are free.
        wait_for(
            lambda: len(prometheus.instant("count_over_time(up[1m]) >= 10 and up == 1")) == 5,
            90,
            lambda: f"targets not scraped ten times: {prometheus.instant('up')}",
        )
        before = _preemptions(prometheus)
        workload = Workload(
            num_requests=64,
            concurrency=64,
            prompt_len=LengthDist.uniform(250, 350),
            output_len=LengthDist.fixed(64),
            seed=11,
        )
        report = asyncio.run(run_load(server.url, workload))
        assert not report.failed, report.failed
        # Let rates and the agent's window settle over the end of the load.
        wait_for(
            lambda: _preemptions(prometheus) > before,
            60,
            lambda: "Prometheus never saw the kvpool preemption counter move",
        )
        yield Live(
            server=server,
            agent_url=agent_url,
            prometheus=prometheus,
            start_s=start_s,
            end_s=time.time(),
            preemptions=_preemptions(prometheus) - before,
        )
    finally:
        if prometheus is not None:
            prometheus.stop()
        dcgm.shutdown()
        dcgm.server_close()
        _stop(agent)


def _serve(payload: Path) -> ThreadingHTTPServer:
    """A real HTTP server answering every GET with `payload` as a text exposition."""
    body = payload.read_bytes()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _address(server: ThreadingHTTPServer) -> str:
    host, port = server.server_address[:2]
    return f"{host!s}:{port}"


def _preemptions(prometheus: PrometheusServer) -> float:
    result = prometheus.instant('sum(kvpilot_preemptions_total{counter="kvpool"})')
    return float(result[0]["value"][1]) if result else 0.0


def _range(live: Live, expr: str) -> dict:
    end_s = max(live.end_s, time.time())
    return live.prometheus.api(
        "query_range",
        {"query": expr, "start": live.start_s, "end": end_s, "step": 1},
    )


def test_preemption_alert_fires_under_preempting_load(live: Live) -> None:
    assert live.preemptions > 0, "the load did not preempt; the test proves nothing"
    firing = wait_for(
        lambda: _range(live, 'ALERTS{alertname="VllmPreemptionSpike", alertstate="firing"}')[
            "data"
        ]["result"],
        30,
        lambda: (
            "VllmPreemptionSpike never fired; rule states: "
            + json.dumps(live.prometheus.api("rules", {"type": "alert"})["data"])[:3000]
        ),
    )
    labels = firing[0]["metric"]
    assert labels["job"] == "kvpilot"
    assert labels["model_name"] == "tiny-llama"
    assert labels["severity"] == "warning"


# Panels and annotations with nothing to show here, and why.
EMPTY_HERE = {
    **{panel: "no CUDA caching allocator without a GPU" for panel in ALLOCATOR_PANELS},
    **{panel: "the CPU build has no CPU KV offload connector" for panel in NEEDS_CPU_OFFLOAD},
    "vLLM container restarts": f"{KSM_RESTARTS} is kube-state-metrics', not run here",
    "kvpilot remediations": "nothing is remediated in this test",
    "kvpilot promotions": "no tuner runs here; test_tuning_backfill shows it on a real session",
    "kvpilot trials": "no tuner runs here; test_tuning_backfill shows it on a real session",
}


def _memory_queries() -> list:
    (memory,) = (d for d in build_dashboards() if d.uid == "kvpilot-memory")
    model = memory.model()
    return [*panel_queries(model), *annotation_queries(model)]


def test_every_memory_panel_stat_and_annotation_query_returns_data(live: Live) -> None:
    queries = _memory_queries()
    assert len(queries) >= 30
    empty, refused, not_empty = [], [], []
    for query in queries:
        answer = _range(live, fill(query.expr))
        if answer["status"] != "success":
            refused.append((query.panel, query.expr, answer.get("error")))
        elif query.panel in EMPTY_HERE:
            if answer["data"]["result"]:  # the reason no longer holds
                not_empty.append((query.panel, EMPTY_HERE[query.panel]))
        elif not answer["data"]["result"]:
            empty.append((query.panel, query.ref_id, query.expr))
    assert not refused, refused
    assert not empty, empty
    assert not not_empty, not_empty
    assert {q.panel for q in queries} >= set(EMPTY_HERE)


def test_the_scope_matches_series_without_cluster_namespace_or_pod(live: Live) -> None:
    # 'All' (`.*`) on every scope variable must match series that lack the labels, as on a
    # single Prometheus: the query above returned data only if it does.
    series = live.prometheus.api(
        "series", {"match[]": '{job=~"kvpilot|vllm"}', "start": live.start_s, "end": time.time()}
    )["data"]
    assert series and not [s for s in series if {"cluster", "namespace", "pod"} & set(s)]


def test_vllm_memory_signals_come_from_the_real_server(live: Live) -> None:
    def value(expr: str) -> float:
        (sample,) = live.prometheus.instant(expr)
        return float(sample["value"][1])

    vllm = 'job="vllm"'
    # --kv-cache-metrics: evicted blocks' lifetime and idle time, sampled at 1.0 here.
    assert value(f"sum(vllm:kv_block_lifetime_seconds_count{{{vllm}}})") > 0
    assert value(f"sum(vllm:kv_block_idle_before_evict_seconds_count{{{vllm}}})") > 0
    # The preempting load: finished requests were preempted, about as often as counted.
    preempted = value(f"sum(vllm:request_num_preemptions_sum{{{vllm}}})")
    assert preempted > 0
    assert preempted <= value(f"sum(vllm:num_preemptions_total{{{vllm}}})")
    reasons = live.prometheus.instant(f"vllm:num_requests_waiting_by_reason{{{vllm}}}")
    assert {r["metric"]["reason"] for r in reasons} == {"capacity", "deferred"}
    assert value(f'vllm:engine_sleep_state{{{vllm}, sleep_state="awake"}}') == 1
    # The CPU build exports no CPU KV offload families (a GPU server's connector).
    offload = live.prometheus.instant('{__name__=~"vllm:.*offload.*"}')
    assert offload == []


def test_allocator_panels_are_empty_without_cuda_but_accepted(live: Live) -> None:
    (memory,) = (d for d in build_dashboards() if d.uid == "kvpilot-memory")
    allocator = [q for q in panel_queries(memory.model()) if q.panel in ALLOCATOR_PANELS]
    assert allocator
    for query in allocator:
        answer = _range(live, fill(query.expr))
        assert answer["status"] == "success", answer
        assert answer["data"]["result"] == []  # no CUDA allocator on this machine


def test_template_variables_and_annotations_are_accepted(live: Live) -> None:
    (memory,) = (d for d in build_dashboards() if d.uid == "kvpilot-memory")
    model = memory.model()
    for query in variable_queries(model):
        # label_values(selector, label) is Grafana's: ask Prometheus for the selector's series.
        selector = fill(query.removeprefix("label_values(").rsplit(",", 1)[0])
        answer = live.prometheus.api(
            "series", {"match[]": selector, "start": live.start_s, "end": time.time()}
        )
        assert answer["status"] == "success" and answer["data"], (query, answer)
    annotations = {q.panel: q for q in annotation_queries(model)}
    alerts = _range(live, fill(annotations["kvpilot alerts"].expr))
    assert alerts["status"] == "success" and alerts["data"]["result"], alerts


@pytest.mark.parametrize("which", ["agent", "kvpool"])
def test_promtool_check_metrics(live: Live, which: str) -> None:
    url = live.agent_url if which == "agent" else f"http://127.0.0.1:{live.server.spec.kvpool_port}"
    text = _metrics(url)
    assert "# TYPE" in text
    result = subprocess.run(
        [PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr


def test_dcgm_memory_of_the_pod_is_read_through_prometheus_in_both_label_spellings(
    live: Live,
) -> None:
    pod, namespace = "vllm-7c9d8b6f5-x2k4p", "llm"
    # Both spellings reach Prometheus, and the collector's query matches each.
    jobs = {s["metric"]["job"] for s in live.prometheus.instant(pod_query(pod, namespace))}
    assert jobs == {"dcgm-exporter", "dcgm-exporter-honor"}
    renamed = live.prometheus.instant(f'DCGM_FI_DEV_FB_USED{{exported_pod="{pod}"}}')
    assert [s["metric"]["pod"] for s in renamed] == [DCGM_EXPORTER_POD["pod"]]

    async def read() -> DcgmSnapshot | SourceError:
        async with ScrapeClient() as client:
            source = DcgmSource(
                live.prometheus.url,
                pod=pod,
                namespace=namespace,
                client=client,
                limits=ScrapeLimits(timeout_s=10),
            )
            return await source.read()

    snapshot = asyncio.run(read())
    assert isinstance(snapshot, DcgmSnapshot), snapshot
    (gpu,) = snapshot.gpus  # GPU 0 only, counted once though scraped twice
    mib = 1 << 20
    assert (gpu.gpu, gpu.uuid) == ("0", "GPU-3f1c2a7e-8d4b-4c1e-9a55-1b2c3d4e5f60")
    assert (gpu.used_bytes, gpu.free_bytes, gpu.reserved_bytes) == (
        73210 * mib,
        7804 * mib,
        545 * mib,
    )
    assert gpu.total_bytes == 81559 * mib
    assert (gpu.hostname, gpu.container, gpu.model_name) == (
        "gpu-node-07",
        "vllm",
        "NVIDIA H100 80GB HBM3",
    )
