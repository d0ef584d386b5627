"""The tuner against random search, auto_tune.sh and Optuna, on measured landscapes.

Two modes:

* `--measure`: offline, on the real CPU vLLM, measure the landscapes (`tuner_landscapes.py`:
  short chat, long prompts, a mix with prefix reuse, long answers under a tight inter-token
  SLO) over a grid of `--kv-cache-memory-bytes` x `--max-num-seqs`, one server start per
  cell, several windows per landscape and cell, on pinned cores (`tuner_measure.py`). Each
  landscape's table is appended cell by cell under `benchmarks/data/`, with the command in a
  header comment; a rerun measures only the cells a table lacks. `--pass N` measures the
  grid again apart; `--shuffled` takes its cells in an order shuffled by N, so that a change
  in the machine's load during the pass falls on random cells, not on a row of the grid.
  `--rates 1,1.5,2.25` sends each landscape's requests open-loop (Poisson arrivals) at
  each rate instead of all at once, one table per landscape and rate (`at_rate`); no
  such table is committed yet (measuring them takes hours on the CPU vLLM).
  `--capacity` measures each cell's capacity at each landscape's SLO instead
  (`tuner_capacity.py`: the ladder of tuner/measure/capacity.py, `--window-s` windows from
  `--start-rps`), one table per landscape, `landscape_<name>-capacity.csv` in `--out-dir`
  (default `benchmarks/data/`), with a `capacity_rps` column and the windows' per-request
  records beside it; replay it with `--table`. Four landscapes are measured this way only,
  `chat-tight`, `stream-tight`, `long-tight` and `prefix-tight` (the burst landscapes'
  traffic under an inter-token limit that binds as `max_num_seqs` grows: `CAPACITY_ONLY`).
* replay (the default): run each strategy over each table many times, a trial drawing one
  measured window of the cell it asks for (`tuner_noise`, `tuner_strategies`). Prints, per
  landscape and strategy, the regret of the configuration it would recommend after 4, 8
  and 16 trials against the memory-priced best (the least KV budget within 5 % of the best
  goodput), the share of runs within 95 % of it at 8 trials, the server starts spent, the
  goals met or not (`tuner_goals`), and one-sided Wilcoxon signed-rank tests of the
  Bayesian suggester against each other strategy, paired across landscapes
  (`tuner_regret`). Each cell pools the windows of the complete passes, except a pass the
  table's header sets aside with a comment `# pass N: ...; not replayed: why`. Each table
  is replayed as measured and with its KV axis mirrored (`--mirror none|only|both`); a
  mirror reuses the measurements and is counted as a landscape of its own, said so in the
  output. `--table PATH` (repeatable) replays any table in this CSV format, judged the same
  way (the built-in landscapes then only with `--landscapes`). `--passes 3` replays one
  pass alone. A table with a `capacity_rps` column is scored by capacity at the SLO,
  memory priced (the least KV budget within 5 % of the best capacity), else by goodput.

    .venv/bin/python benchmarks/tuner_efficiency.py --measure   # the committed tables
    .venv/bin/python benchmarks/tuner_efficiency.py             # replay every landscape
    .venv/bin/python benchmarks/tuner_efficiency.py --quick     # CI: one seed, 8 trials
    .venv/bin/python benchmarks/tuner_efficiency.py --table gpu.csv   # a table from elsewhere
    .venv/bin/python benchmarks/tuner_efficiency.py --measure --capacity --landscapes chat

`MEASURE_WORKLOAD`, `MEASURE_SLO`, `load_table` and `table_space` also describe the older
single grid (`data/tuner_grid.csv`) that `scripts/record_tuning_fixture.py` replays.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling modules, when imported

from tuner_goals import Source, replay_tables
from tuner_landscapes import (
    BY_NAME,
    BYTES_PER_BLOCK,
    CAPACITY_ONLY,
    DATA,
    LANDSCAPES,
    Landscape,
    at_rate,
)
from tuner_replay import Cell, load_table, table_space

from kvpilot.tuner.load.generator import LengthDist, Workload
from kvpilot.tuner.problem.objective import Slo

__all__ = ["MEASURE_SLO", "MEASURE_WORKLOAD", "Cell", "load_table", "main", "table_space"]

DEFAULT_TABLE = Path(__file__).resolve().parent / "data" / "tuner_grid.csv"
MEASURE_WORKLOAD = Workload(
    num_requests=48,
    prompt_len=LengthDist.uniform(64, 256),
    output_len=LengthDist.uniform(32, 128),
    concurrency=24,
    seed=11,
)
MEASURE_SLO = Slo(ttft_p95_s=3.0, inter_token_p95_s=0.25, max_preemptions_per_request=0.25)
KV_BLOCKS = "48,96,192,384,768"
SEQS = "8,16,32,64,128"


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _measure_capacity(args: argparse.Namespace, names: list[str], chosen: list[Landscape]) -> int:
    """`--measure --capacity`: the tables of `tuner_capacity`, resumable as the goodput mode."""
    from tuner_capacity import LadderSettings, measure_capacity
    from tuner_measure import Pinning

    try:
        settings = LadderSettings(args.window_s, args.start_rps)
    except ValueError as exc:
        print(
            f"error: --window-s {args.window_s:g} --start-rps {args.start_rps:g}: {exc}",
            file=sys.stderr,
        )
        return 2
    pinning = Pinning(tuple(_ints(args.server_cpus)), tuple(_ints(args.loadgen_cpus)))
    explicit = [
        "benchmarks/tuner_efficiency.py",
        "--measure",
        "--capacity",
        "--landscapes",
        ",".join(names),
        "--kv-blocks",
        args.kv_blocks,
        "--seqs",
        args.seqs,
        "--window-s",
        f"{args.window_s:g}",
        "--start-rps",
        f"{args.start_rps:g}",
        "--server-cpus",
        args.server_cpus,
        "--loadgen-cpus",
        args.loadgen_cpus,
        "--pass",
        str(args.pass_),
    ]
    command = " ".join(shlex.quote(a) for a in explicit)
    measure_capacity(
        chosen,
        _ints(args.kv_blocks),
        _ints(args.seqs),
        settings,
        pinning,
        f".venv/bin/python {command}",
        args.out_dir,
        args.pass_,
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--measure", action="store_true", help="measure on the CPU vLLM")
    parser.add_argument(
        "--landscapes", default=",".join(ls.name for ls in LANDSCAPES), help="which, in order"
    )
    parser.add_argument("--kv-blocks", default=KV_BLOCKS, help="KV budgets in 32-token blocks")
    parser.add_argument("--seqs", default=SEQS, help="max_num_seqs values")
    parser.add_argument(
        "--rates",
        default="",
        help="measure: open-loop arrival rates (requests/s), one table per landscape and rate",
    )
    parser.add_argument("--repeats", type=int, default=3, help="windows per landscape and cell")
    parser.add_argument(
        "--capacity", action="store_true", help="measure: each cell's capacity at the SLO"
    )
    parser.add_argument("--window-s", type=float, default=30.0, help="capacity: seconds a window")
    parser.add_argument("--start-rps", type=float, default=2.0, help="capacity: the first rate")
    parser.add_argument(
        "--out-dir", type=Path, default=DATA, help="capacity: where its tables are written"
    )
    parser.add_argument("--pass", dest="pass_", type=int, default=1, help="1, 2, ...: again")
    parser.add_argument(
        "--shuffled", action="store_true", help="measure the cells in an order shuffled by pass"
    )
    parser.add_argument("--server-cpus", default="0", help="the server's cores ('' = unpinned)")
    parser.add_argument("--loadgen-cpus", default="1", help="the load generator's cores")
    parser.add_argument("--seeds", type=int, default=20, help="replay: runs per strategy")
    parser.add_argument("--quick", action="store_true", help="a short replay for CI")
    parser.add_argument("--passes", default="", help="replay: only these passes (e.g. 3,4)")
    parser.add_argument(
        "--mirror",
        choices=("both", "none", "only"),
        default="both",
        help="replay each table as measured, with its KV axis mirrored, or both",
    )
    parser.add_argument(
        "--table",
        action="append",
        default=[],
        type=Path,
        help="replay this table (the committed CSV format); repeatable",
    )
    args = parser.parse_args(args_list)
    explicit_landscapes = any(a.startswith("--landscapes") for a in args_list)
    if args.table and not explicit_landscapes:
        args.landscapes = ""
    if args.seeds < 1:
        parser.error("--seeds must be at least 1")
    names = [n.strip() for n in args.landscapes.split(",") if n.strip()]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        parser.error(f"unknown landscape(s) {', '.join(unknown)}; known: {', '.join(BY_NAME)}")
    chosen = [BY_NAME[n] for n in names]
    if args.measure and args.capacity:
        return _measure_capacity(args, names, chosen)
    by_capacity = [ls.name for ls in chosen if ls in CAPACITY_ONLY]
    if by_capacity:  # their SLO binds only on open-loop arrivals; a burst would not show it
        parser.error(
            f"{', '.join(by_capacity)}: measured by capacity only (--measure --capacity); "
            "replay its table with --table"
        )
    if args.measure:
        try:
            rates = [float(r) for r in args.rates.split(",") if r.strip()]
            chosen = [at_rate(ls, r) for ls in chosen for r in rates] if rates else chosen
        except ValueError as exc:
            parser.error(f"--rates {args.rates}: {exc}")
        from tuner_measure import Pinning, measure

        pinning = Pinning(tuple(_ints(args.server_cpus)), tuple(_ints(args.loadgen_cpus)))
        explicit = [
            "benchmarks/tuner_efficiency.py",
            "--measure",
            "--landscapes",
            ",".join(names),
            "--kv-blocks",
            args.kv_blocks,
            "--seqs",
            args.seqs,
            "--repeats",
            str(args.repeats),
            "--server-cpus",
            args.server_cpus,
            "--loadgen-cpus",
            args.loadgen_cpus,
            "--pass",
            str(args.pass_),
            *(["--shuffled"] if args.shuffled else []),
            *(["--rates", args.rates] if args.rates else []),
        ]
        command = " ".join(shlex.quote(a) for a in explicit)
        measure(
            chosen,
            _ints(args.kv_blocks),
            _ints(args.seqs),
            args.repeats,
            pinning,
            f".venv/bin/python {command}",
            args.pass_,
            args.shuffled,
        )
        return 0
    finish = (
        f".venv/bin/python benchmarks/tuner_efficiency.py --measure --kv-blocks {args.kv_blocks} "
        f"--seqs {args.seqs} --repeats {args.repeats} --landscapes "
    )
    grid = [(b * BYTES_PER_BLOCK, n) for n in _ints(args.seqs) for b in _ints(args.kv_blocks)]
    sources = [Source(ls.name, ls.table, grid, finish + ls.name) for ls in chosen]
    sources += [
        Source(path.stem, path, None, f"measure it again: {path} lacks cells")
        for path in args.table
    ]
    for path in args.table:
        if not path.is_file():
            parser.error(f"--table {path}: no such file")
    passes = set(_ints(args.passes)) or None
    if args.quick:
        return replay_tables(sources, 1, (4, 8), args.mirror, passes)
    return replay_tables(sources, args.seeds, (4, 8, 16), args.mirror, passes)


if __name__ == "__main__":
    sys.exit(main())
