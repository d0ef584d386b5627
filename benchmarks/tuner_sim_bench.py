"""The re-founded tuner benchmark: strategies on simulated landscapes, the product's objective.

    .venv/bin/python benchmarks/tuner_sim_bench.py --set dev            # development set
    .venv/bin/python benchmarks/tuner_sim_bench.py --set test           # test set, and the
                                                                        # measured CPU tables
    .venv/bin/python benchmarks/tuner_sim_bench.py --quick              # CI: seconds

Per landscape and strategy: the regret of what was promoted at the wall-time budget (the
extra KV blocks over the least feasible configuration, as a share of it; an infeasible
recommendation scores 1) beside the landscape's noise floor (the regret of the least
configuration the judge passes half the time at 64 windows) and its reach (the least regret
the judge passes in 80 % of runs: where the reach is above 0.05, one judged try of any
configuration within 0.05 passes in fewer than 80 % of runs), the share of runs within 0.05,
failed starts, promotions, worse promotions and the time to the first, and the capacity held
(a second score: capacity over the target). Across landscapes: one-sided Wilcoxon
signed-rank tests of the product's suggester against random search and Optuna's GP, and
whether random search meets the goal (0.05 in 80 % of runs) on at most 2 of 12.
Landscapes: `tuner_sim.py`; trials, costs and the judge: `tuner_sim_run.py`.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling modules, when imported

from tuner_sim import DEV_SEEDS, TEST_SEEDS, Config, Landscape, draw_landscape
from tuner_sim_run import BUDGET_S, LOOKS, WINDOW_SD, Strategy, Z, margin_passed, strategies

GOAL_REGRET = 0.05
GOAL_SHARE = 0.8
PRODUCT = "bayes"  # tuning.suggester's default: what `kvpilot tune` and scheduled tuning run


@dataclass(frozen=True, slots=True)
class Cell:
    """One strategy on one landscape, over its runs."""

    regret: float  # mean
    within: float  # share of runs within GOAL_REGRET
    failed_starts: float
    promotions: float
    worse: float
    first_s: float | None  # median over runs that promoted
    capacity: float  # mean capacity held over the target

    @property
    def goal_met(self) -> bool:
        return self.within >= GOAL_SHARE


def regret_of(ls: Landscape, least: int | None) -> Callable[[Config], float]:
    def regret(c: Config) -> float:
        if least is None or not ls.starts(c) or ls.capacity(c) < ls.target_rps:
            return 1.0
        return min(1.0, (ls.blocks(c) - least) / least)

    return regret


def measure_cell(ls: Landscape, strategy: Strategy, runs: int) -> tuple[Cell, float]:
    least = ls.least_feasible_blocks()
    regret = regret_of(ls, least)
    regrets, fails, proms, worse, first, caps = [], [], [], [], [], []
    for seed in range(runs):
        record = strategy(ls, seed, regret)
        r = regret(record.stable)
        regrets.append(r)
        fails.append(record.failed_starts)
        proms.append(record.promotions)
        worse.append(record.worse_promotions)
        caps.append(ls.capacity(record.stable) / ls.target_rps)
        if record.first_promotion_s is not None:
            first.append(record.first_promotion_s)
    cell = Cell(
        statistics.fmean(regrets),
        sum(r <= GOAL_REGRET for r in regrets) / runs,
        statistics.fmean(fails),
        statistics.fmean(proms),
        statistics.fmean(worse),
        statistics.median(first) if first else None,
        statistics.fmean(caps),
    )
    return cell, statistics.fmean(regrets)


def noise_floor(ls: Landscape) -> float:
    """The regret of the least configuration the judge passes half the time at 64 windows."""
    return reach(ls, Z * WINDOW_SD / math.sqrt(LOOKS[-1]))


def reach(ls: Landscape, margin: float) -> float:
    """The regret of the least configuration whose true log margin over the target is
    `margin` (`margin_passed(GOAL_SHARE)`: the judge passes it in 80 % of runs)."""
    least = ls.least_feasible_blocks()
    reached = ls.least_feasible_blocks(math.exp(margin))
    if least is None or reached is None:
        return 1.0
    return reached / least - 1


def wilcoxon_line(name: str, product: list[float], other: list[float]) -> str:
    from scipy.stats import wilcoxon

    diffs = [a - b for a, b in zip(product, other, strict=True)]
    ties = sum(d == 0 for d in diffs)
    wins = sum(d < 0 for d in diffs)
    if ties == len(diffs):
        return f"  vs {name}: all {ties} tied"
    p = wilcoxon(product, other, alternative="less", zero_method="zsplit").pvalue
    return f"  vs {name}: better on {wins}, tied {ties} of {len(diffs)}; one-sided p = {p:.3g}"


def report(seeds: Sequence[int], names: Sequence[str], runs: int, product: str) -> int:
    table = strategies()
    unknown = [n for n in names if n not in table]
    if unknown:
        print(f"error: unknown strategy {', '.join(unknown)}; known: {', '.join(table)}")
        return 2
    print(f"budget {BUDGET_S:.0f} s a run, {runs} runs per landscape and strategy")
    print("regret (mean) | within 0.05 | failed starts | promotions (worse) | first s | capacity")
    means: dict[str, list[float]] = {n: [] for n in names}
    fails: dict[str, list[float]] = {n: [] for n in names}
    met: dict[str, int] = {n: 0 for n in names}
    met_attainable: dict[str, int] = {n: 0 for n in names}
    margin = margin_passed(GOAL_SHARE)
    attainable = 0
    for seed in seeds:
        ls = draw_landscape(seed)
        reached = reach(ls, margin)
        attainable += reached <= GOAL_REGRET
        print(f"{ls.name}  noise floor {noise_floor(ls):.3f}  reach {reached:.3f}")
        for name in names:
            cell, mean = measure_cell(ls, table[name], runs)
            means[name].append(mean)
            fails[name].append(cell.failed_starts)
            met[name] += cell.goal_met
            met_attainable[name] += cell.goal_met and reached <= GOAL_REGRET
            first = f"{cell.first_s:.0f}" if cell.first_s is not None else "-"
            print(
                f"  {name:<11} {cell.regret:6.3f} | {cell.within:4.0%} | {cell.failed_starts:4.1f}"
                f" | {cell.promotions:4.1f} ({cell.worse:.1f}) | {first:>5} | {cell.capacity:5.2f}"
            )
    print(
        f"the goal is within the judge's reach on {attainable} of {len(seeds)} landscapes"
        f" (reach at most {GOAL_REGRET}: a margin of {margin:.4f} passes in"
        f" {GOAL_SHARE:.0%} of runs); on the others one judged try within {GOAL_REGRET}"
        f" passes in fewer than {GOAL_SHARE:.0%}"
    )
    print("across landscapes: mean regret, goal met (within 0.05 in 80 % of runs), failed starts")
    for name in names:
        print(
            f"  {name:<11} {statistics.fmean(means[name]):.3f}  goal {met[name]}/{len(seeds)}"
            f" ({met_attainable[name]}/{attainable} within reach)"
            f"  failed starts {statistics.fmean(fails[name]):.2f}"
        )
    if product in names and len(seeds) >= 2:
        print(f"{product} (the product's suggester), one-sided Wilcoxon on mean regret:")
        for other in ("random", "optuna-gp"):
            if other in names and other != product:
                print(wilcoxon_line(other, means[product], means[other]))
        if "random" in names and product != "random":
            print(f"{product}, one-sided Wilcoxon on failed starts a run:")
            print(wilcoxon_line("random", fails[product], fails["random"]))
    if "random" in names:
        verdict = "discriminates" if met["random"] <= 2 else "does not discriminate"
        print(f"random search meets the goal on {met['random']} of {len(seeds)}: {verdict}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--set", choices=("dev", "test"), default="dev", help="landscapes")
    parser.add_argument("--runs", type=int, default=10, help="runs per landscape and strategy")
    parser.add_argument("--strategies", default="", help="comma-separated; default all")
    parser.add_argument("--product", default=PRODUCT, help="the product's suggester's name")
    parser.add_argument("--quick", action="store_true", help="CI: 2 landscapes, 2 runs")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    names = [n.strip() for n in args.strategies.split(",") if n.strip()] or list(strategies())
    if args.quick:
        return report(DEV_SEEDS[:2], [n for n in names if n != "optuna-gp"], 2, args.product)
    if args.set == "dev":
        return report(DEV_SEEDS, names, args.runs, args.product)
    code = report(TEST_SEEDS, names, args.runs, args.product)
    from tuner_efficiency import main as replay_measured

    print("\nthe measured CPU tables (replayed apart, no mirrors):")
    tables = sorted((Path(__file__).resolve().parent / "data").glob("landscape_*-capacity.csv"))
    argv_tables = [a for t in tables for a in ("--table", str(t))]
    return code or replay_measured([*argv_tables, "--mirror", "none"])


if __name__ == "__main__":
    sys.exit(main())
