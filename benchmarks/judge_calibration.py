"""The canary judge calibrated on the real CPU vLLM: A/A windows, then injected regressions.

Two servers with one configuration, each pinned to a core of its own (as a parallel canary
runs beside the stable server), get the same workload at the same time, window after window,
through the tuner's own observer (`LoadObserver`). The sides swap every window, so a slower
core is noise here, not a bias. Each window's samples (one per request, per interval for
goodput, counts for errors and preemptions) are kept in a JSON-lines file, and then:

* **False-fail rate**: the share of A/A windows the judge calls FAIL or MARGINAL (worse on
  some counted metric, the whole family together), with its 95 % Wilson interval; also the
  shares of PASS and INCONCLUSIVE (evidence too thin to promote).
* **Power**: a regression (`--shift`, 10 % by default) is injected into the canary side of
  recorded windows (every TTFT times 1.1, which moves the p95 by 10 %; or goodput times
  0.9), and the judge runs on analyses of k consecutive windows, k = 1, 2, 4, ...: the
  share of analyses it counts that metric against the canary, and the share it passes
  (would promote). TTFT is judged with the SLO's tolerance (10 % of the SLO's limit: a
  change far below the limit is let through by design) and without it. The noise is real
  (what the servers did); only the shift is made.
* **What it takes to pass**: the share of A/A analyses of k windows that pass, since a
  judge that needs evidence to pass also needs the analysis time to gather it.

    .venv/bin/python benchmarks/judge_calibration.py --pairs 60       # measure, then analyse
    .venv/bin/python benchmarks/judge_calibration.py --analyse FILE   # analyse recorded pairs
    .venv/bin/python benchmarks/judge_calibration.py --analyse FILE --shift 0.2

The analysis ends with the least k from which every longer analysis counts each regression
against the canary 80 % of the time. At a shift equal to a metric's margin that is out of
reach by design (counting against needs the estimate past the margin: a coin toss there),
so the most each regression was passed at any k is printed beside it.

The goal: a false-fail rate of at most 5 %, family-wise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvpilot.agent.tuning.observer import LoadObserver
from kvpilot.rig.server import ServerSpec, VllmServer, free_port
from kvpilot.tuner.judge.evidence import Counts, Samples, wilson_interval
from kvpilot.tuner.judge.judgement import Classification, JudgeConfig, Judgement, judge
from kvpilot.tuner.judge.sequential import Look, LookDecision, LookPlan, judge_look
from kvpilot.tuner.judge.windows import MIN_WINDOWS, Window, judge_windows, pooled
from kvpilot.tuner.load.generator import LengthDist, Workload
from kvpilot.tuner.problem.objective import Slo

DATA = Path(__file__).resolve().parent / "data"
BLOCK_BYTES = 32 * 1024  # the tiny model's KV bytes per 32-token block
# The tuning tests' study at a roomy budget: 384-token prompts, 64 tokens out, 16 at once.
WORKLOAD = Workload(
    num_requests=48,
    prompt_len=LengthDist.uniform(256, 512),
    output_len=LengthDist.uniform(32, 96),
    concurrency=16,
    seed=7,
)
SLO = Slo(ttft_p95_s=3.5, inter_token_p95_s=0.25)
KV_BYTES = 512 * BLOCK_BYTES
FALSE_FAIL_GOAL = 0.05
SHIFT = 0.10
POWER_GOAL = 0.80  # the share of analyses that should count a regression against
WORSE = (Classification.FAIL, Classification.MARGINAL)


@dataclass(frozen=True, slots=True)
class Pair:
    """One A/A window: the canary side's samples and the baseline side's."""

    canary: Mapping[str, Samples]
    baseline: Mapping[str, Samples]


def _to_json(samples: Mapping[str, Samples]) -> dict[str, object]:
    return {
        name: {"events": v.events, "exposure": v.exposure} if isinstance(v, Counts) else list(v)
        for name, v in samples.items()
    }


def _from_json(raw: Mapping[str, object]) -> dict[str, Samples]:
    out: dict[str, Samples] = {}
    for name, v in raw.items():
        if isinstance(v, dict):
            out[name] = Counts(float(v["events"]), float(v["exposure"]))
        elif isinstance(v, list):
            out[name] = tuple(float(x) for x in v)
    return out


def load_pairs(path: Path) -> list[Pair]:
    pairs = []
    for line in path.read_text().splitlines():
        if line.strip():
            raw = json.loads(line)
            pairs.append(Pair(_from_json(raw["canary"]), _from_json(raw["baseline"])))
    return pairs


async def _measure(path: Path, pairs: int, cpus: Sequence[int]) -> None:
    specs = [
        ServerSpec(port=free_port(), kv_cache_memory_bytes=KV_BYTES, max_num_seqs=16, cpus=(c,))
        for c in cpus[:2]
    ]
    with VllmServer(specs[0]) as a, VllmServer(specs[1]) as b:
        a.wait_healthy()
        b.wait_healthy()
        observer = LoadObserver(WORKLOAD, model="tiny-llama")
        await observer.warm([a.url, b.url])
        with path.open("a") as out:
            for i in range(pairs):
                started = time.monotonic()
                first, second = await observer.observe([a.url, b.url])
                canary, baseline = (second, first) if i % 2 == 0 else (first, second)
                record = {
                    "canary": _to_json(canary.samples),
                    "baseline": _to_json(baseline.samples),
                    "canary_url": canary.url,
                    "seconds": round(time.monotonic() - started, 2),
                }
                out.write(json.dumps(record) + "\n")
                out.flush()
                print(f"pair {i + 1}/{pairs}: {record['seconds']} s", flush=True)


def _regressed(samples: Mapping[str, Samples], metric: str, shift: float) -> dict[str, Samples]:
    out = dict(samples)
    values = out.get(metric, ())
    factor = 1 + shift if metric == "ttft_s" else 1 - shift
    if not isinstance(values, Counts):
        out[metric] = tuple(x * factor for x in values)
    return out


def _shares(verdicts: Sequence[Judgement]) -> str:
    n = max(len(verdicts), 1)
    counts = {c: sum(v.classification is c for v in verdicts) for c in Classification}
    return ", ".join(f"{c.value} {counts[c] / n:.0%}" for c in Classification)


def _judge(
    way: str, run: Sequence[Pair], regress: tuple[str, float] | None, limits: Mapping[str, float]
) -> Judgement:
    """One analysis of `run`: pooled or by windows, with a regression (metric, shift) injected
    when asked."""
    windows = [
        Window(_regressed(p.canary, *regress) if regress else p.canary, p.baseline) for p in run
    ]
    if way == "windows":
        return judge_windows(windows, JudgeConfig(), limits)
    return judge(
        pooled([w.canary for w in windows]),
        pooled([w.baseline for w in windows]),
        JudgeConfig(),
        limits,
    )


def analysis_lengths(n: int) -> list[int]:
    """The k of the analyses: 1, 2, 4, the judge's least windows, then doubling up to `n`."""
    lengths = {1, 2, 4, MIN_WINDOWS}
    k = 8
    while k <= n:
        lengths.add(k)
        k *= 2
    return sorted(x for x in lengths if x <= n)


def least_windows(shares: Mapping[int, float], goal: float = POWER_GOAL) -> int | None:
    """The least k from which on every longer analysis caught the regression `goal` of the
    time (None: not within the longest); a k that reaches it once and falls back is not it."""
    found = None
    for k in sorted(shares, reverse=True):
        if shares[k] < goal:
            break
        found = k
    return found


def print_power(
    caught_at: Mapping[tuple[str, str], Mapping[int, tuple[float, float]]], window_s: float
) -> None:
    """Per way of judging and regression: the analysis time that counts it against the canary
    `POWER_GOAL` of the time, and the most it was passed (promoted) at any length."""
    print(f"analysis time for {POWER_GOAL:.0%} power (counted against the canary):")
    for (way, regression), shares in caught_at.items():
        against = {k: share for k, (share, _) in shares.items()}
        k = least_windows(against)
        longest = max(against)
        said = (
            f"k={k} windows (about {k * window_s:.0f} s)"
            if k is not None
            else f"not reached within k={longest} ({against[longest]:.0%} there)"
        )
        promoted = max(passed for _, passed in shares.values())
        print(f"  {way}, {regression}: {said}; passed at most {promoted:.0%} at any k")


def analyse(pairs: Sequence[Pair], window_s: float, shift: float = SHIFT) -> bool:
    """Print the calibration, regressions injected by `shift`; True when the false-fail goal
    is met on single windows."""
    config = JudgeConfig()
    limits = SLO.judge_limits()
    verdicts = [judge(p.canary, p.baseline, config, limits) for p in pairs]
    n = len(verdicts)
    worse = sum(v.classification in WORSE for v in verdicts)
    low, high = wilson_interval(worse, n, 1.96) if n else (0.0, 1.0)
    met = n > 0 and worse / n <= FALSE_FAIL_GOAL
    print(f"A/A: {n} windows of about {window_s:.1f} s, one configuration on both sides")
    print(f"  single windows: {_shares(verdicts)}")
    print(
        f"  false-fail rate (fail or marginal, all metrics together): {worse / max(n, 1):.1%} "
        f"(95 % interval {low:.1%}-{high:.1%}); goal <= {FALSE_FAIL_GOAL:.0%}: "
        f"{'met' if met else 'NOT met'}"
    )
    against: dict[str, int] = {}
    for v in verdicts:
        for m in v.metrics:
            if m.counts_against:
                against[m.name] = against.get(m.name, 0) + 1
    if against:
        named = ", ".join(f"{k} {v}" for k, v in against.items())
        print(f"  metrics counted against the canary: {named}")
    print("analyses of k consecutive windows (disjoint runs), judged two ways:")
    print("  pooled: every request of the k windows as one sample (`judge`)")
    print("  windows: one summary per window, paired by window (`judge_windows`)")
    # (way, regression) -> k -> (share counted against, share passed)
    caught_at: dict[tuple[str, str], dict[int, tuple[float, float]]] = {}
    for k in analysis_lengths(n):
        # Disjoint runs: overlapping ones share windows, and are not independent analyses.
        runs = [pairs[i : i + k] for i in range(0, n - k + 1, k)]
        for way in ("pooled", "windows"):
            if way == "windows" and k < MIN_WINDOWS:
                continue
            same = [_judge(way, run, None, limits) for run in runs]
            print(f"  k={k} (about {k * window_s:.0f} s) {way}, A/A: {_shares(same)}")
            for metric, judged_limits in (
                ("goodput_tokens_per_s", limits),
                ("ttft_s", limits),
                ("ttft_s", {}),  # the margin from its level alone, 10 %, without the SLO's
            ):
                got = [_judge(way, run, (metric, shift), judged_limits) for run in runs]
                caught = sum(
                    any(m.name == metric and m.counts_against for m in g.metrics) for g in got
                )
                against, passed = caught / len(runs), sum(g.promote for g in got) / len(runs)
                named = f"{metric} {shift:.0%} worse{'' if judged_limits else ' (no SLO)'}"
                print(f"    {named}: counted against {against:.0%}, passed {passed:.0%}")
                caught_at.setdefault((way, named), {})[k] = (against, passed)
    print_power(caught_at, window_s)
    return met


# The sequential judge: block-bootstrap runs of `LOOKS[-1]` windows, resampled in blocks of
# consecutive windows (neighbouring windows share the machine's drift), and the disjoint runs
# the recording holds.
BLOCK = 8
BOOTSTRAP_RUNS = 200


def _bootstrap_run(pairs: Sequence[Pair], length: int, rng: random.Random) -> list[Pair]:
    """`length` windows: blocks of `BLOCK` consecutive windows drawn with replacement."""
    out: list[Pair] = []
    while len(out) < length:
        start = rng.randrange(0, len(pairs) - BLOCK + 1)
        out.extend(pairs[start : start + BLOCK])
    return out[:length]


def _with_failures(samples: Mapping[str, Samples], share: float, rng: random.Random) -> dict:
    out = dict(samples)
    errors = out.get("errors_ratio", ())
    if not isinstance(errors, Counts):
        out["errors_ratio"] = tuple(1.0 if rng.random() < share else e for e in errors)
    return out


def _slow_tail(samples: Mapping[str, Samples], share: float, rng: random.Random) -> dict:
    out = dict(samples)
    ttft = out.get("ttft_s", ())
    if not isinstance(ttft, Counts):
        out["ttft_s"] = tuple(t * 10 if rng.random() < share else t for t in ttft)
    return out


Injection = Callable[[Mapping[str, Samples], random.Random], Mapping[str, Samples]]
INJECTIONS: dict[str, Injection | None] = {
    "A/A (equal)": None,
    "every TTFT x1.1": lambda s, _r: _regressed(s, "ttft_s", 0.1),
    "goodput -20 %": lambda s, _r: _regressed(s, "goodput_tokens_per_s", 0.2),
    "10 % of requests at 10x TTFT": lambda s, r: _slow_tail(s, 0.1, r),
    "1 % errors against 0 %": lambda s, r: _with_failures(s, 0.01, r),
}


def _sequential(run: Sequence[Pair], inject: Injection | None, rng: random.Random) -> Look:
    windows = [Window(inject(p.canary, rng) if inject else p.canary, p.baseline) for p in run]
    plan = LookPlan()
    for at in plan.looks:
        look = judge_look(windows[:at], plan, JudgeConfig(), SLO.judge_limits())
        if look.decision is not LookDecision.CONTINUE:
            return look
    raise AssertionError("the last look decides")


def _rate(k: int, n: int) -> str:
    low, high = wilson_interval(k, n, 1.96) if n else (0.0, 1.0)
    return f"{k}/{n} = {k / max(n, 1):.1%} (95 % interval {low:.1%}-{high:.1%})"


def analyse_sequential(pairs: Sequence[Pair], runs: int = BOOTSTRAP_RUNS, seed: int = 0) -> None:
    """The sequential judge (looks at 8/16/32/64 windows, Pocock's alpha spending) on
    block-bootstrap runs and on the recording's disjoint runs, per injected change."""
    length = LookPlan().looks[-1]
    disjoint = [pairs[i : i + length] for i in range(0, len(pairs) - length + 1, length)]
    print(
        f"sequential judge, looks {LookPlan().looks}: {runs} block-bootstrap runs of {length} "
        f"windows (blocks of {BLOCK}) and {len(disjoint)} disjoint runs of the recording"
    )
    print(
        "  (the bootstrap interval is its Monte Carlo error; the recording's own uncertainty "
        "is the disjoint runs' interval)"
    )
    for name, inject in INJECTIONS.items():
        rng = random.Random(seed)
        boot = [_sequential(_bootstrap_run(pairs, length, rng), inject, rng) for _ in range(runs)]
        own = [_sequential(run, inject, rng) for run in disjoint]
        for label, looks in (("bootstrap", boot), ("disjoint", own)):
            worse = sum(lk.judgement.classification in WORSE for lk in looks)
            passed = sum(lk.decision is LookDecision.PASS for lk in looks)
            by_32 = sum(lk.decision is LookDecision.PASS and lk.windows <= 32 for lk in looks)
            stops = sorted(lk.windows for lk in looks if lk.decision is LookDecision.FAIL)
            median = stops[(len(stops) - 1) // 2] if stops else None
            print(
                f"  {name}, {label}: fail or marginal {_rate(worse, len(looks))}; "
                f"passed {_rate(passed, len(looks))}; passed by 32 windows {by_32}; "
                f"median FAIL stop {median} windows"
            )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--pairs", type=int, default=60, help="A/A windows to measure")
    parser.add_argument("--out", type=Path, default=DATA / "judge_aa.jsonl")
    parser.add_argument("--analyse", type=Path, help="analyse recorded pairs, measure nothing")
    parser.add_argument("--cpus", default="0,1", help="the two servers' cores")
    parser.add_argument(
        "--shift", type=float, default=SHIFT, help="the injected regression (0.1: 10 %% worse)"
    )
    parser.add_argument(
        "--sequential",
        action="store_true",
        help="analyse the sequential judge only (block bootstrap and disjoint runs)",
    )
    parser.add_argument("--runs", type=int, default=BOOTSTRAP_RUNS, help="bootstrap runs")
    args = parser.parse_args(argv)
    if not 0 < args.shift < 1:
        parser.error(f"--shift {args.shift:g}: a regression is a share between 0 and 1")
    path = args.analyse or args.out
    if args.analyse is None:
        cpus = [int(c) for c in args.cpus.split(",")]
        if len(cpus) < 2:
            parser.error("--cpus needs two cores, one a side")
        path.parent.mkdir(parents=True, exist_ok=True)
        asyncio.run(_measure(path, args.pairs, cpus))
    if not path.exists():
        parser.error(f"{path}: no recorded pairs")
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    window_s = sum(x.get("seconds", 0.0) for x in lines) / max(len(lines), 1)
    if args.sequential:
        analyse_sequential(load_pairs(path), args.runs)
        return 0
    return 0 if analyse(load_pairs(path), window_s, args.shift) else 1


if __name__ == "__main__":
    sys.exit(main())
