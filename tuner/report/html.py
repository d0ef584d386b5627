"""`kvpilot tune report`: one self-contained HTML page with hand-built inline SVG plots.

No scripts, fonts or external files. Every chart marks the stable configuration (orange):
the convergence plot (best-so-far goodput, the stable's measured goodput as a dashed line),
the knob map (trials coloured by goodput over the two main knobs, the region the search
space's constraints refuse, the planner's among them, shaded, the stable as a diamond), and
per canary the stable (baseline) beside the canary for every judged metric. The judge keeps
medians, not raw samples, so a metric is drawn as the two medians (and the window's p95
where the trial recorded it), with its verdict. A chart without data is one sentence, never
an empty frame. The workload the last run replayed is drawn by `tuner.report.workload`.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvpilot.tuner.judge.judgement import Judgement
from kvpilot.tuner.load.learned import WorkloadShape
from kvpilot.tuner.problem.constraints import Value
from kvpilot.tuner.problem.objective import Slo
from kvpilot.tuner.problem.space import KnobKind, SearchSpace
from kvpilot.tuner.report.evidence import evidence_table, memory_priced_choice
from kvpilot.tuner.report.svg import (
    INFEASIBLE_FILL,
    PAD,
    STABLE_COLOUR,
    Axis,
    H,
    W,
    axis_for,
    colour,
    cross,
    esc,
    frame,
    numeric,
    stable_mark,
    svg_open,
)
from kvpilot.tuner.report.table import kv_usage_text, result_cells, warmup_text
from kvpilot.tuner.report.workload import workload_svg
from kvpilot.tuner.trials import Trial, TrialState

DEFAULT_TITLE = "kvpilot tuning report"
_VERDICT_COLOUR = {
    "pass": "#2e7d32",
    "high": "#c62828",
    "low": "#1565c0",
    "inconclusive": "#ef6c00",
    "nodata": "#9e9e9e",
}
_P95 = {"ttft_s": "ttft_p95_s", "inter_token_s": "inter_token_p95_s"}
_GRID = (56, 36)  # cells across and down in which the knob map asks the constraints
_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px;color:#222}
h1{font-size:22px}h2{font-size:17px;margin-top:28px}table{border-collapse:collapse;font-size:13px}
td,th{border-bottom:1px solid #ddd;padding:3px 8px;text-align:right}th{background:#f5f5f5}
td.l,th.l{text-align:left}.muted{color:#777}svg{background:#fff;border:1px solid #eee;display:block}
"""


@dataclass(frozen=True, slots=True)
class ReportContext:
    """What the page knows besides the trials. `space`: the knobs and their constraints (the
    planner's among them) for the knob map's infeasible region; `stable`: the stable
    configuration's knob values; `notes`: why something is missing (shown as is)."""

    space: SearchSpace | None = None
    stable: Mapping[str, Value] | None = None
    notes: tuple[str, ...] = ()
    # The workload the last run replayed: its learned shape (None: not learned), where it
    # came from and why, and the configured (prompt, output) lengths marked beside it.
    workload: WorkloadShape | None = None
    workload_note: str | None = None
    configured_lengths: tuple[int, int] | None = None


def render_report(
    trials: Sequence[Trial],
    *,
    title: str = DEFAULT_TITLE,
    space: SearchSpace | None = None,
    context: ReportContext | None = None,
) -> str:
    """The whole page as a string."""
    ctx = context or ReportContext(space=space)
    if space is not None and ctx.space is None:
        ctx = dataclasses.replace(ctx, space=space)
    parts = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        f"<title>{esc(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{esc(title)}</h1>",
        f"<p class='muted'>{len(trials)} trials, "
        f"{sum(t.state is TrialState.COMPLETE for t in trials)} feasible, "
        f"{sum(t.state is TrialState.INFEASIBLE for t in trials)} infeasible. "
        f"<span style='color:{STABLE_COLOUR}'>Orange marks the stable configuration.</span></p>",
        *(f"<p class='muted'>{esc(note)}</p>" for note in ctx.notes),
        "<h2>Convergence: best goodput so far</h2>",
        memory_priced_choice(trials, Slo()),
        best_so_far_svg(trials),
        "<h2>Knob map: trials over the two main knobs</h2>",
        knob_scatter_svg(trials, ctx.space, ctx.stable),
        "<h2>Workload replayed</h2>",
        f"<p class='muted'>{esc(ctx.workload_note or 'No run recorded its workload yet.')}</p>",
        workload_svg(ctx.workload, ctx.configured_lengths) if ctx.workload else "",
        "<h2>Stable (baseline) and canary, per trial</h2>",
        "<p class='muted'>Per metric: the stable (baseline) median in orange above the "
        "canary's, coloured by its verdict (red counts against); a black tick is the window's "
        "p95. The judge keeps medians, not samples. Goodput and memory are the two windows' "
        "measurements. Each metric has its own scale.</p>",
    ]
    compared = [t for t in trials if t.judgement is not None or t.baseline is not None]
    if not compared:
        parts.append("<p class='muted'>No trial ran a canary beside the stable yet.</p>")
    for trial in compared:
        goodput, memory, base_goodput, base_memory = result_cells(trial)
        verdict = trial.judgement.classification.value if trial.judgement else "not judged"
        why = trial.judgement.reason if trial.judgement else (trial.reason or "")
        parts.append(
            f"<h3>Trial {trial.number}: {esc(verdict)} <span class='muted'>({esc(why)})</span></h3>"
            f"<p>candidate {esc(goodput)} tok/s, {esc(memory)}; baseline "
            f"{esc(base_goodput)} tok/s, {esc(base_memory)}; warm-up {esc(warmup_text(trial))}. "
            "<span class='muted'>KV usage is shown, never counted.</span></p>"
        )
        parts.append(trial_comparison_svg(trial))
        parts.append(evidence_table(trial.judgement.metrics if trial.judgement else ()))
    parts += ["<h2>All trials</h2>", _trials_html(trials), "</body></html>"]
    return "\n".join(parts)


def write_report(
    path: str | Path,
    trials: Sequence[Trial],
    *,
    title: str = DEFAULT_TITLE,
    space: SearchSpace | None = None,
    context: ReportContext | None = None,
) -> Path:
    """Write the page; returns its path."""
    out = Path(path)
    page = render_report(trials, title=title, space=space, context=context)
    out.write_text(page, encoding="utf-8")
    return out


def stable_goodput(trials: Sequence[Trial]) -> float | None:
    """The stable configuration's goodput: the median of what its baselines measured."""
    seen = [
        t.baseline.goodput_tokens_per_s
        for t in trials
        if t.baseline is not None and t.baseline.goodput_tokens_per_s is not None
    ]
    return statistics.median(seen) if seen else None


def best_so_far_svg(trials: Sequence[Trial]) -> str:
    """A step line of the best feasible goodput after each trial, every trial's point, and
    the stable's goodput as a dashed line."""
    done = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.INFEASIBLE)]
    if not done:
        return "<p class='muted'>No measured trials yet: no convergence to draw.</p>"
    goodputs = [
        t.result.goodput_tokens_per_s
        for t in done
        if t.result is not None and t.result.goodput_tokens_per_s is not None
    ]
    stable = stable_goodput(trials)
    top = max([*goodputs, stable or 0.0], default=1.0) or 1.0
    x = Axis(1, max(2, len(done)), False, (PAD, W - 16))
    y = Axis(0, top * 1.1, False, (H - PAD, 16))
    out = [svg_open("plot-convergence", "best goodput so far")]
    out += frame(x, y, "trial", "goodput (tokens/s)")
    if stable is not None:
        out.append(
            f"<line class='stable' x1='{PAD}' y1='{y.at(stable):.1f}' x2='{W - 16}' "
            f"y2='{y.at(stable):.1f}' stroke='{STABLE_COLOUR}' stroke-width='2' "
            f"stroke-dasharray='6 4'><title>stable: {stable:.1f} tok/s</title></line>"
            f"<text x='{W - 18}' y='{y.at(stable) - 5:.1f}' font-size='11' text-anchor='end' "
            f"fill='{STABLE_COLOUR}'>stable {stable:.0f} tok/s</text>"
        )
    best: float | None = None
    steps: list[tuple[float, float]] = []
    for i, trial in enumerate(done, 1):
        result = trial.result
        value = result.goodput_tokens_per_s if result is not None else None
        if trial.state is TrialState.COMPLETE and value is not None:
            best = value if best is None else max(best, value)
        if best is not None:
            steps.append((x.at(i), y.at(best)))
        tip = esc(f"trial {trial.number}: {trial.state.value}, {trial.reason or ''}".rstrip(", "))
        if trial.state is TrialState.COMPLETE and value is not None:
            out.append(
                f"<circle cx='{x.at(i):.1f}' cy='{y.at(value):.1f}' r='4' fill='#2e7d32'>"
                f"<title>{tip}: {value:.1f} tok/s</title></circle>"
            )
        else:
            out.append(cross(x.at(i), y.at(value or 0.0), tip))
    if steps:
        (x0, y0), rest = steps[0], steps[1:]
        path = f"M{x0:.1f} {y0:.1f}" + "".join(f" H{px:.1f} V{py:.1f}" for px, py in rest)
        out.append(f"<path d='{path}' fill='none' stroke='#1565c0' stroke-width='2'/>")
    out.append("</svg>")
    return "".join(out)


def knob_scatter_svg(
    trials: Sequence[Trial],
    space: SearchSpace | None = None,
    stable: Mapping[str, Value] | None = None,
) -> str:
    """Trials over the first two knobs: colour = goodput, crosses = infeasible, the region
    the space's constraints refuse shaded, the stable configuration as a diamond."""
    rows = [(t, dict(t.values)) for t in trials if len(t.values) >= 2]
    if not rows:
        return "<p class='muted'>No trial over two knobs yet: no knob map to draw.</p>"
    x_name, y_name = rows[0][0].values[0][0], rows[0][0].values[1][0]
    points = [
        (t, float(v[x_name]), float(v[y_name]))
        for t, v in rows
        if numeric(v.get(x_name)) and numeric(v.get(y_name))
    ]
    if not points:
        return "<p class='muted'>The main knobs are not numeric: no knob map to draw.</p>"
    here = {k: v for k, v in (stable or {}).items() if numeric(v)}
    xs = [p[1] for p in points] + ([float(here[x_name])] if x_name in here else [])
    ys = [p[2] for p in points] + ([float(here[y_name])] if y_name in here else [])
    x = axis_for(x_name, xs, space, (PAD, W - 16))
    y = axis_for(y_name, ys, space, (H - PAD, 16))
    goodputs = [
        t.result.goodput_tokens_per_s
        for t, _, _ in points
        if t.state is TrialState.COMPLETE and t.result and t.result.goodput_tokens_per_s
    ]
    low, high = min(goodputs, default=0.0), max(goodputs, default=1.0)
    out = [svg_open("plot-knobs", f"trials over {x_name} and {y_name}")]
    if space is not None:
        out += _infeasible_cells(space, x_name, y_name, x, y, here)
    out += frame(x, y, x_name, y_name)
    for trial, xv, yv in points:
        result = trial.result
        value = result.goodput_tokens_per_s if result is not None else None
        shown = "" if value is None else f"{value:.1f} tok/s "
        tip = esc(
            f"trial {trial.number} {x_name}={xv:g} {y_name}={yv:g}: {trial.state.value} "
            f"{shown}{trial.reason or ''}"
        )
        if trial.state is TrialState.COMPLETE and value is not None:
            frac = 0.5 if high == low else (value - low) / (high - low)
            out.append(
                f"<circle cx='{x.at(xv):.1f}' cy='{y.at(yv):.1f}' r='6' fill='{colour(frac)}' "
                f"stroke='#333' stroke-width='0.5'><title>{tip}</title></circle>"
            )
        elif trial.state.terminal:
            out.append(cross(x.at(xv), y.at(yv), tip))
    out += _stable_on_map(x, y, x_name, y_name, here)
    out.append("</svg>")
    shaded = "; pink: refused by the constraints (the planner's among them)" if space else ""
    legend = (
        f"colour: goodput {low:.0f} (dark) to {high:.0f} (light) tok/s; × infeasible{shaded}; "
        "orange ◇ (or dashed line, where its flags set one knob): the stable configuration"
    )
    return "".join(out) + f"<p class='muted'>{esc(legend)}</p>"


def _stable_on_map(
    x: Axis, y: Axis, x_name: str, y_name: str, here: Mapping[str, Value]
) -> list[str]:
    """A diamond where the stable sits; a line where its flags set one knob only (the other
    left to vLLM's default, which the page does not guess)."""
    sx, sy = here.get(x_name), here.get(y_name)
    line = f"stroke='{STABLE_COLOUR}' stroke-width='2' stroke-dasharray='6 4'"
    if sx is not None and sy is not None:
        tip = esc(f"stable {x_name}={float(sx):g} {y_name}={float(sy):g}")
        return [stable_mark(x.at(float(sx)), y.at(float(sy)), tip)]
    if sx is not None:
        px, tip = x.at(float(sx)), esc(f"stable {x_name}={float(sx):g}; {y_name}: vLLM's default")
        return [
            f"<line class='stable' x1='{px:.1f}' y1='{y.pixels[1]}' x2='{px:.1f}' "
            f"y2='{y.pixels[0]}' {line}><title>{tip}</title></line>"
        ]
    if sy is not None:
        py, tip = y.at(float(sy)), esc(f"stable {y_name}={float(sy):g}; {x_name}: vLLM's default")
        return [
            f"<line class='stable' x1='{x.pixels[0]}' y1='{py:.1f}' x2='{x.pixels[1]}' "
            f"y2='{py:.1f}' {line}><title>{tip}</title></line>"
        ]
    return []


def _infeasible_cells(
    space: SearchSpace, x_name: str, y_name: str, x: Axis, y: Axis, here: Mapping[str, Value]
) -> list[str]:
    """The cells whose centre the space's constraints (the planner's among them) refuse;
    other knobs at the stable's values. One rect per run of refused cells in a row."""
    cols, rows = _GRID
    base = {**dict(space.fixed), **here}
    cell_w, cell_h = (x.pixels[1] - x.pixels[0]) / cols, (y.pixels[0] - y.pixels[1]) / rows
    out: list[str] = []
    for r in range(rows):
        yv = _typed(space, y_name, y.value_at((r + 0.5) / rows))
        refused = [
            _refusal(
                space,
                {**base, x_name: _typed(space, x_name, x.value_at((c + 0.5) / cols)), y_name: yv},
            )
            for c in range(cols)
        ]
        c = 0
        while c < cols:
            first = refused[c]
            start, c = c, c + 1
            if first is None:
                continue
            while c < cols and _name(refused[c]) == first[0]:
                c += 1
            top = y.pixels[0] - (r + 1) * cell_h
            out.append(
                f"<rect class='infeasible' x='{x.pixels[0] + start * cell_w:.1f}' y='{top:.1f}' "
                f"width='{(c - start) * cell_w + 0.5:.1f}' height='{cell_h + 0.5:.1f}' "
                f"fill='{INFEASIBLE_FILL}'><title>{esc(f'{first[0]}: {first[1]}')}</title></rect>"
            )
    return out


def _refusal(space: SearchSpace, values: Mapping[str, Value]) -> tuple[str, str] | None:
    """The first constraint that refuses `values`: (its name, its reason)."""
    for constraint in space.constraints:
        reason = constraint.check(values)
        if reason is not None:
            return constraint.name, reason
    return None


def _name(refusal: tuple[str, str] | None) -> str | None:
    return None if refusal is None else refusal[0]


def _typed(space: SearchSpace, name: str, value: float) -> Value:
    """A value as the knob takes it (an integer knob asks the constraints in integers)."""
    if name in space.names and space.knob(name).kind is KnobKind.INTEGER:
        return round(value)
    return value


def trial_comparison_svg(trial: Trial) -> str:
    """Per metric the stable (baseline) beside the canary: medians as bars, the window's p95
    as a tick where recorded, the verdict; goodput and memory from the two results."""
    rows = _comparison_rows(trial)
    if not rows:
        return "<p class='muted'>Neither side recorded a figure: nothing to compare.</p>"
    row_h, label_w, bar_w = 34, 150, W - 150 - 110
    height = 16 + row_h * len(rows)
    out = [svg_open(f"plot-trial-{trial.number}", f"trial {trial.number}", height)]
    for i, (name, base, canary, p95s, verdict, tint) in enumerate(rows):
        top = 8 + i * row_h
        scale = max(abs(v) for v in (base or 0.0, canary or 0.0, *p95s) if v is not None) or 1.0
        out.append(f"<text x='4' y='{top + 17}' font-size='12'>{esc(name)}</text>")
        sides = (
            ("stable (baseline)", base, STABLE_COLOUR, p95s[0]),
            ("canary", canary, tint, p95s[1]),
        )
        for j, (label, value, fill, p95) in enumerate(sides):
            if value is not None:
                out.append(
                    f"<rect x='{label_w}' y='{top + j * 13}' "
                    f"width='{bar_w * abs(value) / scale:.1f}' height='11' fill='{fill}'>"
                    f"<title>{label}: {value:.4g}</title></rect>"
                )
            if p95 is not None:
                px = label_w + bar_w * abs(p95) / scale
                out.append(
                    f"<line x1='{px:.1f}' y1='{top + j * 13 - 1}' x2='{px:.1f}' "
                    f"y2='{top + j * 13 + 12}' stroke='#212121' stroke-width='2'>"
                    f"<title>{label} p95 {p95:.4g}</title></line>"
                )
        out.append(
            f"<text x='{label_w + bar_w + 8}' y='{top + 17}' font-size='12' fill='{tint}'>"
            f"{esc(verdict)}</text>"
        )
    out.append("</svg>")
    return "".join(out)


def canary_svg(judgement: Judgement) -> str:
    """Only the judged metrics of one canary (no results): kept for callers without a trial."""
    return trial_comparison_svg(
        Trial("", "", 0, (), TrialState.COMPLETE, 0.0, 0.0, judgement=judgement)
    )


# name, stable (baseline), canary, their p95s, the verdict's text and colour
_Row = tuple[str, float | None, float | None, tuple[float | None, float | None], str, str]


def _comparison_rows(trial: Trial) -> list[_Row]:
    rows: list[_Row] = []
    if trial.judgement is not None:
        for m in trial.judgement.metrics:
            if m.baseline_median is None and m.canary_median is None:
                continue
            p95 = (_p95(trial.baseline, m.name), _p95(trial.result, m.name))
            mark = f"{m.verdict.value}{' ✗' if m.counts_against else ''}"
            # A shift that does not count against (goodput up) is blue, never red.
            tint = _VERDICT_COLOUR[m.verdict.value]
            if m.verdict.value == "high" and not m.counts_against:
                tint = _VERDICT_COLOUR["low"]
            rows.append((m.name, m.baseline_median, m.canary_median, p95, mark, tint))
    base, cand = trial.baseline, trial.result
    for label, attr in (("goodput tok/s", "goodput_tokens_per_s"), ("memory", "memory_bytes")):
        b = getattr(base, attr, None) if base is not None else None
        c = getattr(cand, attr, None) if cand is not None else None
        if b is not None or c is not None:
            rows.append((label, b, c, (None, None), "measured", "#616161"))
    return rows


def _p95(result: object, metric: str) -> float | None:
    metrics = getattr(result, "metrics", None)
    field = _P95.get(metric)
    return None if metrics is None or field is None else getattr(metrics, field, None)


def _trials_html(trials: Sequence[Trial]) -> str:
    knobs = list(dict.fromkeys(name for t in trials for name, _ in t.values))
    head = "".join(f"<th>{esc(k)}</th>" for k in knobs)
    rows = [
        f"<table><tr><th>#</th><th class='l'>state</th>{head}<th>goodput tok/s</th>"
        "<th>memory</th><th>baseline tok/s</th><th>baseline memory</th>"
        "<th class='l'>warm-up</th><th>KV usage (info)</th><th class='l'>reason</th></tr>"
    ]
    for t in trials:
        values = dict(t.values)
        cells = "".join(f"<td>{esc(str(values.get(k, '-')))}</td>" for k in knobs)
        figures = "".join(f"<td>{esc(c)}</td>" for c in result_cells(t))
        rows.append(
            f"<tr><td>{t.number}</td><td class='l'>{esc(t.state.value)}</td>{cells}{figures}"
            f"<td class='l'>{esc(warmup_text(t) if t.judgement else '-')}</td>"
            f"<td>{esc(kv_usage_text(t))}</td>"
            f"<td class='l'>{esc(t.reason or '')}</td></tr>"
        )
    rows.append("</table>")
    return "".join(rows)
