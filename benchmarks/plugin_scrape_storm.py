"""What a storm of kvpool scrapes costs vLLM's engine thread, against a baseline in the same run.

An engine thread steps a real vLLM BlockPool through the plugin's hooks (`schedule`, a fixed
amount of work, `update_from_output`) for a fixed time, in three arms alternated round after
round to cancel drift:

* A, baseline: nobody scrapes;
* B, bounded: `--scrapers` clients in another process scrape the plugin's real HTTP port
  as fast as it answers, with the plugin's bound (at most one block-pool pass per
  `min_interval_s`);
* C, unbounded: the same storm with the bound off (`min_interval_s=0`: every scrape a pass
  on the engine thread, as before the bound).

Prints steps per second per arm, the ratios B/A and C/A, and the engine thread's time in
block-pool passes (the plugin's own counter).

    .venv/bin/python benchmarks/plugin_scrape_storm.py --blocks 200000 --seconds 3 --rounds 2
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from types import SimpleNamespace

from kvpilot.collectors.kvpool.plugin import EngineHandle
from kvpilot.collectors.kvpool.server import KvPoolCollector, PartErrors, serve

# The scrapers: threads in a process of their own, each GETting /metrics in a loop; each
# prints how many answers it had when stdin closes.
SCRAPER = """
import http.client, sys, threading
port, n = int(sys.argv[1]), int(sys.argv[2])
stop, counts = threading.Event(), [0] * n
def run(i):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    while not stop.is_set():
        conn.request("GET", "/metrics")
        conn.getresponse().read()
        counts[i] += 1
threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
for t in threads:
    t.start()
sys.stdin.read()
stop.set()
print(sum(counts))
"""


class _Scheduler:
    """The two things the plugin reads of vLLM's scheduler."""

    def __init__(self, num_blocks: int) -> None:
        from vllm.v1.core.block_pool import BlockPool

        self.kv_cache_manager = SimpleNamespace(block_pool=BlockPool(num_blocks, True, 16))
        self.running: list[object] = []


def _work(n: int) -> int:
    """A step's fixed CPU work (stands for scheduling and output processing)."""
    total = 0
    for i in range(n):
        total += i * i
    return total


def arm(num_blocks: int, seconds: float, scrapers: int, min_interval_s: float | None) -> dict:
    """One arm: steps/s, scrapes served, engine-thread passes and their seconds."""
    scheduler = _Scheduler(num_blocks)
    pool = scheduler.kv_cache_manager.block_pool
    handle = EngineHandle(
        scheduler,
        engine="0",
        model_name="bench",
        errors=PartErrors(),
        clock=time.monotonic,
        wall_clock=time.time,
        min_interval_s=1.0 if min_interval_s is None else min_interval_s,
    )
    errors = PartErrors()
    collector = KvPoolCollector(
        engines=lambda: [handle.reading()], allocators=list, errors=errors, clock=time.monotonic
    )
    server = serve(collector, "127.0.0.1", 0)
    client = None
    if scrapers:
        client = subprocess.Popen(
            [sys.executable, "-c", SCRAPER, str(server.port), str(scrapers)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        time.sleep(0.5)  # the storm is under way before the engine is timed
    steps = 0
    began = time.perf_counter()
    while time.perf_counter() - began < seconds:
        handle.on_step_start()
        grabbed = pool.get_new_blocks(8)
        _work(2_000)
        pool.free_blocks(grabbed)
        handle.on_step_end()
        steps += 1
    elapsed = time.perf_counter() - began
    served = int(client.communicate(timeout=30)[0] or 0) if client is not None else 0
    server.close()
    return {
        "steps_per_s": steps / elapsed,
        "scrapes": served,
        "passes": handle.snapshots_total,
        "pass_s": handle.snapshot_seconds_total,
        "elapsed_s": elapsed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=200_000)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--scrapers", type=int, default=4)
    args = parser.parse_args()
    arms = {
        "A baseline": (0, None),
        "B bounded": (args.scrapers, None),
        "C unbounded": (args.scrapers, 0.0),
    }
    results: dict[str, list[dict]] = {name: [] for name in arms}
    for round_index in range(args.rounds):
        for name, (scrapers, interval) in arms.items():
            r = arm(args.blocks, args.seconds, scrapers, interval)
            results[name].append(r)
            print(
                f"round {round_index + 1} {name}: {r['steps_per_s']:.0f} steps/s, "
                f"{r['scrapes']} scrapes, {r['passes']} engine passes "
                f"({r['pass_s'] / r['elapsed_s'] * 100:.1f} % of the engine thread)"
            )
    base = statistics.fmean(r["steps_per_s"] for r in results["A baseline"])
    for name in ("B bounded", "C unbounded"):
        mean = statistics.fmean(r["steps_per_s"] for r in results[name])
        share = statistics.fmean(r["pass_s"] / r["elapsed_s"] for r in results[name])
        print(f"{name}: steps/s ratio to baseline {mean / base:.3f}, passes {share * 100:.1f} %")


if __name__ == "__main__":
    main()
