"""The study both tuning end-to-end tests run on the real CPU vLLM: a stable server whose KV
budget preempts heavily under a workload of long prompts, on its own core."""

from __future__ import annotations

import os

import pytest

BLOCK_BYTES = 32 * 1024  # the tiny model's KV bytes per 32-token block
# 384-token prompts (12 blocks) growing to 14 blocks, 16 at once: 224 blocks to hold them all.
PROMPT_LEN, OUTPUT_LEN, REQUESTS, CONCURRENCY = 384, 64, 64, 16
MAX_SEQS = 16
POOR_KV_BYTES = 64 * BLOCK_BYTES  # 4 requests at a time, preempting and recomputing
# Each instance on its own core, so that neither slows the other down.
STABLE_CPUS, CANARY_CPUS = (0,), (1,)
# Limits met with room to spare when the model has the KV cache it needs, and missed by the
# poor stable server, on the slowest machine seen. On an AMD EPYC without AVX-512 (bf16
# emulated), one core: 512 blocks and 16 sequences had TTFT p95 2.45 s, max 2.47 s (8 % over
# the default 2 s, which failed these tests there); 64 blocks (the stable) met 3.5 s with
# about half its requests (30 % at 3 s, 86-91 % at 4 s). Machines with AVX-512 are about
# twice as fast (a run there where 16 % of TTFTs passed 1 s set the earlier 2 s).
TTFT_P95_S, INTER_TOKEN_P95_S = 3.5, 0.25

needs_two_cores = pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="each instance needs a core of its own"
)
# Measured comparisons want the cores to themselves: the shared servers go first.
quiet = pytest.mark.usefixtures("quiet_machine")
