"""The rig against a real CPU vLLM: start, load, client timings, stop with the whole group."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
from collections.abc import Iterator

import httpx
import pytest

from kvpilot.collectors.kvpool.listen_address import ALLOCATOR_PORT_OFFSET
from kvpilot.rig import server as rig_server
from kvpilot.rig.server import (
    ServerSpec,
    ServerStartError,
    VllmServer,
    build_argv,
    build_env,
    live_group_members,
)
from kvpilot.tuner.load.generator import LengthDist, Workload, percentile, plan_requests, run_load


def test_a_kvpool_port_is_chosen_with_its_worker_port_free(monkeypatch) -> None:
    # The worker serves its ledger ALLOCATOR_PORT_OFFSET above the plugin's port: a port
    # whose worker port another socket holds is passed over.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        kernels = rig_server.free_port

        def offers() -> Iterator[int]:
            yield taken - ALLOCATOR_PORT_OFFSET  # its worker port is the one held
            while True:  # then the kernel's, as many as it takes (any may be taken too)
                yield kernels()

        offered = offers()
        monkeypatch.setattr(rig_server, "free_port", lambda host="127.0.0.1": next(offered))
        chosen = rig_server.free_kvpool_port()
    assert chosen != taken - ALLOCATOR_PORT_OFFSET
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", chosen + ALLOCATOR_PORT_OFFSET))  # free: binds


def test_workload_is_drawn_from_its_seed() -> None:
    workload = Workload(
        num_requests=20,
        concurrency=4,
        prompt_len=LengthDist.uniform(4, 40),
        output_len=LengthDist(low=1, choices=(8, 16)),
        seed=7,
    )
    first, second = plan_requests(workload), plan_requests(workload)
    assert first == second
    assert {len(p.prompt) for p in first} <= set(range(4, 41))
    assert {p.max_tokens for p in first} <= {8, 16}
    other = plan_requests(dataclasses.replace(workload, seed=8))
    assert [p.prompt for p in other] != [p.prompt for p in first]


def test_open_loop_arrivals_follow_the_rate() -> None:
    workload = Workload(
        num_requests=2000,
        rate_rps=50.0,
        prompt_len=LengthDist.fixed(4),
        output_len=LengthDist.fixed(4),
    )
    last = plan_requests(workload)[-1].delay_s
    # 1999 exponential gaps of mean 20 ms: the total is within a few percent of 40 s.
    assert 36.0 < last < 44.0


def test_workload_needs_exactly_one_arrival_mode() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        Workload(num_requests=1, prompt_len=LengthDist.fixed(1), output_len=LengthDist.fixed(1))
    with pytest.raises(ValueError, match="exactly one"):
        Workload(
            num_requests=1,
            concurrency=1,
            rate_rps=1.0,
            prompt_len=LengthDist.fixed(1),
            output_len=LengthDist.fixed(1),
        )


def test_percentile_interpolates() -> None:
    assert percentile([], 0.5) is None
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile([0.0, 10.0], 0.95) == pytest.approx(9.5)


def test_argv_is_a_list_and_env_controls_the_plugin() -> None:
    spec = ServerSpec(port=1234, kvpool_port=5678, api_key="secret", plugin_enabled=False)
    argv = build_argv(spec, python="python")
    assert argv[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--port") + 1] == "1234"
    assert argv[argv.index("--api-key") + 1] == "secret"
    env = build_env(spec, base={"PATH": "/bin", "VLLM_PLUGINS": "x"})
    assert env["KVPILOT_KVPOOL_PORT"] == "5678"
    assert "kvpilot_kvpool" not in env["VLLM_PLUGINS"].split(",")
    enabled = build_env(dataclasses.replace(spec, plugin_enabled=True), base={"VLLM_PLUGINS": "x"})
    assert "VLLM_PLUGINS" not in enabled  # vLLM's default: load every installed plugin


def test_kv_cache_metrics_is_asked_for_only_when_set() -> None:
    assert "--kv-cache-metrics" not in build_argv(ServerSpec(port=1), python="python")
    argv = build_argv(ServerSpec(port=1, kv_cache_metrics=True), python="python")
    assert argv.count("--kv-cache-metrics") == 1


@pytest.mark.slow
def test_load_against_real_server_measures_every_request(vllm_server: VllmServer) -> None:
    workload = Workload(
        num_requests=12,
        concurrency=4,
        prompt_len=LengthDist.uniform(8, 64),
        output_len=LengthDist.fixed(16),
        seed=1,
    )
    report = asyncio.run(run_load(vllm_server.url, workload))
    assert len(report.results) == 12
    assert not report.failed, report.failed[0].error
    for result in report.results:
        assert result.output_tokens == 16
        assert len(result.token_times_s) == 16
        assert result.ttft_s is not None and 0 < result.ttft_s <= result.e2e_s
        assert all(gap >= 0 for gap in result.inter_token_s)
    assert report.output_tokens_per_s() > 0


@pytest.mark.slow
def test_failed_requests_are_reported_not_raised(vllm_server: VllmServer) -> None:
    workload = Workload(
        num_requests=2,
        concurrency=1,
        prompt_len=LengthDist.fixed(2000),  # over max_model_len
        output_len=LengthDist.fixed(4),
    )
    report = asyncio.run(run_load(vllm_server.url, workload))
    assert len(report.failed) == 2
    assert all("HTTP 400" in (r.error or "") for r in report.failed)


@pytest.mark.slow
def test_stop_takes_down_the_whole_process_group(tmp_path) -> None:
    from kvpilot.rig.server import free_port

    server = VllmServer(ServerSpec(port=free_port()), log_path=tmp_path / "vllm.log")
    with server:
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
        pgid = server.pid
        assert len(live_group_members(pgid)) >= 2  # API server and engine core at least
    assert live_group_members(pgid) == []


@pytest.mark.slow
def test_a_server_that_cannot_start_reports_its_log(tmp_path) -> None:
    from kvpilot.rig.server import free_port

    # One block cannot hold one request of max_model_len: vLLM refuses to start.
    spec = ServerSpec(port=free_port(), kv_cache_memory_bytes=32 * 1024)
    server = VllmServer(spec, log_path=tmp_path / "vllm.log")
    server.start()
    try:
        with pytest.raises(ServerStartError, match="exited") as info:
            server.wait_healthy(timeout_s=240)
        assert "memory" in info.value.log_tail.lower()
    finally:
        server.stop()
