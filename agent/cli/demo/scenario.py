"""The demo's story as data: its configuration, its loads and its four phases.

"A restart is first aid, tuning is the cure." A small KV budget (64 blocks of 32 tokens)
serves a steady trickle comfortably; a burst of long requests does not fit, so vLLM
preempts, `VllmPreemptionSpike` fires and the rule's `restart` runs. Tuning then finds a
budget (or a `--max-num-seqs`) the burst fits in; the same burst again finds it promoted.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

from kvpilot.rig.amx_hook import with_amx_hook
from kvpilot.rig.server import ServerSpec, build_argv
from kvpilot.tuner.load.generator import LengthDist, Workload

STABLE = "demo"
BLOCK_TOKENS = 32
# The tiny model keeps 1 KiB of KV per token: 2 MiB is 64 blocks of 32 tokens.
KV_BYTES = 2 * 1024 * 1024
KV_MAX_BYTES = 12 * 1024 * 1024  # tuning may go up to 384 blocks
# Two trials are few: the search starts where the burst's 192 blocks fit, and at the
# burst's own concurrency or near it, where a candidate can beat the stable server. A
# wider space is searched the same way; it needs more trials to find the cure.
KV_MIN_BYTES = 6 * 1024 * 1024
MIN_NUM_SEQS = 12
WEBHOOK_SECRET_BYTES = 24


@dataclass(frozen=True, slots=True)
class Load:
    """A load as the scenario plays it; `workload(seed)` is what the load generator sends."""

    requests: int
    concurrency: int
    prompt_tokens: int
    output_tokens: int

    def workload(self, seed: int) -> Workload:
        return Workload(
            num_requests=self.requests,
            concurrency=self.concurrency,
            prompt_len=LengthDist.fixed(self.prompt_tokens),
            output_len=LengthDist.fixed(self.output_tokens),
            seed=seed,
        )

    def blocks_each(self) -> int:
        return -(-(self.prompt_tokens + self.output_tokens) // BLOCK_TOKENS)


# Two short requests at a time: 2 x 4 blocks of 64, never a preemption.
STEADY = Load(requests=8, concurrency=2, prompt_tokens=64, output_tokens=64)
# Sixteen at once, 12 blocks each when done: 192 blocks wanted of 64, so vLLM preempts.
BURST = Load(requests=32, concurrency=16, prompt_tokens=128, output_tokens=256)


@dataclass(frozen=True, slots=True)
class DemoPhase:
    number: int
    name: str
    story: str  # one line: what the viewer is about to see
    deadline_s: float  # the longest it may take before the demo says so and moves on
    # The steady trickle goes on beside the phase; off while tuning measures, so that the
    # stable side of each comparison serves the replayed burst alone, as the canary does.
    steady_load: bool = True


PHASES = (
    DemoPhase(
        1, "steady load", "a trickle of requests: the figures settle, each with its state", 40
    ),
    DemoPhase(
        2,
        "burst",
        "16 long requests at once on 64 KV blocks: vLLM preempts, VllmPreemptionSpike goes pending "
        "then firing, the signed webhook arrives, the rule's restart drains, restarts, verifies",
        300,
    ),
    DemoPhase(
        3,
        "tuning",
        "the trickle pauses; two trials, a parallel canary on the second core, replaying the "
        "burst on both: each verdict, "
        "then the better KV budget or --max-num-seqs promoted",
        720,
        steady_load=False,
    ),
    DemoPhase(
        4,
        "burst again",
        "the same burst on the promoted flags: no spike, or if one comes the ladder promotes "
        "instead of restarting",
        240,
    ),
)


def timeline() -> str:
    """The scenario in a few lines (the README and `kvpilot demo --help` show it)."""
    return "\n".join(f"{p.number}. {p.name}: {p.story}." for p in PHASES)


def stable_argv(port: int, python: str = sys.executable) -> list[str]:
    spec = ServerSpec(
        port=port, kv_cache_memory_bytes=KV_BYTES, shutdown_timeout_s=2, block_size=BLOCK_TOKENS
    )
    return build_argv(spec, python=python)


def demo_config(
    *,
    listen_port: int,
    server_port: int,
    kvpool_port: int,
    canary_port: int,
    state_dir: str,
    webhook_url: str,
    webhook_secret: str,
    cpus: tuple[int, int] | None,
    trials: int = 2,
) -> dict[str, Any]:
    """The embedded default's sections, sized for the story; validated by the caller."""
    instance: dict[str, Any] = {
        "name": STABLE,
        "role": "stable",
        "argv": stable_argv(server_port),
        "env": {
            "HF_HUB_OFFLINE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            # The rig's AMX hook, as for every server the rig starts (rig/amx_hook.py).
            "PYTHONPATH": with_amx_hook(os.environ.get("PYTHONPATH")),
        },
        "kvpool_port": kvpool_port,
    }
    tuning: dict[str, Any] = {
        "schedule": "0 0 1 1 *",  # the demo fires its session itself; the year's first minute
        "trials": trials,
        "strategy": "parallel",
        "canary_port": canary_port,
        "memory_knob": "kv_cache_memory_bytes",
        "kv_min_bytes": KV_MIN_BYTES,
        "kv_max_bytes": KV_MAX_BYTES,
        "min_num_seqs": MIN_NUM_SEQS,
        "max_num_seqs": 16,
        "workload": {
            "requests": BURST.requests,
            "concurrency": BURST.concurrency,
            "prompt_len": BURST.prompt_tokens,
            "output_len": BURST.output_tokens,
        },
        "slo": {"ttft_p95_s": 30.0, "inter_token_p95_s": 2.0},
        "bake": False,
        # The session replays the burst that hurt, not the trickle the window would learn.
        "learn": {"enabled": False},
        # A story on a CPU, not a calibration: five windows a side, and the error and
        # preemption margins and memory saving its few requests and MiB budgets can show
        # (160 requests a side show no preemptions within 0.019 a request, not within 0.01).
        "windows": 5,
        "error_margin_ratio": 0.05,
        "preemption_margin_per_request": 0.05,
        "min_memory_saving_bytes": 1 << 20,
    }
    if cpus is not None:  # the stable server on one core, the canary on the other
        instance["cpus"] = [cpus[0]]
        tuning["canary_cpus"] = [cpus[1]]
    return {
        "listen": {"host": "127.0.0.1", "port": listen_port},
        "interval_s": 1.0,
        "state_dir": state_dir,
        "runtime": {
            "kind": "local",
            "drain_timeout_s": 5,
            "ready_timeout_s": 240,
            "instances": [instance],
        },
        "rules": {
            "preemption_spike": {
                "action": "restart",  # the card's literal action: first aid
                "window_s": 10,
                # Long enough to see pending, and for vLLM's own counter (which lags the
                # kvpool plugin's) to show the preemptions before the restart resets it.
                "for_s": 8,
                "floor_per_s": 0.2,
            },
        },
        "notifiers": [
            {
                "kind": "webhook",
                "name": "demo-receiver",
                "url": webhook_url,
                "hmac_secret": webhook_secret,
                "timeout_s": 5,
            }
        ],
        "remediation": {
            "cooldown_s": 5,
            "drain_timeout_s": 5,
            "verify_timeout_s": 120,
            "budget": {"max_restarts": 10, "window_s": 3600},
        },
        "tuning": tuning,
    }
