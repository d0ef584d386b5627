"""Against a real CPU vLLM under the local runtime: real /proc figures, a real restart."""

from __future__ import annotations

import asyncio
import math
import os
from pathlib import Path

import httpx
import pytest

from kvpilot.agent.config import RemediationConfig
from kvpilot.agent.remediation import (
    MemoryPreflight,
    Remediator,
)
from kvpilot.agent.runtimes import LocalInstanceSpec, LocalRuntime
from kvpilot.collectors.procfs import read_resident_memory
from kvpilot.rig.server import ServerSpec, build_argv, build_env, free_kvpool_port, free_port
from tests.fakes.remediation_journal import MemoryJournal

pytestmark = pytest.mark.slow
KV_BYTES = 64 * 1024 * 1024


def test_preflight_reads_the_real_server_and_a_manual_restart_gives_a_new_pid(
    tmp_path: Path,
) -> None:
    spec = ServerSpec(port=free_port(), kv_cache_memory_bytes=KV_BYTES, shutdown_timeout_s=5)
    env = build_env(spec)
    runtime = LocalRuntime(
        [
            LocalInstanceSpec(
                name="vllm-0",
                argv=tuple(build_argv(spec)),
                env=(
                    ("HF_HUB_OFFLINE", "1"),
                    ("VLLM_CPU_OMP_THREADS_BIND", env["VLLM_CPU_OMP_THREADS_BIND"]),
                ),
                kvpool_port=free_kvpool_port(),
            )
        ],
        tmp_path / "logs",
    )
    journal = MemoryJournal()
    config = RemediationConfig(verify_timeout_s=240.0, drain_timeout_s=20.0)
    preflight = MemoryPreflight(
        latest_nvml=lambda: None,  # no GPU here: the CPU check
        cache_config=lambda name: None,  # the KV budget comes from the argv's flag
        margin_ratio=config.preflight.margin_ratio,
        runtime_margin_bytes=256 * 1024 * 1024,
    )
    remediator = Remediator(runtime, journal, config, preflight=preflight)

    async def main() -> None:
        try:
            started = await runtime.start("vllm-0", ready_timeout_s=240.0)
            assert started.main_pid is not None and started.main_pid in started.pids
            check = preflight.check(started)
            resident = read_resident_memory(started.pids)
            assert check.device == "cpu" and check.ok is True, check.reason
            # Every process of the server was read from /proc, and it holds real memory.
            assert resident.pids_read == len(started.pids) >= 2
            assert resident.missing_pids == ()
            assert resident.anon_bytes > 200 * 1024 * 1024
            assert check.required_bytes == KV_BYTES + math.ceil(KV_BYTES * 0.05) + 256 * 1024 * 1024
            assert check.available_bytes is not None and check.available_bytes > resident.anon_bytes

            outcome = await remediator.trigger("vllm-0", requested_by="slow-test")
            assert outcome.decision == "succeeded", outcome.reason
            assert outcome.old_pid == started.main_pid
            assert outcome.new_pid is not None and outcome.new_pid != started.main_pid
            with pytest.raises(ProcessLookupError):
                os.kill(started.main_pid, 0)  # the old server is gone
            now = runtime.instances()[0]
            assert now.main_pid == outcome.new_pid
            # The new server answers a completion with tokens.
            async with httpx.AsyncClient(timeout=60.0) as client:
                reply = await client.post(
                    f"{spec.url}/v1/completions",
                    json={
                        "model": spec.served_model_name,
                        "prompt": [1, 2, 3],
                        "max_tokens": 3,
                        "ignore_eos": True,
                    },
                )
            assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3
            assert journal.states[1] == [
                "planned",
                "draining",
                "restarting",
                "verifying",
                "succeeded",
            ]
            (audited,) = [a for a in journal.audit if a.action == "preflight"]
            assert audited.decision == "allowed" and audited.details["device"] == "cpu"
        finally:
            await runtime.aclose(drain_timeout_s=10.0)

    asyncio.run(main())
