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

from kvpilot.tuner.judge.evidence import Counts  # noqa: E402

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


def test_the_analyses_double_up_to_the_recorded_windows() -> None:
    assert calibration.analysis_lengths(3) == [1, 2]
    assert calibration.analysis_lengths(60) == [1, 2, 4, 5, 8, 16, 32]
    assert calibration.analysis_lengths(240)[-3:] == [32, 64, 128]


def test_the_time_to_power_is_where_it_holds_from_on_not_a_lucky_k() -> None:
    # 80 % once at k=8, then lower again: not reached until k=64 holds it to the end.
    shares = {5: 0.2, 8: 0.85, 16: 0.6, 32: 0.79, 64: 0.81, 128: 0.95}
    assert calibration.least_windows(shares) == 64
    assert calibration.least_windows({5: 0.1, 32: 0.48}) is None
    assert calibration.least_windows({5: 0.9, 8: 0.8}) == 5


def test_the_analysis_says_how_long_it_takes_to_catch_a_regression(
    capsys: pytest.CaptureFixture[str],
) -> None:
    calibration.analyse(calibration.load_pairs(RECORDED)[:8], 2.5)
    out = capsys.readouterr().out
    assert "analysis time for 80% power (counted against the canary):" in out
    assert "windows, goodput_tokens_per_s 10% worse: " in out


def test_the_injected_regression_is_the_one_asked_for_and_a_share(
    capsys: pytest.CaptureFixture[str],
) -> None:
    calibration.analyse(calibration.load_pairs(RECORDED)[:5], 2.5, shift=0.2)
    out = capsys.readouterr().out
    assert "goodput_tokens_per_s 20% worse: counted against" in out
    assert "10% worse" not in out
    with pytest.raises(SystemExit) as exited:
        calibration.main(["--analyse", str(RECORDED), "--shift", "1.5"])
    assert exited.value.code == 2
    assert "--shift 1.5: a regression is a share between 0 and 1" in capsys.readouterr().err
