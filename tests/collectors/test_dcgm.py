"""dcgm-exporter's memory of a pod's GPUs, from a Prometheus query answer.

`query_answer.json` is what a real Prometheus answered to `pod_query` while scraping the
recorded dcgm-exporter `/metrics` twice (tests/fixtures/dcgm_exporter/README.md); the live
check of the same path is in tests/dashboards/test_prometheus_live.py.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from kvpilot.agent.config.gpu import GpuConfig
from kvpilot.collectors.dcgm import DcgmSource, parse_answer, pod_query
from kvpilot.collectors.errors import SourceError
from kvpilot.collectors.limits import ScrapeLimits
from kvpilot.collectors.scrape_client import ScrapeClient

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "dcgm_exporter"
MIB = 1 << 20
POD, NAMESPACE = "vllm-7c9d8b6f5-x2k4p", "llm"


def answer(job: str | None = None) -> Any:
    """The recorded answer; only the series of `job` when given."""
    data = json.loads((FIXTURES / "query_answer.json").read_text())
    if job is not None:
        result = data["data"]["result"]
        data["data"]["result"] = [s for s in result if s["metric"]["job"] == job]
    return data


def parse(data: Any) -> Any:
    return parse_answer(data, pod=POD, namespace=NAMESPACE, taken_at_s=1.0, wall_time_s=2.0)


@pytest.mark.parametrize("job", [None, "dcgm-exporter", "dcgm-exporter-honor"])
def test_either_label_spelling_gives_the_pods_gpu_once(job: str | None) -> None:
    (gpu,) = parse(answer(job)).gpus
    assert (gpu.key, gpu.uuid) == ("0", "GPU-3f1c2a7e-8d4b-4c1e-9a55-1b2c3d4e5f60")
    assert (gpu.used_bytes, gpu.free_bytes, gpu.reserved_bytes) == (
        73210 * MIB,
        7804 * MIB,
        545 * MIB,
    )
    assert gpu.total_bytes == 81559 * MIB
    # Renamed by Prometheus, `container` is the exporter's own: ours is exported_container.
    assert gpu.container == "vllm"


def test_the_query_asks_for_both_spellings_and_quotes_the_pod() -> None:
    query = pod_query('we"ird\\pod', NAMESPACE)
    assert 'pod="we\\"ird\\\\pod"' in query and 'exported_pod="we\\"ird\\\\pod"' in query
    assert 'exported_namespace="llm"' in query


@pytest.mark.parametrize(
    ("data", "words"),
    [
        ({"status": "error", "error": "parse error"}, "parse error"),
        ({"status": "success", "data": {"resultType": "matrix", "result": []}}, "instant"),
        (
            {
                "status": "success",
                "data": {
                    "resultType": "vector",
                    "result": [{"metric": {"__name__": "DCGM_FI_DEV_FB_USED"}, "value": [1, "-5"]}],
                },
            },
            "out of range",
        ),
        (
            {
                "status": "success",
                "data": {
                    "resultType": "vector",
                    "result": [
                        {"metric": {"__name__": "DCGM_FI_DEV_FB_USED"}, "value": [1, "NaN"]}
                    ],
                },
            },
            "out of range",
        ),
    ],
)
def test_a_bad_answer_says_why(data: Any, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        parse(data)


def test_without_the_pods_name_the_source_says_how_to_give_it() -> None:
    async def read() -> Any:
        async with ScrapeClient() as client:
            source = DcgmSource(
                "http://127.0.0.1:9",
                pod=None,
                namespace=NAMESPACE,
                client=client,
                limits=ScrapeLimits(),
            )
            return await source.read()

    error = asyncio.run(read())
    assert isinstance(error, SourceError) and error.source == "dcgm"
    assert "POD_NAME" in error.message


def test_a_prometheus_not_there_is_a_refused_source() -> None:
    async def read() -> Any:
        async with ScrapeClient() as client:
            source = DcgmSource(
                "http://user:s3cret@127.0.0.1:9",
                pod=POD,
                namespace=NAMESPACE,
                client=client,
                limits=ScrapeLimits(timeout_s=2),
            )
            return await source.read()

    error = asyncio.run(read())
    assert isinstance(error, SourceError) and error.kind == "refused"
    assert "s3cret" not in error.message


def test_the_config_takes_the_pod_from_the_downward_api_and_wants_an_http_url() -> None:
    section = GpuConfig(dcgm_prometheus_url="http://prometheus:9090")
    env = {"HOSTNAME": "h", "KVPILOT_POD_NAME": POD, "KVPILOT_POD_NAMESPACE": NAMESPACE}
    assert section.pod_identity(env) == (POD, NAMESPACE)
    assert GpuConfig(pod="p", namespace="n").pod_identity(env) == ("p", "n")
    with pytest.raises(ValueError, match="http"):
        GpuConfig(dcgm_prometheus_url="prometheus:9090")
