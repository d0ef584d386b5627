"""Logging set-up: JSON lines for the agent, plain lines for interactive commands.

Every record is masked before any handler formats it, whichever logger wrote it: the
message, each `extra=` field, the exception and the stack text (`collectors.secrets`: the
secrets given to `configure_logging` and whatever reads as one).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Iterable

from kvpilot.collectors.secrets import mask, mask_text

_RESERVED = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message"}


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time, level, logger, message, and any `extra=` fields."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry |= {k: v for k, v in record.__dict__.items() if k not in _RESERVED}
        exception = record.exc_text
        if exception is None and record.exc_info:
            exception = self.formatException(record.exc_info)
        if exception:
            entry["exception"] = exception
        if record.stack_info:
            entry["stack"] = record.stack_info
        return json.dumps(entry, default=str)


class MaskSecrets(logging.Filter):
    """Masks the record in place: the rendered message, the `extra=` fields, the exception
    (rendered once here, so no formatter renders it again unmasked) and the stack."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        super().__init__()
        self._secrets = tuple(s for s in secrets if s)
        self._plain = logging.Formatter()

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg, record.args = mask_text(record.getMessage(), self._secrets), None
        for key, value in list(record.__dict__.items()):
            if key not in _RESERVED:
                record.__dict__[key] = mask(_plain(value), self._secrets)
        if record.exc_info and not record.exc_text:
            record.exc_text = self._plain.formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = mask_text(record.exc_text, self._secrets)
        if record.stack_info:
            record.stack_info = mask_text(record.stack_info, self._secrets)
        return True


def _plain(value: object) -> object:
    """JSON-like data as is; anything else as the text the formatter would write."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return str(value)


def configure_logging(
    *, json_logs: bool, level: int = logging.INFO, secrets: Iterable[str] = ()
) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if json_logs:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.addFilter(MaskSecrets(secrets))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("apscheduler").setLevel(logging.WARNING)
