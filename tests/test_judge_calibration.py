"""The judge's A/A calibration (benchmarks/judge_calibration.py) on its committed windows,
measured on the real CPU vLLM: the analysis runs, reads what the judge said, and keeps the
recorded windows' shape."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import judge_calibration as calibration  # noqa: E402

from kvpilot.tuner.evidence import Counts  # noqa: E402

RECORDED = ROOT / "benchmarks" / "data" / "judge_aa.jsonl"


def test_the_recorded_windows_keep_every_request_and_both_counts() -> None:
    pairs = calibration.load_pairs(RECORDED)
    assert len(pairs) >= 60
    for pair in pairs:
        for side in (pair.canary, pair.baseline):
            assert len(side["ttft_s"]) == calibration.WORKLOAD.num_requests
            assert len(side["errors_ratio"]) == calibration.WORKLOAD.num_requests
            assert isinstance(side["preemptions_per_s"], Counts)


def test_the_analysis_counts_what_the_judge_said(capsys: pytest.CaptureFixture[str]) -> None:
    pairs = calibration.load_pairs(RECORDED)[:4]
    calibration.analyse(pairs, 2.5)
    out = capsys.readouterr().out
    assert "A/A: 4 windows of about 2.5 s" in out
    assert "k=4 (about 10 s)" in out
    # The same windows with five seconds more on each of the canary's TTFTs (past the SLO's
    # 3.5 s): every one judged worse.
    slow = [
        calibration.Pair(
            {**p.canary, "ttft_s": tuple(5 + t for t in p.canary["ttft_s"])}, p.baseline
        )
        for p in pairs
    ]
    met = calibration.analyse(slow, 2.5)
    out = capsys.readouterr().out
    assert not met
    assert "false-fail rate (fail or marginal, all metrics together): 100.0%" in out
