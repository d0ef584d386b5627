"""Capacity at the SLO of a few configurations on the real CPU vLLM, and the memory-priced
choice among them (`tuner/measure/capacity.py` says how a capacity is found).

Each configuration (a KV budget in 32-token blocks and a max_num_seqs) gets one server, pinned
to `--server-cpus`, and a ladder of open-loop windows of Poisson arrivals (`--window-s` each,
rates 1.5x apart from `--start-rps`, then two bisections). Every window's per-request records
(TTFT, mean inter-token gap, error) are appended to `--out` as JSON lines. The choice: among
the configurations within 5 % of the best capacity, the smallest KV budget.

    .venv/bin/python benchmarks/capacity.py --kv-blocks 48,512 --seqs 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from kvpilot.rig.server import ServerSpec, VllmServer, free_port
from kvpilot.tuner.load.generator import LengthDist, LoadReport, Workload, percentile, run_load
from kvpilot.tuner.measure.capacity import Capacity, capacity_at_slo
from kvpilot.tuner.problem.objective import Slo

BLOCK_BYTES = 32 * 1024  # the tiny model's KV bytes per 32-token block
WORKLOAD = Workload(
    num_requests=1,  # set per window from its rate
    prompt_len=LengthDist.uniform(256, 512),
    output_len=LengthDist.uniform(32, 96),
    rate_rps=1.0,  # open loop: each window sets its own rate
    seed=3,
)
SLO = Slo(ttft_p95_s=2.0, inter_token_p95_s=0.1)
TIE_RATIO = 0.05


def request_records(report: LoadReport) -> list[dict[str, object]]:
    """Each request of a window: TTFT, mean inter-token gap, the 95th percentile of its gaps
    (what the SLO judges), error (for the JSON lines)."""
    return [
        {
            "ttft_s": r.ttft_s,
            "inter_token_s": sum(r.inter_token_s) / len(r.inter_token_s)
            if r.inter_token_s
            else None,
            "inter_token_p95_s": percentile(r.inter_token_s, 0.95),
            "error": r.error,
        }
        for r in report.results
    ]


async def _capacity(url: str, window_s: float, start_rps: float, out: Path, label: str) -> Capacity:
    async def measure(rate: float) -> LoadReport:
        workload = replace(WORKLOAD, num_requests=max(8, round(rate * window_s)), rate_rps=rate)
        report = await run_load(url, workload, model="tiny-llama")
        with out.open("a") as f:
            record = {"config": label, "rate_rps": rate, "requests": request_records(report)}
            f.write(json.dumps(record))
            f.write("\n")
        return report

    return await capacity_at_slo(measure, SLO, start_rps=start_rps)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--kv-blocks", default="48,512", help="KV budgets in 32-token blocks")
    parser.add_argument("--seqs", default="16", help="max_num_seqs values")
    parser.add_argument("--window-s", type=float, default=15.0, help="seconds a window")
    parser.add_argument("--start-rps", type=float, default=2.0, help="the ladder's first rate")
    parser.add_argument("--server-cpus", default="0", help="the server's cores")
    parser.add_argument("--out", type=Path, default=Path("capacity_windows.jsonl"))
    args = parser.parse_args(argv)
    cpus = tuple(int(c) for c in args.server_cpus.split(",") if c.strip())
    found: list[tuple[int, int, Capacity]] = []
    for seqs in (int(s) for s in args.seqs.split(",")):
        for blocks in (int(b) for b in args.kv_blocks.split(",")):
            spec = ServerSpec(
                port=free_port(),
                kv_cache_memory_bytes=blocks * BLOCK_BYTES,
                max_num_seqs=seqs,
                cpus=cpus,
            )
            label = f"kv {blocks} blocks, {seqs} seqs"
            with VllmServer(spec) as server:
                server.wait_healthy()
                capacity = asyncio.run(
                    _capacity(server.url, args.window_s, args.start_rps, args.out, label)
                )
            found.append((blocks, seqs, capacity))
            ladder = ", ".join(
                f"{w.rate_rps:.2f}{'+' if w.holds else '-'} ({w.met}/{w.requests})"
                for w in capacity.windows
            )
            held = "none" if capacity.rate_rps is None else f"{capacity.rate_rps:.2f} req/s"
            print(f"{label}: capacity {held}; windows: {ladder}", flush=True)
    held = [(b, s, c.rate_rps) for b, s, c in found if c.rate_rps is not None]
    if not held:
        print("no configuration held any rate within the SLO")
        return 1
    top = max(rate for _, _, rate in held)
    tied = [(b, s, rate) for b, s, rate in held if rate >= (1 - TIE_RATIO) * top]
    blocks, seqs, rate = min(tied, key=lambda x: (x[0], -x[2]))
    print(
        f"memory-priced choice: kv {blocks} blocks, {seqs} seqs at {rate:.2f} req/s "
        f"(best capacity {top:.2f} req/s; within {TIE_RATIO:.0%} of it, the least KV wins)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
