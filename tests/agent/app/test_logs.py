"""Log records are masked whole: the message, the `extra=` fields, the exception text."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from kvpilot.agent.app.logs import JsonFormatter, MaskSecrets

SLACK = "https://hooks.example/services/T0/B0/slackpathsecret"
TOKEN = "querytoken123"


@pytest.fixture
def json_lines() -> Iterator[tuple[logging.Logger, io.StringIO]]:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter())
    handler.addFilter(MaskSecrets([SLACK, "/services/T0/B0/slackpathsecret"]))
    logger = logging.getLogger("tests.logs.masking")
    logger.handlers[:] = [handler]
    logger.propagate = False
    logger.setLevel(logging.INFO)
    yield logger, out
    logger.handlers[:] = []


def _entries(out: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_extra_fields_are_masked_like_the_message(
    json_lines: tuple[logging.Logger, io.StringIO],
) -> None:
    logger, out = json_lines
    error = f"slack: HTTP 404: Cannot POST {SLACK}; webhook: /hook?token={TOKEN}"
    logger.warning(
        "delivery: failed %s",
        SLACK,
        extra={"notifier": "slack", "error": error, "nested": {"argv": ["--api-key", "sk-9"]}},
    )
    text = out.getvalue()
    assert SLACK not in text and "slackpathsecret" not in text and TOKEN not in text
    assert "sk-9" not in text
    (entry,) = _entries(out)
    assert entry["notifier"] == "slack"
    assert entry["nested"] == {"argv": ["--api-key", "***"]}
    assert "token=***" in str(entry["error"])


def test_exception_text_is_masked(json_lines: tuple[logging.Logger, io.StringIO]) -> None:
    logger, out = json_lines
    try:
        raise RuntimeError(f"could not reach {SLACK}?token={TOKEN}")
    except RuntimeError:
        logger.exception("delivery: notifier raised")
    (entry,) = _entries(out)
    assert "RuntimeError" in str(entry["exception"])
    assert "slackpathsecret" not in out.getvalue() and TOKEN not in out.getvalue()


def test_plain_lines_are_masked_too() -> None:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler.addFilter(MaskSecrets(["sk-config-key"]))
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "key %s and %s", None, None)
    record.args = ("sk-config-key", "VLLM_API_KEY=sk-env-1")
    handler.handle(record)
    assert out.getvalue() == "key *** and VLLM_API_KEY=***\n"
