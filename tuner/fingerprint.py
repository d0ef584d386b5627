"""A stable hash of what makes trials comparable: model, fixed flags, workload, SLO.

Trials share a fingerprint only when their goodput figures mean the same thing; the
Bayesian suggester warm-starts from those and no others.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence

from kvpilot.tuner.objective import Slo

FINGERPRINT_CHARS = 16


def canonical_flags(argv: Sequence[str]) -> list[list[str]]:
    """Flags as sorted [flag, value] pairs; `--a=b` and `--a b` are the same flag."""
    pairs: list[list[str]] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        if token.startswith("--") and "=" in token:
            name, value = token.split("=", 1)
            pairs.append([name.replace("_", "-"), value])
        elif token.startswith("--"):
            has_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
            pairs.append([token.replace("_", "-"), argv[i + 1] if has_value else ""])
            i += int(has_value)
        else:
            pairs.append(["", token])  # a positional argument keeps its text
        i += 1
    return sorted(pairs)


def digest(payload: object) -> str:
    """sha256 of the canonical JSON of a value, cut to FINGERPRINT_CHARS hex digits."""
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:FINGERPRINT_CHARS]


def fingerprint(
    model: str,
    fixed_flags: Sequence[str] | Mapping[str, object],
    workload_hash: str,
    slo: Slo,
) -> str:
    """The fingerprint of a tuning study."""
    if isinstance(fixed_flags, Mapping):
        flags = sorted(
            ["--" + k.lstrip("-").replace("_", "-"), str(v)] for k, v in fixed_flags.items()
        )
    else:
        flags = canonical_flags(fixed_flags)
    return digest(
        {"model": model, "flags": flags, "workload": workload_hash, "slo": dataclasses.asdict(slo)}
    )
