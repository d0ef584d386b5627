"""The cost of one collect cycle on a real vLLM payload, against prometheus_client's parser.

One cycle is what a 1 Hz tick does with a vLLM scrape: ``parse_vllm_metrics``,
``window.add``, and the rates and quantiles the tick reads, over a window already full
(300 s at 1 Hz). Caches are warm, as they are from a server's second scrape on; the first
scrape's parse is reported too. The baseline is
``prometheus_client.parser.text_string_to_metric_families`` on the same payload, fully
consumed, measured in the same run, interleaved with the cycles. Both figures are medians
of ``time.perf_counter_ns`` over many repetitions.

Also reported: the CPU share of one core at 1 Hz, and the resident memory after importing
kvpilot's collectors and running 1000 cycles (``VmRSS``, read before prometheus_client's
parser is imported). Exits 1 if the cycle costs more than a quarter of the baseline.

    .venv/bin/python benchmarks/collect_cycle.py [--quick] [--payload PATH]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from kvpilot.collectors.promtext import clear_caches
from kvpilot.collectors.vllm_metrics import VllmScrape, parse_vllm_metrics
from kvpilot.collectors.window import RollingWindow

PAYLOAD = (
    Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "vllm" / "v0_32_under_load.prom"
)
RATIO_GOAL = 0.25
RETENTION_S = 300.0
SPAN_S = 60.0
COUNTERS = (
    "preemptions_total",
    "generation_tokens_total",
    "prompt_tokens_total",
    "iterations_total",
)
HISTOGRAMS = ("ttft", "inter_token_latency", "e2e_latency", "queue_time")


class Cycle:
    """A window and a clock that moves one second per cycle."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.window = RollingWindow(RETENTION_S)
        self.now_s = 0.0

    def run(self) -> int:
        """One collect cycle; returns a figure derived from the results so nothing is skipped."""
        self.now_s += 1.0
        engines = parse_vllm_metrics(self.text, taken_at_s=self.now_s, wall_time_s=self.now_s)
        self.window.add(VllmScrape(self.now_s, self.now_s, engines, "0.32.0"))
        known = 0
        for engine in engines:
            for field in COUNTERS:
                known += self.window.rate(engine.key, field, SPAN_S) is not None
            for field in HISTOGRAMS:
                known += sum(
                    v is not None for v in self.window.quantiles(engine.key, field, SPAN_S).values()
                )
        return known


def rss_kib() -> int | None:
    """This process's resident memory from /proc, in KiB; None where /proc has no such line."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (CI)")
    parser.add_argument("--payload", type=Path, default=PAYLOAD, help="a recorded /metrics body")
    args = parser.parse_args(argv)
    reps = 60 if args.quick else 300
    text = args.payload.read_text()

    cycle = Cycle(text)
    for _ in range(1000):  # fills the window (300 s retention) and is the RSS workload
        cycle.run()
    rss_after = rss_kib()

    from prometheus_client.parser import text_string_to_metric_families  # the baseline only

    def baseline() -> int:
        return sum(len(f.samples) for f in text_string_to_metric_families(text))

    baseline()
    cycle_ns: list[int] = []
    baseline_ns: list[int] = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        cycle.run()
        t1 = time.perf_counter_ns()
        baseline()
        t2 = time.perf_counter_ns()
        cycle_ns.append(t1 - t0)
        baseline_ns.append(t2 - t1)

    cold_ns: list[int] = []
    for _ in range(max(5, reps // 10)):  # a first scrape: nothing cached yet
        clear_caches()
        t0 = time.perf_counter_ns()
        parse_vllm_metrics(text, taken_at_s=0.0, wall_time_s=0.0)
        cold_ns.append(time.perf_counter_ns() - t0)

    cycle_med = statistics.median(cycle_ns)
    base_med = statistics.median(baseline_ns)
    ratio = cycle_med / base_med
    print(f"payload: {args.payload.name}, {len(text)} bytes, {len(text.splitlines())} lines")
    print(f"repetitions: {reps} of each, interleaved")
    rss = f"{rss_after / 1024:.1f} MiB" if rss_after is not None else "unknown (no /proc)"
    rows = [
        ("collect cycle median", f"{cycle_med / 1e6:.3f} ms"),
        ("prometheus_client parse median", f"{base_med / 1e6:.3f} ms"),
        ("ratio (cycle / prometheus_client)", f"{ratio:.3f} (goal <= {RATIO_GOAL})"),
        ("first-scrape parse (cold caches)", f"{statistics.median(cold_ns) / 1e6:.3f} ms"),
        ("CPU share of one core at 1 Hz", f"{cycle_med / 1e9:.4%}"),
        ("VmRSS after 1000 cycles", rss),
    ]
    for label, value in rows:
        print(f"{label + ':':<36}{value}")
    if ratio > RATIO_GOAL:
        print(f"FAIL: ratio {ratio:.3f} is above the goal {RATIO_GOAL}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
