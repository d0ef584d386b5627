"""How long the CPU vLLM takes to start and answer /health, by executor.

The CPU build's default runs the model in a worker process of its own beside the engine
core (the multiprocessing executor), which imports vLLM and torch a third time;
`--distributed-executor-backend uni` runs it inside the engine core, as vLLM does on a GPU
with one device. The rig's servers (and so the tests, the demo and the benchmarks) use `uni`.
The two alternate, A, B, A, B, each pinned to one core as the tests pin it, so that a drift
in the machine's load falls on both; prints each median and the ratio.

    .venv/bin/python benchmarks/server_start.py --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import time

from kvpilot.rig.server import ServerSpec, VllmServer, free_port


def start_seconds(*, default_executor: bool, cpu: int) -> float:
    executor = None if default_executor else "uni"
    spec = ServerSpec(
        port=free_port(), kv_cache_memory_bytes=8 << 20, cpus=(cpu,), executor=executor
    )
    server = VllmServer(spec)
    started = time.monotonic()
    server.start()
    try:
        server.wait_healthy(timeout_s=300.0)
        return time.monotonic() - started
    finally:
        server.stop()
        server.log_path.unlink(missing_ok=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="starts of each executor")
    parser.add_argument("--cpu", type=int, default=0, help="the core the server is pinned to")
    args = parser.parse_args()
    times: dict[str, list[float]] = {"multiprocessing (default)": [], "uni": []}
    for n in range(args.rounds):
        for name, default in (("multiprocessing (default)", True), ("uni", False)):
            took = start_seconds(default_executor=default, cpu=args.cpu)
            times[name].append(took)
            print(f"round {n + 1}, {name}: {took:.1f} s", flush=True)
    for name, values in times.items():
        shown = ", ".join(f"{v:.1f}" for v in values)
        print(f"{name}: median {statistics.median(values):.1f} s ({shown})")
    ratio = statistics.median(times["uni"]) / statistics.median(times["multiprocessing (default)"])
    print(f"ratio uni / multiprocessing: {ratio:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
