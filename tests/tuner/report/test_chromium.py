"""The report, looked at: headless Chromium draws the page and every plot drew something.

Each plot's SVG gets a test-only border of a colour found nowhere else on the page, so the
screenshot shows where it landed; inside that border the plot must hold data marks (pixels
with colour, where axes, grid and text are grey) and the stable configuration's orange.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from kvpilot.tuner.report.html import ReportContext, render_report
from tests.tuner.report.history import SHAPE, SPACE, STABLE, history

CHROMIUM = "/usr/bin/chromium"
WIDTH, HEIGHT = 1200, 3000
STABLE_RGB = (0xE6, 0x51, 0x00)

pytestmark = pytest.mark.skipif(
    not os.access(CHROMIUM, os.X_OK) and not os.environ.get("CI"),
    reason=f"{CHROMIUM} is not installed (./scripts/setup installs Debian's chromium)",
)


def _outline(index: int) -> tuple[int, int, int]:
    return (1, 2 + index, 250)  # a blue no chart uses


def _screenshot(page: str, tmp_path: Path) -> np.ndarray:
    html_path, png = tmp_path / "report.html", tmp_path / "shot.png"
    html_path.write_text(page, encoding="utf-8")
    argv = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--hide-scrollbars",
        "--force-device-scale-factor=1",
        f"--user-data-dir={tmp_path / 'profile'}",
        f"--screenshot={png}",
        f"--window-size={WIDTH},{HEIGHT}",
        html_path.as_uri(),
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0 and png.exists(), f"chromium failed: {done.stderr[-2000:]}"
    with Image.open(png) as image:
        return np.asarray(image.convert("RGB"), dtype=np.int16)


def _box(pixels: np.ndarray, rgb: tuple[int, int, int]) -> tuple[int, int, int, int] | None:
    """The bounding box (top, left, bottom, right) of the pixels of exactly `rgb`."""
    ys, xs = np.nonzero(np.all(pixels == np.array(rgb, dtype=np.int16), axis=2))
    if len(ys) == 0:
        return None
    return int(ys.min()), int(xs.min()), int(ys.max()), int(xs.max())


def test_every_plot_in_headless_chromium_drew_marks_and_the_stable(tmp_path: Path) -> None:
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"CI needs {CHROMIUM}: run ./scripts/setup")
    context = ReportContext(SPACE, STABLE, workload=SHAPE, configured_lengths=(384, 64))
    page = render_report(history(), context=context)
    plot_ids = re.findall(r"<svg [^>]*id='([^']+)'", page)
    assert plot_ids[:3] == ["plot-convergence", "plot-knobs", "plot-workload"]
    assert {"plot-trial-1", "plot-trial-2", "plot-trial-5"} <= set(plot_ids)
    outlines = "".join(
        f"#{pid}{{border:2px solid rgb{_outline(i)}}}" for i, pid in enumerate(plot_ids)
    )
    pixels = _screenshot(page.replace("</style>", outlines + "</style>", 1), tmp_path)
    empty = []
    for i, pid in enumerate(plot_ids):
        box = _box(pixels, _outline(i))
        assert box is not None, f"{pid}: not on the screenshot (page taller than {HEIGHT}?)"
        top, left, bottom, right = box
        inside = pixels[top + 3 : bottom - 2, left + 3 : right - 2]
        spread = inside.max(axis=2) - inside.min(axis=2)
        marks = int((spread > 40).sum())  # axes, grid lines and text are grey
        stable = int((np.abs(inside - np.array(STABLE_RGB)).max(axis=2) <= 24).sum())
        if marks < 150 or stable < 20:
            empty.append(f"{pid} ({marks} coloured pixels, {stable} of the stable's orange)")
    assert not empty, "plots that drew nothing or left the stable unmarked: " + ", ".join(empty)
