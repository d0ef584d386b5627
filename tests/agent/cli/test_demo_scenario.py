"""The demo's scenario as data: the configuration validates, and the loads are sized so
that the steady one fits the KV budget, the burst cannot, and tuning can find one it fits."""

from __future__ import annotations

from kvpilot.agent.app.parts import tuned_server
from kvpilot.agent.cli.demo.scenario import (
    BLOCK_TOKENS,
    BURST,
    KV_BYTES,
    KV_MAX_BYTES,
    KV_MIN_BYTES,
    PHASES,
    STABLE,
    STEADY,
    demo_config,
    timeline,
)
from kvpilot.agent.config import LocalRuntimeConfig, validate_config
from kvpilot.agent.tuning.study import build_study

KV_BYTES_PER_TOKEN = 1024  # the tiny model: 2 layers x 2 KV heads x 64 dims x 2 (K, V) x 2 bytes


def _config(cpus: tuple[int, int] | None = (0, 1)):  # type: ignore[no-untyped-def]
    return validate_config(
        demo_config(
            listen_port=9400,
            server_port=8000,
            kvpool_port=9500,
            canary_port=8199,
            state_dir="/tmp/kvpilot-demo-test",
            webhook_url="http://127.0.0.1:1/alerts",
            webhook_secret="s" * 48,
            cpus=cpus,
        )
    )


def _blocks(kv_bytes: int) -> int:
    return kv_bytes // (KV_BYTES_PER_TOKEN * BLOCK_TOKENS)


def test_the_steady_load_fits_and_the_burst_does_not() -> None:
    blocks = _blocks(KV_BYTES)
    assert STEADY.concurrency * STEADY.blocks_each() <= blocks // 2
    assert BURST.concurrency * BURST.blocks_each() > 2 * blocks


def test_every_budget_tuning_tries_holds_the_burst_the_stable_cannot() -> None:
    space = build_study(tuned_server(_config()), _config().tuning).space
    memory = next(k for k in space.knobs if k.name == "kv_cache_memory_bytes")
    seqs = next(k for k in space.knobs if k.name == "max_num_seqs")
    assert memory.low == KV_MIN_BYTES and memory.high == KV_MAX_BYTES
    assert BURST.concurrency * BURST.blocks_each() <= _blocks(KV_MIN_BYTES)
    assert BURST.concurrency * BURST.blocks_each() > _blocks(KV_BYTES)
    assert seqs.low is not None and seqs.high is not None
    assert seqs.low <= BURST.concurrency <= seqs.high  # it can run the burst at once


def test_the_configuration_restarts_on_a_spike_and_pins_the_canary_apart() -> None:
    config = _config()
    assert config.rules.preemption_spike.action == "restart"
    assert config.rules.preemption_spike.for_s > 0  # pending is seen before firing
    assert config.notifiers[0].hmac_secret is not None
    assert isinstance(config.runtime, LocalRuntimeConfig)
    (stable,) = config.runtime.instances
    assert stable.name == STABLE and stable.cpus == (0,)
    assert config.tuning.canary_cpus == (1,) and config.tuning.strategy == "parallel"
    assert 2 <= config.tuning.trials <= 3
    unpinned = _config(cpus=None)
    assert unpinned.tuning.canary_cpus == ()


def test_the_timeline_tells_the_four_phases_in_order() -> None:
    lines = timeline().splitlines()
    assert [p.number for p in PHASES] == [1, 2, 3, 4]
    assert [line.split(".")[0] for line in lines] == ["1", "2", "3", "4"]
    assert "VllmPreemptionSpike" in lines[1] and "restart" in lines[1]


def test_the_steady_trickle_pauses_only_while_tuning_measures() -> None:
    assert [p.steady_load for p in PHASES] == [True, True, False, True]
