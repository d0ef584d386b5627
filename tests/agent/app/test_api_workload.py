"""`GET /api/v1/workload`: the real Sidecar ticks against a loopback server answering with
recorded vLLM `/metrics` bodies, the tick's workload-window step
keeps the window, and the real API serves the learned shape beside the configured one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import SecretStr

from kvpilot.agent.app.api import api_routes
from kvpilot.agent.app.exposition import build_registry
from kvpilot.agent.app.http import build_app
from kvpilot.agent.app.parts import build_runtime, control_ports
from kvpilot.agent.config import AgentConfig
from kvpilot.agent.state import StateStore
from kvpilot.agent.tick.after import AfterTick
from kvpilot.agent.tuning.workload.as_json import shape_from_json
from kvpilot.agent.tuning.workload.window import WorkloadWindow
from tests.agent.quiet_sidecar import quiet_sidecar
from tests.agent.vllm_bodies import metrics_server, recorded

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def _served(tmp_path: Path, bodies: list[str], learn: dict[str, Any]) -> Any:
    """The API's answer after one tick per body."""
    with metrics_server(bodies) as vllm:
        config = AgentConfig.model_validate(
            {
                "state_dir": str(tmp_path / "state"),
                "runtime": {
                    "kind": "attach",
                    "servers": [{"name": "vllm", "url": f"http://127.0.0.1:{vllm.port}"}],
                },
                "tuning": {"learn": learn},
            }
        )
        config.state_dir.mkdir(parents=True)
        window = WorkloadWindow(config.tuning.learn.window_s)
        with StateStore.open(config.state_dir) as store:
            runtime = build_runtime(config)
            sidecar = quiet_sidecar(config, store, runtime, after=AfterTick(learned=window))
            try:
                for _ in bodies:
                    await sidecar.tick()
                app = build_app(
                    sidecar,
                    build_registry(sidecar.watched.servers, lambda out: None),
                    clock=sidecar.clock,
                    stale_after_s=10.0,
                    extra_routes=api_routes(
                        control_ports(config, sidecar), SecretStr("t"), window=window
                    ),
                )
                transport = httpx.ASGITransport(app=app)
                async with httpx.AsyncClient(transport=transport, base_url="http://k") as c:
                    response = await c.get("/api/v1/workload")
            finally:
                await sidecar.aclose()
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("application/json")
    return json.loads(response.text)


async def test_the_learned_shape_beside_the_configured_one(tmp_path: Path) -> None:
    bodies = recorded("v0_32_idle.prom", "v0_32_under_load.prom")
    body = await _served(tmp_path, bodies, {"min_requests": 50})
    learned = body["learned"]
    assert learned["requests"] == 81  # the recorded server's 81 requests, all in the window
    assert learned["prompt_tokens"]["count"] == 81
    assert learned["prompt_tokens"]["buckets"][-1] == ["+Inf", 81.0]
    assert learned["coarse_key"].startswith("prompt 512/512 gen 1024/1024")
    assert learned["rate_rps"] > 0
    assert body["configured"]["prompt_len"] == 384
    assert body["window"] == {
        "requests": 81,
        "window_s": 3600.0,
        "min_requests": 50,
        "enabled": True,
        "burst_factor": 1.0,
    }
    assert body["choice"]["source"] == "learned"
    assert body["choice"]["key"] == learned["coarse_key"]
    # One of the two scrapes had requests running: too few samples to say their KV.
    assert learned["kv_blocks_per_running"] is None
    shape = shape_from_json(body)  # what `kvpilot tune --sidecar-url` reads back
    assert shape is not None and shape.requests == 81 and shape.block_size == 32
    assert shape.kv_blocks_per_running is None


async def test_below_the_floor_it_says_the_configured_workload_is_used(tmp_path: Path) -> None:
    bodies = recorded("v0_32_idle.prom", "v0_32_under_load.prom")
    body = await _served(tmp_path, bodies, {})
    assert body["learned"]["requests"] == 81
    assert body["choice"]["source"] == "configured"
    assert "below the floor of 200" in body["choice"]["reason"]


async def test_nothing_learned_is_null_and_learning_off_feeds_nothing(tmp_path: Path) -> None:
    one = await _served(tmp_path / "a", recorded("v0_32_under_load.prom"), {})
    assert one["learned"] is None and one["window"]["requests"] == 0
    bodies = recorded("v0_32_idle.prom", "v0_32_under_load.prom")
    off = await _served(tmp_path / "b", bodies, {"enabled": False})
    assert off["learned"] is None
    assert off["choice"]["reason"] == "learning is off (tuning.learn.enabled)"
