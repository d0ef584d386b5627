"""A stable hash of what makes trials comparable: model, fixed flags, workload, SLO.

Trials share a fingerprint only when their goodput figures mean the same thing; the
Bayesian suggester warm-starts from those and no others.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence

from kvpilot.collectors.vllm_argv import canonical_flags, flag_name
from kvpilot.tuner.problem.objective import Slo

FINGERPRINT_CHARS = 16


def digest(payload: object) -> str:
    """sha256 of the canonical JSON of a value, cut to FINGERPRINT_CHARS hex digits."""
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:FINGERPRINT_CHARS]


def fingerprint(
    model: str,
    fixed_flags: Sequence[str] | Mapping[str, object],
    workload_hash: str,
    slo: Slo,
    *,
    vllm_version: str | None = None,
) -> str:
    """The fingerprint of a tuning study: `fixed_flags` as a command line (read by
    `canonical_flags`: any launch form, spelling or order of one server is one study) or as
    a mapping of flag names to values. `vllm_version`: the server's, from `/version`; a new
    version is a new study, since its goodput figures are another engine's. Unknown (None),
    it is left out, so a study recorded before the version was known keeps its fingerprint."""
    if isinstance(fixed_flags, Mapping):
        flags = sorted(
            [flag_name("--" + k.lstrip("-")) or k, str(v)] for k, v in fixed_flags.items()
        )
    else:
        flags = canonical_flags(fixed_flags)
    payload: dict[str, object] = {
        "model": model,
        "flags": flags,
        "workload": workload_hash,
        "slo": dataclasses.asdict(slo),
    }
    if vllm_version is not None:
        payload["vllm_version"] = vllm_version
    return digest(payload)
