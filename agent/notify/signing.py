"""HMAC-SHA256 signatures over `<timestamp>.<body>`, the way Stripe and Slack sign webhooks.

The sender puts the Unix time in `X-Kvpilot-Timestamp` and `sha256=<hex>` in
`X-Kvpilot-Signature`; a receiver recomputes the HMAC with the shared secret and rejects a
timestamp too far from its own clock, so a captured request cannot be replayed later.
"""

from __future__ import annotations

import hashlib
import hmac

from pydantic import SecretStr

SIGNATURE_HEADER = "X-Kvpilot-Signature"
TIMESTAMP_HEADER = "X-Kvpilot-Timestamp"
DEFAULT_TOLERANCE_S = 300.0


def _key(secret: SecretStr | str | bytes) -> bytes:
    if isinstance(secret, SecretStr):
        return secret.get_secret_value().encode()
    return secret.encode() if isinstance(secret, str) else secret


def sign(secret: SecretStr | str | bytes, timestamp: int, body: bytes) -> str:
    """The signature header's value for `body` sent at `timestamp` (Unix seconds)."""
    digest = hmac.new(_key(secret), f"{timestamp}.".encode() + body, hashlib.sha256)
    return f"sha256={digest.hexdigest()}"


def verify_signature(
    secret: SecretStr | str | bytes,
    timestamp: str | int,
    body: bytes,
    header: str | None,
    now: float,
    tolerance_s: float = DEFAULT_TOLERANCE_S,
) -> bool:
    """True when `header` signs `body` at `timestamp` and `timestamp` is within tolerance of now."""
    if header is None:
        return False
    try:
        stamp = int(timestamp)
    except (TypeError, ValueError):
        return False
    if abs(now - stamp) > tolerance_s:
        return False
    return hmac.compare_digest(sign(secret, stamp, body), header.strip())
