"""JSON answers: non-finite numbers become null, wherever they sit in the value."""

from __future__ import annotations

import json
import math

from kvpilot.agent.app.json_render import JsonResponse, error_response, finite


def test_non_finite_floats_become_none_at_any_depth() -> None:
    value = {"a": math.nan, "b": [math.inf, {"c": -math.inf, "d": 1.5}], "e": (2, math.nan)}
    assert finite(value) == {"a": None, "b": [None, {"c": None, "d": 1.5}], "e": [2, None]}


def test_other_values_pass_unchanged() -> None:
    value = {"s": "NaN", "i": 10**30, "t": True, "n": None, "f": -0.0}
    assert finite(value) == value


def test_the_response_is_strict_json() -> None:
    body = JsonResponse({"value": math.nan, "values": [math.inf, 0.25]}).body
    assert json.loads(body, parse_constant=lambda token: 1 / 0) == {
        "value": None,
        "values": [None, 0.25],
    }


def test_an_error_response_can_close_the_connection() -> None:
    response = error_response(413, "too large", close=True, limit=10)
    assert response.status_code == 413
    assert json.loads(response.body) == {"error": "too large", "limit": 10}
    assert response.headers["connection"] == "close"
    assert "connection" not in error_response(404, "unknown").headers
