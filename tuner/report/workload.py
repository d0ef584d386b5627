"""The report's workload chart: the length histograms the tuning run replayed (learned from
the server's own /metrics), prompt and output side by side, with the configured workload's
lengths marked in the stable configuration's orange (what a run replays when nothing was
learned). One bar per vLLM bucket, equal widths (the buckets are 1-2-5 per decade)."""

from __future__ import annotations

import math

from kvpilot.collectors.histogram import Histogram
from kvpilot.tuner.load.learned import WorkloadShape
from kvpilot.tuner.report.svg import STABLE_COLOUR, H, W, esc, svg_open

_BAR = "#1565c0"
_TOP, _BOTTOM = 28, H - 44


def workload_svg(shape: WorkloadShape, configured: tuple[int, int] | None = None) -> str:
    """Both histograms in one plot; `configured`: the configured (prompt, output) lengths."""
    half = W // 2
    out = [svg_open("plot-workload", "the replayed workload's lengths")]
    sides = (
        ("prompt tokens", shape.prompt_tokens, configured[0] if configured else None),
        ("output tokens", shape.generation_tokens, configured[1] if configured else None),
    )
    for i, (label, hist, mark) in enumerate(sides):
        out += _panel(hist, label, mark, (i * half + 36, (i + 1) * half - 12))
    rate = f"{shape.rate_rps:.3g} req/s"
    hits = "-" if shape.prefix_hit_ratio is None else f"{shape.prefix_hit_ratio:.0%}"
    caption = f"{shape.requests} requests over {shape.window_s:.0f} s, {rate}; prefix hits {hits}"
    out.append(
        f"<text x='{W / 2:.0f}' y='{H - 8}' font-size='12' text-anchor='middle' "
        f"fill='#555'>{esc(caption)}</text></svg>"
    )
    return "".join(out)


def _panel(hist: Histogram, label: str, mark: int | None, span: tuple[float, float]) -> list[str]:
    bars = _weights(hist)
    left, right = span
    out = [
        f"<text x='{(left + right) / 2:.0f}' y='16' font-size='12' text-anchor='middle' "
        f"fill='#333'>{esc(label)}</text>",
        f"<line x1='{left}' y1='{_BOTTOM}' x2='{right}' y2='{_BOTTOM}' stroke='#999'/>",
    ]
    if not bars:
        out.append(
            f"<text x='{(left + right) / 2:.0f}' y='{H / 2:.0f}' font-size='12' "
            "text-anchor='middle' fill='#777'>nothing observed</text>"
        )
        return out
    first = min(i for i, (_, _, w) in enumerate(bars) if w > 0)
    last = max(i for i, (_, _, w) in enumerate(bars) if w > 0)
    marked = _bucket_of(bars, mark)
    if marked is not None:
        first, last = min(first, marked), max(last, marked)
    shown = bars[first : last + 1]
    total = sum(w for _, _, w in shown) or 1.0
    tallest = max(w for _, _, w in shown) / total or 1.0
    width = (right - left) / len(shown)
    for j, (low, high, weight) in enumerate(shown):
        x = left + j * width
        height = (_BOTTOM - _TOP) * (weight / total) / tallest
        tip = f"{low}-{high} tokens: {weight / total:.0%}"
        out.append(
            f"<rect x='{x + 1:.1f}' y='{_BOTTOM - height:.1f}' width='{max(width - 2, 1):.1f}' "
            f"height='{height:.1f}' fill='{_BAR}'><title>{esc(tip)}</title></rect>"
        )
        if len(shown) <= 8 or j % 2 == 0:
            out.append(
                f"<text x='{x + width / 2:.1f}' y='{_BOTTOM + 14}' font-size='10' "
                f"text-anchor='middle' fill='#555'>{esc(_tokens(high))}</text>"
            )
    if marked is not None and mark is not None:
        x = left + (marked - first + 0.5) * width
        out.append(
            f"<line class='stable' x1='{x:.1f}' y1='{_TOP - 6}' x2='{x:.1f}' y2='{_BOTTOM}' "
            f"stroke='{STABLE_COLOUR}' stroke-width='3'><title>configured: {mark} tokens"
            f"</title></line><text x='{x + 4:.1f}' y='{_TOP - 8}' font-size='11' "
            f"fill='{STABLE_COLOUR}'>configured {mark}</text>"
        )
    return out


def _weights(hist: Histogram) -> list[tuple[int, int, float]]:
    """(lowest, highest, weight) per finite bucket; the +Inf bucket's weight joins the last."""
    out: list[tuple[int, int, float]] = []
    previous_le, previous = 0.0, 0.0
    for le, cumulative in hist.buckets:
        weight = max(0.0, cumulative - previous)
        previous = max(previous, cumulative)
        if math.isinf(le):
            if out and weight > 0:
                low, high, w = out[-1]
                out[-1] = (low, high, w + weight)
            continue
        out.append((math.floor(previous_le) + 1, math.floor(le), weight))
        previous_le = le
    return out if any(w > 0 for _, _, w in out) else []


def _bucket_of(bars: list[tuple[int, int, float]], length: int | None) -> int | None:
    if length is None:
        return None
    for i, (_, high, _) in enumerate(bars):
        if length <= high:
            return i
    return len(bars) - 1


def _tokens(n: int) -> str:
    return f"{n / 1000:g}k" if n >= 1000 else str(n)
