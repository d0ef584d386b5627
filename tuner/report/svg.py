"""SVG primitives for the HTML report: axes, frames, marks and colours (no scripts)."""

from __future__ import annotations

import html
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvpilot.collectors.secrets import mask_text
from kvpilot.tuner.problem.space import SearchSpace
from kvpilot.tuner.report.table import format_bytes

W, H, PAD = 560, 320, 56
STABLE_COLOUR = "#e65100"  # the stable configuration, on every chart
INFEASIBLE_FILL = "#f8bbd0"  # the planner's infeasible region
MARGIN = 0.06  # of a knob axis's span, each side


@dataclass(frozen=True, slots=True)
class Axis:
    low: float
    high: float
    log: bool
    pixels: tuple[float, float]

    def at(self, value: float) -> float:
        frac = self.frac(value)
        return self.pixels[0] + frac * (self.pixels[1] - self.pixels[0])

    def frac(self, value: float) -> float:
        lo, hi, v = self.low, self.high, value
        if self.log:
            lo, hi, v = math.log10(lo), math.log10(hi), math.log10(max(value, 1e-300))
        return 0.5 if hi == lo else (v - lo) / (hi - lo)

    def value_at(self, frac: float) -> float:
        """The value at a fraction of the axis (the inverse of `frac`)."""
        if self.log:
            lo, hi = math.log10(self.low), math.log10(self.high)
            return float(10 ** (lo + frac * (hi - lo)))
        return self.low + frac * (self.high - self.low)

    def ticks(self, count: int = 5) -> list[float]:
        if self.log and self.high / self.low >= 4:
            # Powers of two: the values knobs take (1, 4, 16 sequences; 1, 4, 16 MiB).
            first, last = math.ceil(math.log2(self.low)), math.floor(math.log2(self.high))
            step = max(1, math.ceil((last - first + 1) / (count + 1)))
            return [float(2**e) for e in range(first, last + 1, step)]
        return [self.value_at(i / (count - 1)) for i in range(count)]


def axis_for(
    name: str, values: Sequence[float], space: SearchSpace | None, pixels: tuple[float, float]
) -> Axis:
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
    log = log and low > 0
    # A margin beyond the knob's range shows what lies past its ends (the planner's bounds
    # often are its ends).
    if log:
        ratio = (high / low) ** MARGIN
        low, high = low / ratio, high * ratio
    else:
        span = (high - low) * MARGIN
        low, high = low - span, high + span
    return Axis(low, high, log, pixels)


def frame(x: Axis, y: Axis, x_label: str, y_label: str) -> list[str]:
    out = [
        f"<line x1='{PAD}' y1='{H - PAD}' x2='{W - 16}' y2='{H - PAD}' stroke='#444'/>",
        f"<line x1='{PAD}' y1='16' x2='{PAD}' y2='{H - PAD}' stroke='#444'/>",
        f"<text x='{(PAD + W) / 2:.0f}' y='{H - 14}' font-size='12' text-anchor='middle'>"
        f"{esc(x_label)}</text>",
        f"<text x='14' y='{H / 2:.0f}' font-size='12' text-anchor='middle' "
        f"transform='rotate(-90 14 {H / 2:.0f})'>{esc(y_label)}</text>",
    ]
    for tick in x.ticks():
        out.append(
            f"<text x='{x.at(tick):.1f}' y='{H - PAD + 16}' font-size='10' "
            f"text-anchor='middle'>{esc(short(tick))}</text>"
        )
    for tick in y.ticks():
        py = y.at(tick)
        out.append(
            f"<text x='{PAD - 6}' y='{py + 3:.1f}' font-size='10' text-anchor='end'>"
            f"{esc(short(tick))}</text>"
            f"<line x1='{PAD}' y1='{py:.1f}' x2='{W - 16}' y2='{py:.1f}' stroke='#eee'/>"
        )
    return out


def svg_open(plot_id: str, label: str, height: int = H) -> str:
    return (
        f"<svg xmlns='http://www.w3.org/2000/svg' id='{esc(plot_id)}' width='{W}' "
        f"height='{height}' role='img' aria-label='{esc(label)}'>"
    )


def cross(x: float, y: float, tip: str) -> str:
    return (
        f"<g stroke='#c62828' stroke-width='2'><title>{tip}</title>"
        f"<line x1='{x - 5:.1f}' y1='{y - 5:.1f}' x2='{x + 5:.1f}' y2='{y + 5:.1f}'/>"
        f"<line x1='{x - 5:.1f}' y1='{y + 5:.1f}' x2='{x + 5:.1f}' y2='{y - 5:.1f}'/></g>"
    )


def stable_mark(x: float, y: float, tip: str) -> str:
    """A diamond: the stable configuration."""
    points = f"{x:.1f},{y - 9:.1f} {x + 9:.1f},{y:.1f} {x:.1f},{y + 9:.1f} {x - 9:.1f},{y:.1f}"
    return (
        f"<polygon class='stable' points='{points}' fill='none' stroke='{STABLE_COLOUR}' "
        f"stroke-width='2.5'><title>{tip}</title></polygon>"
    )


def colour(frac: float) -> str:
    """Dark blue (low) to yellow (high), through green."""
    stops = ((0.0, (68, 1, 84)), (0.5, (33, 145, 140)), (1.0, (253, 231, 37)))
    frac = min(1.0, max(0.0, frac))
    for (f0, c0), (f1, c1) in itertools.pairwise(stops):
        if frac <= f1:
            t = (frac - f0) / (f1 - f0)
            r, g, b = (round(a + (b - a) * t) for a, b in zip(c0, c1, strict=True))
            return f"#{r:02x}{g:02x}{b:02x}"
    return "#fde725"


def short(value: float) -> str:
    if abs(value) >= 1024**2:
        return format_bytes(value)
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}"


def numeric(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def esc(text: str) -> str:
    """Text for the page: secrets masked (a trial stored before they were), then escaped."""
    return html.escape(mask_text(text), quote=True)
