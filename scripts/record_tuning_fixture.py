"""Write the recorded tuning run the Tuning dashboard's backfill test reads.

The trials are replayed from the measured grid (`benchmarks/data/tuner_grid.csv`, 36 cells
measured on the real CPU vLLM): the Bayesian suggester, with a fixed seed, asks for cells in
the order a real run over that table would, and each asked cell becomes a trial record with
the cell's measured result.

    .venv/bin/python scripts/record_tuning_fixture.py            # rewrite tests/fixtures/tuning
    .venv/bin/python scripts/record_tuning_fixture.py --trials 16 --seed 3 --out /tmp/tuning

    # or a `kvpilot tune` state database's trials (add --fingerprint F for one study):
    .venv/bin/python scripts/record_tuning_fixture.py --from-db STATE/kvpilot.db --out /tmp/t
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from kvpilot.dashboards.tuning_metrics import FlagSource, LiveFlags, flags_text
from kvpilot.tuner.load.generator import plan_requests
from kvpilot.tuner.measure.traces import workload_hash
from kvpilot.tuner.problem.fingerprint import fingerprint
from kvpilot.tuner.problem.objective import TrialOutcome, TrialResult, WindowMetrics
from kvpilot.tuner.suggest import BayesianSuggester
from kvpilot.tuner.trials import Trial, TrialState, new_trial, trial_to_dict

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "benchmarks" / "data" / "tuner_grid.csv"
OUT = ROOT / "tests" / "fixtures" / "tuning"
TRIALS_FILE = "trials.jsonl"
LIVE_FLAGS_FILE = "live_flags.json"
# 2026-01-01T00:00:00Z: the replayed run's first trial starts here.
START_WALL_S = 1_767_225_600.0
TRIAL_SPACING_S = 180.0
# Server start and warm-up before the measurement window (not recorded by the grid).
START_AND_WARM_S = 60.0
# The flags every grid cell shared (benchmarks/tuner_efficiency.py's measure_cell and the
# rig's ServerSpec defaults); the fingerprint is taken over them.
FIXED_FLAGS = {"max_model_len": 1024, "block_size": 32, "max_num_batched_tokens": 2048}
MODEL = "tiny-llama"
# The server the replayed run tunes, with the rig's configured KV budget.
CONFIGURED = LiveFlags(
    MODEL, flags_text((("kv_cache_memory_bytes", 64 << 20),)), FlagSource.CONFIGURED
)


def _benchmark() -> ModuleType:
    """benchmarks/tuner_efficiency.py (not a package): its workload, SLO and table space."""
    path = ROOT / "benchmarks" / "tuner_efficiency.py"
    spec = importlib.util.spec_from_file_location("tuner_efficiency", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _float(text: str) -> float | None:
    return float(text) if text else None


def _outcome(feasible: bool, reason: str) -> TrialOutcome:
    if feasible:
        return TrialOutcome.FEASIBLE
    if reason.startswith("failed to start"):
        return TrialOutcome.FAILED_TO_START
    if "preemptions" in reason:
        return TrialOutcome.PREEMPTED
    return TrialOutcome.SLO_BROKEN


def read_rows(path: Path) -> dict[tuple[int, int], dict[str, str]]:
    """(kv_cache_memory_bytes, max_num_seqs) -> the CSV row."""
    lines = [line for line in path.read_text().splitlines() if not line.startswith("#")]
    return {
        (int(r["kv_cache_memory_bytes"]), int(r["max_num_seqs"])): r for r in csv.DictReader(lines)
    }


def cell_result(row: dict[str, str], requests: int, output_tokens: int) -> TrialResult:
    """The measured result of one cell, with its window rebuilt from the recorded figures.

    Every cell's requests all succeeded (any failure would have been the cell's reason), so
    the window's output tokens are the workload's (ignore_eos) and its duration is those
    tokens over the measured output rate; preemptions are the per-request figure times the
    requests.
    """
    feasible = row["feasible"] == "1"
    rate = _float(row["output_tokens_per_s"])
    per_request = _float(row["preemptions_per_request"])
    attainment = _float(row["attainment_ratio"])
    if not rate:
        raise ValueError(f"cell {row['kv_cache_memory_bytes']}/{row['max_num_seqs']}: no rate")
    metrics = WindowMetrics(
        source="client",
        duration_s=output_tokens / rate,
        requests_total=requests,
        requests_failed=0,
        attaining_requests=round(attainment * requests) if attainment is not None else None,
        attainment_ratio=attainment,
        ttft_p95_s=_float(row["ttft_p95_s"]),
        inter_token_p95_s=_float(row["inter_token_p95_s"]),
        output_tokens_per_s=rate,
        preemptions_total=round(per_request * requests) if per_request is not None else None,
        preemptions_per_request=per_request,
    )
    return TrialResult(
        outcome=_outcome(feasible, row["reason"]),
        goodput_tokens_per_s=_float(row["goodput_tokens_per_s"]),
        memory_bytes=int(row["kv_cache_memory_bytes"]),  # the tie-breaker: the KV budget
        reason=row["reason"] or None,
        metrics=metrics,
    )


def replay(table: Path, *, trials: int, seed: int, start_wall_s: float) -> list[Trial]:
    """The first `trials` cells a seeded Bayesian run asks for, as finished trial records."""
    bench = _benchmark()
    rows = read_rows(table)
    space = bench.table_space(bench.load_table(table))
    workload, slo = bench.MEASURE_WORKLOAD, bench.MEASURE_SLO
    output_tokens = sum(r.max_tokens for r in plan_requests(workload))
    study = fingerprint(MODEL, FIXED_FLAGS, workload_hash(workload), slo)
    suggester = BayesianSuggester(space, seed=seed)
    out = []
    for number in range(1, min(trials, len(rows)) + 1):
        candidate = suggester.ask()
        row = rows[(int(candidate["kv_cache_memory_bytes"]), int(candidate["max_num_seqs"]))]
        result = cell_result(row, workload.num_requests, output_tokens)
        suggester.tell(candidate, result)
        created = start_wall_s + (number - 1) * TRIAL_SPACING_S
        window_s = result.metrics.duration_s if result.metrics else 0.0
        trial = new_trial(f"{study[:8]}-{number:03d}", study, number, candidate.as_dict(), created)
        trial = trial.to(TrialState.RUNNING, at_wall_s=created)
        out.append(trial.finish(result, at_wall_s=created + START_AND_WARM_S + window_s))
    return out


def from_db(path: Path, fingerprint_: str | None) -> list[Trial]:
    """A `kvpilot tune` state database's trials (one study's with a fingerprint), oldest first."""
    from kvpilot.agent.state.db import Database
    from kvpilot.agent.state.trials import SqliteTrialStore

    db = Database.open(path.parent)
    try:
        return SqliteTrialStore(db).trials(fingerprint_)
    finally:
        db.close()


def write_fixture(out: Path, trials: Sequence[Trial], live: LiveFlags) -> None:
    """The trials as JSONL (one `trial_to_dict` a line) and the live flags as JSON."""
    out.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(trial_to_dict(t), sort_keys=True) for t in trials]
    (out / TRIALS_FILE).write_text("\n".join(lines) + "\n")
    flags = {"server": live.server, "flags": live.flags, "source": live.source.value}
    (out / LIVE_FLAGS_FILE).write_text(json.dumps(flags, indent=2) + "\n")


def _knob_value(text: str) -> tuple[str, int | str]:
    name, _, value = text.partition("=")
    return name, int(value) if value.isdigit() else value


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", type=Path, default=TABLE, help="the measured grid (CSV)")
    parser.add_argument("--from-db", type=Path, help="a `kvpilot tune` state database")
    parser.add_argument("--fingerprint", help="with --from-db: the study (default: all)")
    parser.add_argument("--server", default=MODEL, help="with --from-db: the tuned server")
    parser.add_argument(
        "--configured",
        action="append",
        default=[],
        metavar="KNOB=VALUE",
        help="with --from-db: a knob's configured value, before any promotion (repeat)",
    )
    parser.add_argument("--trials", type=int, default=12, help="how many cells the run asks")
    parser.add_argument("--seed", type=int, default=0, help="the Bayesian suggester's seed")
    parser.add_argument("--start-wall-s", type=float, default=START_WALL_S)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    if args.from_db is not None:
        if not args.from_db.is_file():
            print(f"record_tuning_fixture: {args.from_db}: no such database", file=sys.stderr)
            return 2
        trials = from_db(args.from_db, args.fingerprint)
        if not trials:
            print(f"record_tuning_fixture: {args.from_db}: no trials", file=sys.stderr)
            return 2
        live = CONFIGURED
        if args.configured:
            pairs = tuple(_knob_value(text) for text in args.configured)
            live = LiveFlags(args.server, flags_text(pairs), FlagSource.CONFIGURED)
    else:
        trials = replay(
            args.table, trials=args.trials, seed=args.seed, start_wall_s=args.start_wall_s
        )
        live = CONFIGURED
    write_fixture(args.out, trials, live)
    for t in trials:
        goodput = t.result.goodput_tokens_per_s if t.result else None
        print(f"#{t.number:2d} {flags_text(t.values):55s} {t.state.value:10s} {goodput}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
