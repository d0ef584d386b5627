"""Capacity at the SLO: the rate ladder and its bisections, on a server model whose
boundary is known, and the per-window verdict on real request records."""

from __future__ import annotations

import math

import pytest

from kvpilot.tuner.load.generator import LoadReport, RequestResult
from kvpilot.tuner.measure.capacity import capacity_at_slo, judge_window
from kvpilot.tuner.problem.objective import Slo

pytestmark = pytest.mark.anyio
SLO = Slo(ttft_p95_s=1.0, inter_token_p95_s=0.1)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _request(i: int, ttft_s: float, error: str | None = None) -> RequestResult:
    first = i + ttft_s
    times = (first, first + 0.05, first + 0.1)
    return RequestResult(i, 8, 3, float(i), times[-1], first, times, 3, error)


def _report(requests: list[RequestResult]) -> LoadReport:
    return LoadReport(0.0, max(r.end_s for r in requests), tuple(requests))


class ModelServer:
    """Serves `capacity_rps` within the SLO; above it, that share of requests only."""

    def __init__(self, capacity_rps: float) -> None:
        self.capacity_rps = capacity_rps
        self.rates: list[float] = []

    async def __call__(self, rate: float) -> LoadReport:
        self.rates.append(rate)
        met = 100 if rate <= self.capacity_rps else round(100 * self.capacity_rps / rate)
        return _report([_request(i, 0.2 if i < met else 3.0) for i in range(100)])


def _boundary(server: ModelServer) -> float:
    return server.capacity_rps / 0.95  # 95 % of requests in the SLO up to here


async def test_the_ladder_climbs_then_two_bisections_bracket_the_boundary() -> None:
    server = ModelServer(capacity_rps=7.0)
    found = await capacity_at_slo(server, SLO, start_rps=1.0)
    assert found.rate_rps is not None and found.failed_at_rps is not None
    assert found.rate_rps <= _boundary(server) < found.failed_at_rps
    assert found.failed_at_rps / found.rate_rps == pytest.approx(1.5**0.25)
    # 1, 1.5, 2.25, 3.4 and 5.1 hold; 7.6 is past the boundary (7.4); two bisections follow.
    ladder = [1.5**k for k in range(6)]
    assert server.rates[:6] == pytest.approx(ladder)
    assert len(server.rates) == 6 + 2 == found.server_windows


async def test_above_capacity_the_ladder_steps_down() -> None:
    server = ModelServer(capacity_rps=2.0)
    found = await capacity_at_slo(server, SLO, start_rps=20.0)
    assert found.rate_rps is not None
    assert found.rate_rps <= _boundary(server) < (found.failed_at_rps or math.inf)
    assert server.rates[0] == 20.0 and server.rates[1] == pytest.approx(20.0 / 1.5)


async def test_a_server_that_holds_no_rate_has_no_capacity() -> None:
    server = ModelServer(capacity_rps=0.0)
    found = await capacity_at_slo(server, SLO, start_rps=1.0, max_ladder=3)
    assert found.rate_rps is None
    assert len(server.rates) == 4 and not any(w.holds for w in found.windows)


def test_one_failed_request_breaks_a_window_that_otherwise_holds() -> None:
    fine = [_request(i, 0.2) for i in range(99)]
    assert judge_window(3.0, _report([*fine, _request(99, 0.2)]), SLO).holds
    broken = judge_window(3.0, _report([*fine, _request(99, 0.2, error="HTTP 500")]), SLO)
    assert not broken.holds and broken.failed == 1


def test_a_window_holds_at_95_percent_in_the_slo_and_not_below() -> None:
    at = [_request(i, 0.2 if i < 95 else 2.0) for i in range(100)]
    below = [_request(i, 0.2 if i < 94 else 2.0) for i in range(100)]
    assert judge_window(1.0, _report(at), SLO).holds
    assert not judge_window(1.0, _report(below), SLO).holds


async def test_a_ladder_without_a_positive_start_is_refused() -> None:
    with pytest.raises(ValueError, match="positive start rate"):
        await capacity_at_slo(ModelServer(1.0), SLO, start_rps=0.0)
