"""Study fingerprints are stable and change with what makes goodput comparable."""

from __future__ import annotations

from kvpilot.collectors.vllm_argv import canonical_flags
from kvpilot.tuner.problem.fingerprint import fingerprint
from kvpilot.tuner.problem.objective import Slo


def test_flag_spelling_and_order_do_not_matter() -> None:
    a = ["--max-model-len", "1024", "--enforce-eager", "--dtype=bfloat16"]
    b = ["--dtype", "bfloat16", "--max_model_len=1024", "--enforce-eager"]
    assert canonical_flags(a) == canonical_flags(b)
    assert fingerprint("m", a, "w", Slo()) == fingerprint("m", b, "w", Slo())
    mapping = {"max_model_len": 1024, "dtype": "bfloat16", "enforce_eager": ""}
    assert fingerprint("m", mapping, "w", Slo()) == fingerprint("m", a, "w", Slo())


def test_each_part_changes_the_fingerprint() -> None:
    base = fingerprint("m", ["--max-model-len", "1024"], "w", Slo())
    assert len(base) == 16 and int(base, 16) >= 0
    assert fingerprint("other", ["--max-model-len", "1024"], "w", Slo()) != base
    assert fingerprint("m", ["--max-model-len", "2048"], "w", Slo()) != base
    assert fingerprint("m", ["--max-model-len", "1024"], "w2", Slo()) != base
    assert fingerprint("m", ["--max-model-len", "1024"], "w", Slo(ttft_p95_s=1.0)) != base
