"""vLLM's start-up failures are read from its log with vLLM's own reason."""

from __future__ import annotations

from kvpilot.tuner.problem.startup_errors import StartupFailureKind, parse_startup_failure

# The messages as vLLM 0.32 formats them (v1/worker/utils.py, v1/core/kv_cache_utils.py),
# with the logger prefixes and the API server's generic line that follows them.
MEMORY_IN_USE = (
    "(EngineCore_DP0 pid=4242) ERROR 11-29 12:00:01 [core.py:900] ValueError: Free memory on "
    "device cuda:0 (10.5/79.1 GiB) on startup is less than desired GPU memory utilization "
    "(0.9, 71.2 GiB). Decrease GPU memory utilization or reduce GPU memory used by other "
    "processes."
)
TOO_SMALL = (
    "(EngineCore_DP0 pid=17) ValueError: To serve at least one request with the model's max "
    "seq len (1024), (0.03 GiB KV cache is needed, which is larger than the available KV cache "
    "memory (0.01 GiB). Based on the available memory, the estimated maximum model length is "
    "320. Try increasing `gpu_memory_utilization`"
)
NO_MEMORY = (
    "ValueError: No available memory for the cache blocks. Try increasing "
    "`gpu_memory_utilization` when initializing the engine."
)
GENERIC = (
    "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}"
)


def _log(*lines: str) -> str:
    return "\n".join(
        ["INFO 11-29 12:00:00 [api_server.py:1] vLLM API server version 0.32.0", *lines]
    )


def test_memory_held_by_others_is_too_much_asked() -> None:
    failure = parse_startup_failure(_log(MEMORY_IN_USE, GENERIC))
    assert failure.kind is StartupFailureKind.MEMORY_IN_USE
    assert failure.log_line is not None
    assert failure.log_line.startswith("ValueError: Free memory on device cuda:0")


def test_budget_below_one_request_is_too_little() -> None:
    failure = parse_startup_failure(_log(TOO_SMALL, GENERIC))
    assert failure.kind is StartupFailureKind.CACHE_TOO_SMALL
    assert "max seq len (1024)" in (failure.log_line or "")


def test_no_cache_memory() -> None:
    assert parse_startup_failure(_log(NO_MEMORY)).kind is StartupFailureKind.NO_CACHE_MEMORY


def test_root_cause_wins_over_the_generic_line_whatever_the_order() -> None:
    failure = parse_startup_failure(_log(GENERIC, TOO_SMALL))
    assert failure.kind is StartupFailureKind.CACHE_TOO_SMALL


def test_flag_rejection() -> None:
    line = (
        "ValueError: max_num_batched_tokens (64) must be greater than or equal to "
        "max_num_seqs (128)."
    )
    assert parse_startup_failure(_log(line)).kind is StartupFailureKind.INVALID_FLAGS


def test_only_the_generic_line() -> None:
    failure = parse_startup_failure(_log(GENERIC))
    assert failure.kind is StartupFailureKind.ENGINE_INIT


def test_nothing_known_is_unknown_without_a_line() -> None:
    failure = parse_startup_failure(_log("Killed"))
    assert failure.kind is StartupFailureKind.UNKNOWN
    assert failure.log_line is None
