"""`kvpilot tune report`: one self-contained HTML page with hand-built inline SVG plots.

No scripts, fonts or external files: best-so-far goodput against trials, the trials over the
two main knobs coloured by goodput (infeasible ones as crosses, the reason on hover), and
each canary's metric comparison (baseline and canary medians, with the verdict).
"""

from __future__ import annotations

import html
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvpilot.collectors.secrets import mask_text
from kvpilot.tuner.judge import Judgement
from kvpilot.tuner.render import format_bytes, kv_usage_text, result_cells, warmup_text
from kvpilot.tuner.space import SearchSpace
from kvpilot.tuner.trials import Trial, TrialState

W, H, PAD = 560, 320, 56
DEFAULT_TITLE = "kvpilot tuning report"
_VERDICT_COLOUR = {"pass": "#2e7d32", "high": "#c62828", "low": "#1565c0", "nodata": "#9e9e9e"}
_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px;color:#222}
h1{font-size:22px}h2{font-size:17px;margin-top:28px}table{border-collapse:collapse;font-size:13px}
td,th{border-bottom:1px solid #ddd;padding:3px 8px;text-align:right}th{background:#f5f5f5}
td.l,th.l{text-align:left}.muted{color:#777}svg{background:#fff;border:1px solid #eee}
"""


@dataclass(frozen=True, slots=True)
class _Axis:
    low: float
    high: float
    log: bool
    pixels: tuple[float, float]

    def at(self, value: float) -> float:
        lo, hi, v = self.low, self.high, value
        if self.log:
            lo, hi, v = math.log10(lo), math.log10(hi), math.log10(max(value, 1e-300))
        frac = 0.5 if hi == lo else (v - lo) / (hi - lo)
        return self.pixels[0] + frac * (self.pixels[1] - self.pixels[0])

    def ticks(self, count: int = 5) -> list[float]:
        if self.log:
            lo, hi = math.log10(self.low), math.log10(self.high)
            return [10 ** (lo + i * (hi - lo) / (count - 1)) for i in range(count)]
        return [self.low + i * (self.high - self.low) / (count - 1) for i in range(count)]


def render_report(
    trials: Sequence[Trial],
    *,
    title: str = DEFAULT_TITLE,
    space: SearchSpace | None = None,
) -> str:
    """The whole page as a string."""
    parts = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        f"<title>{_e(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{_e(title)}</h1>",
        f"<p class='muted'>{len(trials)} trials, "
        f"{sum(t.state is TrialState.COMPLETE for t in trials)} feasible, "
        f"{sum(t.state is TrialState.INFEASIBLE for t in trials)} infeasible.</p>",
        "<h2>Best goodput so far</h2>",
        best_so_far_svg(trials),
        "<h2>Trials over the two main knobs</h2>",
        knob_scatter_svg(trials, space),
    ]
    canaries = [t for t in trials if t.judgement is not None]
    if canaries:
        parts.append("<h2>Canary comparisons</h2>")
        for trial in canaries:
            judgement = trial.judgement
            assert judgement is not None
            goodput, memory, base_goodput, base_memory = result_cells(trial)
            parts.append(
                f"<h3>Trial {trial.number}: {_e(judgement.classification.value)} "
                f"<span class='muted'>({_e(judgement.reason)})</span></h3>"
                f"<p>candidate {_e(goodput)} tok/s, {_e(memory)}; baseline {_e(base_goodput)}"
                f" tok/s, {_e(base_memory)}; warm-up {_e(warmup_text(trial))}. "
                "<span class='muted'>KV usage is shown, never counted.</span></p>"
            )
            parts.append(canary_svg(judgement))
    parts += ["<h2>All trials</h2>", _trials_html(trials), "</body></html>"]
    return "\n".join(parts)


def write_report(
    path: str | Path,
    trials: Sequence[Trial],
    *,
    title: str = DEFAULT_TITLE,
    space: SearchSpace | None = None,
) -> Path:
    """Write the page; returns its path."""
    out = Path(path)
    out.write_text(render_report(trials, title=title, space=space), encoding="utf-8")
    return out


def best_so_far_svg(trials: Sequence[Trial]) -> str:
    """A step line of the best feasible goodput after each trial, with every trial's point."""
    done = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.INFEASIBLE)]
    if not done:
        return "<p class='muted'>No measured trials yet.</p>"
    goodputs = [
        t.result.goodput_tokens_per_s
        for t in done
        if t.result is not None and t.result.goodput_tokens_per_s is not None
    ]
    top = max(goodputs, default=1.0) or 1.0
    x = _Axis(1, max(2, len(done)), False, (PAD, W - 16))
    y = _Axis(0, top * 1.1, False, (H - PAD, 16))
    out = [_svg_open("best goodput so far"), *_frame(x, y, "trial", "goodput (tokens/s)")]
    best: float | None = None
    steps: list[tuple[float, float]] = []
    for i, trial in enumerate(done, 1):
        result = trial.result
        value = result.goodput_tokens_per_s if result is not None else None
        if trial.state is TrialState.COMPLETE and value is not None:
            best = value if best is None else max(best, value)
        if best is not None:
            steps.append((x.at(i), y.at(best)))
        tip = _e(f"trial {trial.number}: {trial.state.value}, {trial.reason or ''}".rstrip(", "))
        if trial.state is TrialState.COMPLETE and value is not None:
            out.append(
                f"<circle cx='{x.at(i):.1f}' cy='{y.at(value):.1f}' r='4' fill='#2e7d32'>"
                f"<title>{tip}: {value:.1f} tok/s</title></circle>"
            )
        else:
            out.append(_cross(x.at(i), y.at(value or 0.0), tip))
    if steps:
        (x0, y0), rest = steps[0], steps[1:]
        path = f"M{x0:.1f} {y0:.1f}" + "".join(f" H{px:.1f} V{py:.1f}" for px, py in rest)
        out.append(f"<path d='{path}' fill='none' stroke='#1565c0' stroke-width='2'/>")
    out.append("</svg>")
    return "".join(out)


def knob_scatter_svg(trials: Sequence[Trial], space: SearchSpace | None = None) -> str:
    """Trials over the first two knobs: colour = goodput, crosses = infeasible."""
    rows = [(t, dict(t.values)) for t in trials if len(t.values) >= 2]
    if not rows:
        return "<p class='muted'>Fewer than two knobs: nothing to plot.</p>"
    x_name, y_name = rows[0][0].values[0][0], rows[0][0].values[1][0]
    points = [
        (t, float(v[x_name]), float(v[y_name]))
        for t, v in rows
        if _numeric(v.get(x_name)) and _numeric(v.get(y_name))
    ]
    if not points:
        return "<p class='muted'>The main knobs are not numeric.</p>"
    x = _axis_for(x_name, [p[1] for p in points], space, (PAD, W - 16))
    y = _axis_for(y_name, [p[2] for p in points], space, (H - PAD, 16))
    goodputs = [
        t.result.goodput_tokens_per_s
        for t, _, _ in points
        if t.state is TrialState.COMPLETE and t.result and t.result.goodput_tokens_per_s
    ]
    low, high = min(goodputs, default=0.0), max(goodputs, default=1.0)
    out = [_svg_open(f"trials over {x_name} and {y_name}"), *_frame(x, y, x_name, y_name)]
    for trial, xv, yv in points:
        result = trial.result
        value = result.goodput_tokens_per_s if result is not None else None
        shown = "" if value is None else f"{value:.1f} tok/s "
        tip = _e(
            f"trial {trial.number} {x_name}={xv:g} {y_name}={yv:g}: {trial.state.value} "
            f"{shown}{trial.reason or ''}"
        )
        if trial.state is TrialState.COMPLETE and value is not None:
            frac = 0.5 if high == low else (value - low) / (high - low)
            out.append(
                f"<circle cx='{x.at(xv):.1f}' cy='{y.at(yv):.1f}' r='6' fill='{_colour(frac)}' "
                f"stroke='#333' stroke-width='0.5'><title>{tip}</title></circle>"
            )
        elif trial.state.terminal:
            out.append(_cross(x.at(xv), y.at(yv), tip))
    out.append(
        f"<text x='{W - 16}' y='12' font-size='11' text-anchor='end'>colour: goodput "
        f"{low:.0f} (dark) to {high:.0f} (light) tok/s; × infeasible</text></svg>"
    )
    return "".join(out)


def canary_svg(judgement: Judgement) -> str:
    """Baseline and canary medians per metric as paired bars, scaled per metric."""
    rows = [m for m in judgement.metrics if m.baseline_median is not None]
    if not rows:
        return "<p class='muted'>No metric had data.</p>"
    row_h, label_w, bar_w = 34, 160, W - 160 - 150
    height = 16 + row_h * len(rows)
    out = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{W}' height='{height}' role='img'>"]
    for i, m in enumerate(rows):
        top = 8 + i * row_h
        base, canary = m.baseline_median or 0.0, m.canary_median or 0.0
        scale = max(abs(base), abs(canary)) or 1.0
        colour = _VERDICT_COLOUR[m.verdict.value]
        out.append(f"<text x='4' y='{top + 17}' font-size='12'>{_e(m.name)}</text>")
        for j, (label, value, fill) in enumerate(
            (("baseline", base, "#9e9e9e"), ("canary", canary, colour))
        ):
            width = bar_w * abs(value) / scale
            out.append(
                f"<rect x='{label_w}' y='{top + j * 13}' width='{width:.1f}' height='11' "
                f"fill='{fill}'><title>{label} median {value:.4g}</title></rect>"
            )
        out.append(
            f"<text x='{label_w + bar_w + 8}' y='{top + 17}' font-size='12' fill='{colour}'>"
            f"{_e(m.verdict.value)}{' ✗' if m.counts_against else ''}"
            f"<title>{_e(m.reason)}</title></text>"
        )
    out.append("</svg>")
    return "".join(out)


def _trials_html(trials: Sequence[Trial]) -> str:
    knobs = list(dict.fromkeys(name for t in trials for name, _ in t.values))
    head = "".join(f"<th>{_e(k)}</th>" for k in knobs)
    rows = [
        f"<table><tr><th>#</th><th class='l'>state</th>{head}<th>goodput tok/s</th>"
        "<th>memory</th><th>baseline tok/s</th><th>baseline memory</th>"
        "<th class='l'>warm-up</th><th>KV usage (info)</th><th class='l'>reason</th></tr>"
    ]
    for t in trials:
        values = dict(t.values)
        cells = "".join(f"<td>{_e(str(values.get(k, '-')))}</td>" for k in knobs)
        figures = "".join(f"<td>{_e(c)}</td>" for c in result_cells(t))
        rows.append(
            f"<tr><td>{t.number}</td><td class='l'>{_e(t.state.value)}</td>{cells}{figures}"
            f"<td class='l'>{_e(warmup_text(t) if t.judgement else '-')}</td>"
            f"<td>{_e(kv_usage_text(t))}</td>"
            f"<td class='l'>{_e(t.reason or '')}</td></tr>"
        )
    rows.append("</table>")
    return "".join(rows)


def _axis_for(
    name: str, values: Sequence[float], space: SearchSpace | None, pixels: tuple[float, float]
) -> _Axis:
    log = False
    low, high = min(values), max(values)
    if space is not None and name in space.names:
        knob = space.knob(name)
        log = knob.log_scale
        if knob.low is not None and knob.high is not None:
            low, high = min(low, knob.low), max(high, knob.high)
    elif low > 0 and high / low >= 20:
        log = True
    if low == high:
        low, high = (low * 0.9, high * 1.1) if low else (-1.0, 1.0)
    return _Axis(low, high, log and low > 0, pixels)


def _frame(x: _Axis, y: _Axis, x_label: str, y_label: str) -> list[str]:
    out = [
        f"<line x1='{PAD}' y1='{H - PAD}' x2='{W - 16}' y2='{H - PAD}' stroke='#444'/>",
        f"<line x1='{PAD}' y1='16' x2='{PAD}' y2='{H - PAD}' stroke='#444'/>",
        f"<text x='{(PAD + W) / 2:.0f}' y='{H - 14}' font-size='12' text-anchor='middle'>"
        f"{_e(x_label)}</text>",
        f"<text x='14' y='{H / 2:.0f}' font-size='12' text-anchor='middle' "
        f"transform='rotate(-90 14 {H / 2:.0f})'>{_e(y_label)}</text>",
    ]
    for tick in x.ticks():
        px = x.at(tick)
        out.append(
            f"<text x='{px:.1f}' y='{H - PAD + 16}' font-size='10' text-anchor='middle'>"
            f"{_e(_short(tick))}</text>"
        )
    for tick in y.ticks():
        py = y.at(tick)
        out.append(
            f"<text x='{PAD - 6}' y='{py + 3:.1f}' font-size='10' text-anchor='end'>"
            f"{_e(_short(tick))}</text>"
            f"<line x1='{PAD}' y1='{py:.1f}' x2='{W - 16}' y2='{py:.1f}' stroke='#eee'/>"
        )
    return out


def _svg_open(label: str) -> str:
    return (
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{W}' height='{H}' role='img' "
        f"aria-label='{_e(label)}'>"
    )


def _cross(x: float, y: float, tip: str) -> str:
    return (
        f"<g stroke='#c62828' stroke-width='2'><title>{tip}</title>"
        f"<line x1='{x - 5:.1f}' y1='{y - 5:.1f}' x2='{x + 5:.1f}' y2='{y + 5:.1f}'/>"
        f"<line x1='{x - 5:.1f}' y1='{y + 5:.1f}' x2='{x + 5:.1f}' y2='{y - 5:.1f}'/></g>"
    )


def _colour(frac: float) -> str:
    """Dark blue (low) to yellow (high), through green."""
    stops = ((0.0, (68, 1, 84)), (0.5, (33, 145, 140)), (1.0, (253, 231, 37)))
    frac = min(1.0, max(0.0, frac))
    for (f0, c0), (f1, c1) in itertools.pairwise(stops):
        if frac <= f1:
            t = (frac - f0) / (f1 - f0)
            r, g, b = (round(a + (b - a) * t) for a, b in zip(c0, c1, strict=True))
            return f"#{r:02x}{g:02x}{b:02x}"
    return "#fde725"


def _short(value: float) -> str:
    if abs(value) >= 1024**2:
        return format_bytes(value)
    return f"{value:.3g}"


def _numeric(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _e(text: str) -> str:
    """Text for the page: secrets masked (a trial stored before they were), then escaped."""
    return html.escape(mask_text(text), quote=True)
