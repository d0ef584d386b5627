"""Impossible values from a source are unknown, with the reason, never a number a rule acts
on: a ratio outside 0..1 or infinite, a negative count or counter, a series exported twice
with different values, kvpool block counts that cannot all be true.

Every test drives the `kvpilot` command as a subprocess against real loopback servers.
"""

from __future__ import annotations

import json
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.faults.agent_process import kvpilot, ticks, value
from tests.faults.misbehaving import Misbehaving, answer, answers, free_port

# Each test starts the agent as a process: the inner loop (-m "not slow") skips them.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PAYLOAD = (ROOT / "tests" / "fixtures" / "vllm" / "v0_32_under_load.prom").read_text()
LABELS = '{engine="0",model_name="rig/models/tiny-llama"}'
VERSION = answer(b'{"version": "0.32.0"}', "application/json")


def _with(name: str, *values: str) -> bytes:
    """The real payload with the series `name` of engine 0 given `values` (two: a duplicate)."""
    lines = []
    for line in PAYLOAD.splitlines():
        if line.startswith(name + LABELS + " "):
            lines.extend(f"{name}{LABELS} {v}" for v in values)
        else:
            lines.append(line)
    assert len(lines) == len(PAYLOAD.splitlines()) + len(values) - 1, name
    return ("\n".join(lines) + "\n").encode()


def _collect(tmp_path: Path, routes: dict[str, Any], *extra: str) -> dict[str, Any]:
    """`kvpilot collect --once --json` against a loopback server serving `routes`."""
    with Misbehaving(routes) as server:
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
                *extra,
            ],
            capture_output=True,
            timeout=60,
            cwd=tmp_path,
            check=False,
        )
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-2000:]
    report: dict[str, Any] = json.loads(done.stdout)
    return report


@pytest.mark.parametrize(
    ("name", "values", "field", "reason"),
    [
        ("vllm:kv_cache_usage_perc", ("+Inf",), "kv_usage_ratio", "non_finite"),
        ("vllm:kv_cache_usage_perc", ("1.5",), "kv_usage_ratio", "out_of_range"),
        ("vllm:kv_cache_usage_perc", ("-0.5",), "kv_usage_ratio", "out_of_range"),
        ("vllm:kv_cache_usage_perc", ("0.2", "0.9"), "kv_usage_ratio", "duplicate_series"),
        ("vllm:num_requests_running", ("-3",), "requests_running", "negative"),
        ("vllm:num_preemptions_total", ("-35",), "preemptions_total", "negative"),
    ],
)
def test_an_impossible_vllm_value_is_unknown_with_its_reason(
    tmp_path: Path, name: str, values: tuple[str, ...], field: str, reason: str
) -> None:
    report = _collect(tmp_path, {"/metrics": answer(_with(name, *values)), "/version": VERSION})
    assert report["vllm"]["status"] == "ok"  # the rest of the scrape is kept
    (engine,) = report["vllm"]["engines"]
    assert engine[field] is None, f"{field} = {engine[field]!r} was let through"
    assert {"field": field, "reason": reason} in [
        {"field": r["field"], "reason": r["reason"]} for r in engine.get("refused", [])
    ]
    assert engine["requests_waiting"] == 7  # the sound values are untouched


def test_a_counter_that_goes_negative_gives_no_negative_rate(tmp_path: Path) -> None:
    """Preemptions read 17, then -18 half a second later: that is not a rate of -70/s."""
    bodies = [_with("vllm:num_preemptions_total", "17"), _with("vllm:num_preemptions_total", "-18")]
    report = _collect(tmp_path, {"/metrics": answers(bodies), "/version": VERSION}, "--span", "0.5")
    (figures,) = report["figures"]
    rate = figures["preemption_rate_per_s"]
    assert rate is None, f"a preemption rate of {rate}/s from a negative counter"


KVPOOL_IMPOSSIBLE = b"""\
kvpool_blocks_usable{engine="0",model_name="m"} 100
kvpool_blocks_free{engine="0",model_name="m"} 500
kvpool_blocks_free_cached{engine="0",model_name="m"} 0
kvpool_blocks_empty{engine="0",model_name="m"} 500
kvpool_longest_free_run_blocks{engine="0",model_name="m"} 100
kvpool_blocks_usable{engine="1",model_name="m"} 1000
kvpool_blocks_free{engine="1",model_name="m"} 500
kvpool_blocks_free_cached{engine="1",model_name="m"} 100
kvpool_blocks_empty{engine="1",model_name="m"} 400
kvpool_longest_free_run_blocks{engine="1",model_name="m"} -1000
kvpool_blocks_usable{engine="2",model_name="m"} 1000
kvpool_blocks_free{engine="2",model_name="m"} 500
kvpool_blocks_free_cached{engine="2",model_name="m"} 100
kvpool_blocks_empty{engine="2",model_name="m"} 400
kvpool_longest_free_run_blocks{engine="2",model_name="m"} 600
"""


def test_impossible_kvpool_figures_never_fire_the_fragmentation_rule(tmp_path: Path) -> None:
    """More free blocks than the pool holds (a rate of 0.8), a negative longest run (3.0), a
    longest run above the free blocks (-0.2): each is unknown, counted, and no alert fires."""
    port = free_port()
    with ExitStack() as stack:
        vllm = stack.enter_context(
            Misbehaving({"/metrics": answer(PAYLOAD.encode()), "/version": VERSION})
        )
        kvpool = stack.enter_context(Misbehaving({"/": answer(KVPOOL_IMPOSSIBLE)}))
        config = {
            "listen": {"host": "127.0.0.1", "port": port},
            "interval_s": 0.5,
            "state_dir": str(tmp_path / "state"),
            "runtime": {
                "kind": "process",
                "port": int(vllm.url.rsplit(":", 1)[1]),
                "kvpool_port": int(kvpool.url.rsplit(":", 1)[1]),
            },
            "rules": {"fragmentation": {"kv_blocks": {"for_s": 0}}},
        }
        (tmp_path / "kvpilot.yaml").write_text(yaml.safe_dump(config))
        with kvpilot(["run", "--config", str(tmp_path / "kvpilot.yaml")], tmp_path, port) as agent:
            text = agent.wait_for("three ticks", lambda t: ticks(t) >= 3)
    for state in ("pending", "firing"):
        count = value(text, "kvpilot_alerts", alertname="VllmKvFragmentationHigh", state=state)
        assert not count, f"VllmKvFragmentationHigh {state} on impossible figures"
    assert value(text, "kvpilot_collector_up", source="kvpool") == 1.0
    assert value(text, "kvpilot_fragmentation_ratio", source="kv_blocks") is None
    assert value(text, "kvpilot_kvpool_longest_free_run_blocks") is None
    for reason in ("contradictory", "negative"):
        counted = value(text, "kvpilot_collector_errors_total", source="kvpool", reason=reason)
        assert counted is not None and counted >= 1, f"{reason} not counted"
