"""Scrape limits, from the outside: a source that drips its body or sends far too much is an
error of that source for the tick (`timeout`, `too_large`), and everything else carries on.

Every test drives the `kvpilot` command as a subprocess against real loopback servers.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import pytest
import yaml

from tests.faults.agent_process import kvpilot, stop, ticks, value
from tests.faults.misbehaving import Misbehaving, answer, drip, endless, free_port

# Each test starts the agent as a process: the inner loop (-m "not slow") skips them.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
VLLM_PAYLOAD = (ROOT / "tests" / "fixtures" / "vllm" / "v0_32_under_load.prom").read_bytes()
VERSION = answer(b'{"version": "0.32.0"}', "application/json")
KVPOOL_PAYLOAD = b"""\
kvpool_blocks_usable{engine="0",model_name="m"} 1000
kvpool_blocks_free{engine="0",model_name="m"} 500
kvpool_blocks_free_cached{engine="0",model_name="m"} 100
kvpool_blocks_empty{engine="0",model_name="m"} 400
kvpool_longest_free_run_blocks{engine="0",model_name="m"} 450
"""
MIB = 1 << 20


def _vllm_routes(**extra: object) -> dict[str, object]:
    return {"/metrics": answer(VLLM_PAYLOAD), "/version": VERSION, **extra}


def test_collect_once_returns_within_its_deadline_when_kvpool_drips(tmp_path: Path) -> None:
    deadline_s, margin_s = 1.0, 5.0
    routes = _vllm_routes(**{"/kvpool": drip(every_s=0.3)})
    with Misbehaving(routes) as server:  # type: ignore[arg-type]
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvpilot.agent",
                "collect",
                "--once",
                "--json",
                "--vllm-url",
                server.url,
                "--kvpool-url",
                f"{server.url}/kvpool",
                "--timeout",
                str(deadline_s),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            cwd=tmp_path,
        )
        try:
            out, err = process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            stop(process)
            raise AssertionError(
                "kvpilot collect --once did not return in 60 s while the kvpool source dripped"
            ) from None
        finished = time.monotonic()
        (asked,) = server.arrivals["/kvpool"]
    assert finished - asked < deadline_s + margin_s, "collect waited on the dripping source"
    report = json.loads(out)
    assert report["kvpool"]["status"] == "error", report["kvpool"]
    assert report["kvpool"]["kind"] == "timeout"
    assert report["vllm"]["status"] == "ok"  # the other source was read all the same
    assert process.returncode == 0, err.decode(errors="replace")


@pytest.mark.parametrize(
    ("option", "kind"),
    [("--body-size-limit=4096", "too_large"), ("--sample-limit=100", "too_many_samples")],
)
def test_collect_options_set_the_limits(tmp_path: Path, option: str, kind: str) -> None:
    with Misbehaving(_vllm_routes()) as server:  # type: ignore[arg-type]
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "kvpilot.agent",
                "collect",
                "--once",
                "--json",
                "--vllm-url",
                server.url,
                option,
            ],
            capture_output=True,
            timeout=60,
            cwd=tmp_path,
            check=False,
        )
    report = json.loads(done.stdout)
    assert report["vllm"]["kind"] == kind, report["vllm"]
    assert done.returncode == 1  # the vLLM source failed: collect says so in its exit code


def test_run_keeps_ticking_while_its_kvpool_drips(tmp_path: Path) -> None:
    """`kvpilot run --vllm-url --kvpool-url`: ticks complete, health is good, vLLM's figures
    are served, and the kvpool source is counted as timing out."""
    port = free_port()
    with Misbehaving(_vllm_routes(**{"/kvpool": drip()})) as server:  # type: ignore[arg-type]
        args = [
            "run",
            "--vllm-url",
            server.url,
            "--kvpool-url",
            f"{server.url}/kvpool",
            "--listen",
            f"127.0.0.1:{port}",
            "--interval",
            "0.5",
        ]
        with kvpilot(args, tmp_path, port) as agent:
            text = agent.wait_for("three ticks", lambda t: ticks(t) >= 3)
            health = _healthz(agent.url)
    assert health == 200
    assert value(text, "kvpilot_kv_usage_ratio") is not None
    assert (
        value(text, "kvpilot_collector_errors_total", source="kvpool", reason="timeout") or 0
    ) >= 1


def test_run_config_one_dripping_server_does_not_hold_the_other(tmp_path: Path) -> None:
    """Two attached servers; one's kvpool drips. Ticks keep completing, the healthy server's
    series are all there, and the other's vLLM figures too."""
    port = free_port()
    with ExitStack() as stack:
        kvpool = answer(KVPOOL_PAYLOAD)
        healthy = stack.enter_context(Misbehaving(_vllm_routes(**{"/kvpool": kvpool})))  # type: ignore[arg-type]
        dripping = stack.enter_context(Misbehaving(_vllm_routes(**{"/kvpool": drip()})))  # type: ignore[arg-type]
        config = {
            "listen": {"host": "127.0.0.1", "port": port},
            "interval_s": 0.5,
            "state_dir": str(tmp_path / "state"),
            "runtime": {
                "kind": "attach",
                "servers": [
                    {"name": name, "url": s.url, "kvpool_url": f"{s.url}/kvpool"}
                    for name, s in (("healthy", healthy), ("dripping", dripping))
                ],
            },
        }
        (tmp_path / "kvpilot.yaml").write_text(yaml.safe_dump(config))
        with kvpilot(["run", "--config", str(tmp_path / "kvpilot.yaml")], tmp_path, port) as agent:
            text = agent.wait_for(
                "three ticks with the dripping source timing out",
                lambda t: (
                    ticks(t) >= 3
                    and value(
                        t, "kvpilot_collector_errors_total", server="dripping", source="kvpool"
                    )
                    is not None
                ),
            )
            health = _healthz(agent.url)
    assert health == 200
    assert value(text, "kvpilot_collector_up", server="healthy", source="kvpool") == 1.0
    assert value(text, "kvpilot_kvpool_longest_free_run_blocks", server="healthy") == 450.0
    assert value(text, "kvpilot_kv_usage_ratio", server="healthy") is not None
    assert value(text, "kvpilot_kv_usage_ratio", server="dripping") is not None
    assert value(text, "kvpilot_collector_up", server="dripping", source="kvpool") == 0.0
    errors = value(
        text, "kvpilot_collector_errors_total", server="dripping", source="kvpool", reason="timeout"
    )
    assert errors is not None and errors >= 1


def test_a_200_mib_body_is_refused_without_being_read(tmp_path: Path) -> None:
    """vLLM's /metrics answers 200 MiB from a generator, with no Content-Length: the agent
    stops reading at its cap (16 MiB), says too_large, and its memory stays bounded."""
    total = 200 * MIB
    line = b'vllm:num_requests_running{engine="0",model_name="m"} 1\n'
    chunk = line * (64 * 1024 // len(line))
    port = free_port()
    routes = {"/metrics": endless(total, chunk), "/version": VERSION}
    with Misbehaving(routes) as server:  # type: ignore[arg-type]
        args = [
            "run",
            "--vllm-url",
            server.url,
            "--listen",
            f"127.0.0.1:{port}",
            "--interval",
            "0.5",
        ]
        with kvpilot(args, tmp_path, port) as agent:
            text = agent.wait_for(
                "a too_large error for the vLLM source",
                lambda t: (
                    (value(t, "kvpilot_collector_errors_total", reason="too_large") or 0) >= 2
                ),
            )
            peak_mib = agent.proc_status_kib("VmHWM") / 1024
            rss_mib = agent.proc_status_kib("VmRSS") / 1024
        assert server.written["/metrics"], "no request for /metrics finished"
        written = max(server.written["/metrics"])
    assert value(text, "kvpilot_collector_up", source="vllm") == 0.0
    # The agent alone holds about 65 MiB and about 85 MiB with the 16 MiB cap filled; the
    # same body read whole took it past 2 GiB.
    assert peak_mib < 160, f"peak resident memory {peak_mib:.0f} MiB (now {rss_mib:.0f} MiB)"
    assert written < total / 4, f"the server wrote {written} bytes before the agent hung up"


def _healthz(url: str) -> int:
    import httpx

    return httpx.get(f"{url}/healthz", timeout=5.0).status_code
