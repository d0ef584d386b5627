"""`kvpilot run` tunes on its schedule against the real CPU vLLM: the cron firing runs a
parallel canary and the promotion is a remediation (audited, under the guards). That the
promoted flags outlive a restart of kvpilot is tested in test_run_sidecar_promoted.py."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import yaml

from kvpilot.agent.runtimes.processes import find_vllm_mains
from kvpilot.agent.state.db import Database
from kvpilot.agent.state.store import StateStore
from kvpilot.agent.state.trials import SqliteRolloutJournal, SqliteTrialStore
from kvpilot.collectors.procfs import list_processes
from kvpilot.rig.server import free_port
from kvpilot.tuner.rollout.canary import Phase
from tests.agent.sidecar_harness import (
    AgentProcess,
    agent_config,
    kill_servers_of,
    server_spec,
    wait_for,
)
from tests.tuner.tune_study import (
    CANARY_CPUS,
    CONCURRENCY,
    MAX_SEQS,
    OUTPUT_LEN,
    POOR_KV_BYTES,
    PROMPT_LEN,
    REQUESTS,
    STABLE_CPUS,
    needs_two_cores,
    quiet,
)

pytestmark = [pytest.mark.slow, needs_two_cores, quiet]

# This test is about the wiring (schedule, canary, promotion as a remediation), not the SLO's
# edge, so its latency limits are wide: on an AMD EPYC without AVX-512, beside kvpilot's own
# process and two load generators, a winning candidate (10 MiB, 14 sequences, no preemption)
# met 3.5 s TTFT and 0.25 s inter-token p95 with only 80 % of its requests (each new prompt's
# prefill stretched the running requests' steps). The stable server stays infeasible by its
# preemptions (0.23 per request, 0.1 allowed), and the judge still tells the two apart.
TTFT_P95_S, INTER_TOKEN_P95_S = 8.0, 1.0


def _config(tmp_path: Path, marker: str, canary_port: int) -> Path:
    spec = server_spec(
        served_model_name=marker,
        kv_cache_memory_bytes=POOR_KV_BYTES,
        max_num_seqs=MAX_SEQS,
        cpus=STABLE_CPUS,
    )
    path = agent_config(
        tmp_path,
        spec=spec,
        rules={},
        notifiers=[],
        listen_port=free_port(),
        remediation={"cooldown_s": 300, "drain_timeout_s": 10, "verify_timeout_s": 300},
    )
    data = yaml.safe_load(path.read_text())
    data["tuning"] = {
        "schedule": "* * * * *",  # every minute: the first firing comes within 60 s
        "trials": 1,
        "canary_port": canary_port,
        "canary_cpus": list(CANARY_CPUS),
        # Every candidate in this range holds the whole workload at once: a clear winner
        # (12 sequences queued the first wave to a TTFT max of 3.6 s on a slow machine).
        "kv_min_bytes": 8 << 20,
        "kv_max_bytes": 16 << 20,
        "min_num_seqs": 14,
        "max_num_seqs": MAX_SEQS,
        "workload": {
            "requests": REQUESTS,
            "concurrency": CONCURRENCY,
            "prompt_len": PROMPT_LEN,
            "output_len": OUTPUT_LEN,
        },
        "slo": {"ttft_p95_s": TTFT_P95_S, "inter_token_p95_s": INTER_TOKEN_P95_S},
        "bake": False,
        # The wiring, not the statistics: five windows a side, with the error margin and
        # memory saving a CPU rig's few requests and MiB budgets can show.
        "windows": 5,
        "error_margin_ratio": 0.05,
        # The candidate runs 14-16 sequences where the stable's KV budget holds 4: each decode
        # step carries four times the batch. On CI's machine that put the inter-token p95
        # beyond x1.1 over five windows, and the judge rightly did not pass it; the latency
        # trade is the operator's, and this rig accepts up to x3.
        "latency_margin_ratio": 2.0,
        "min_memory_saving_bytes": 1 << 20,
    }
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_the_schedule_runs_a_canary_and_promotes_through_the_remediator(tmp_path: Path) -> None:
    marker = f"sched-tune-{uuid.uuid4().hex[:8]}"
    canary_port = free_port()
    path = _config(tmp_path, marker, canary_port)
    state_dir = tmp_path / "state"
    agent = AgentProcess(
        path, int(yaml.safe_load(path.read_text())["listen"]["port"]), tmp_path / "agent.log"
    )
    try:
        agent.start()
        wait_for("the stable instance", lambda: agent.collector_up("vllm"), 300)
        first_pid = agent.main_pid()

        def tuned() -> bool:
            assert agent.process is not None and agent.process.poll() is None, agent.log_tail()
            db = Database.open(state_dir)
            try:
                return any(
                    a.action == "tune" and a.decision in ("finished", "failed")
                    for a in StateStore(db).audit_records()
                )
            finally:
                db.close()

        wait_for("a scheduled tuning run", tuned, 60 + 600, poll_s=2.0)
        db = Database.open(state_dir)
        try:
            audits = [(a.action, a.decision, a.reason) for a in StateStore(db).audit_records()]
            print("\n".join(map(str, reversed(audits))))
            tune = [a for a in reversed(audits) if a[0] == "tune"]
            # The first run, to its end: the next minute's firing may already have started
            # another (a promotion's restart spends the restart budget, not the cooldown).
            ended = next(i for i, (_, d, _) in enumerate(tune) if d in ("finished", "failed"))
            first = tune[: ended + 1]
            # A firing while the stable server was still starting runs once it is up; one
            # during the run is skipped.
            ran = [d for _, d, _ in first if d not in ("skipped", "deferred")]
            assert ran == ["started", "finished"], tune
            assert all(
                "cooldown" in r or r == "the previous tuning run is still going"
                for _, d, r in first
                if d == "skipped"
            ), tune
            trial = min(SqliteTrialStore(db).trials(), key=lambda t: t.number)
            assert trial.number == 1
            (record,) = [
                r for r in SqliteRolloutJournal(db).records() if r.trial_id == trial.trial_id
            ]
            assert record.phase is Phase.PROMOTED, record.reason
            # Judged on the default five paired windows: one summary per window a side.
            assert (record.reason or "").startswith("judged pass"), record.reason
            assert trial.judgement is not None
            ttft = next(m for m in trial.judgement.metrics if m.name == "ttft_s")
            assert (ttft.canary_count, ttft.baseline_count) == (5, 5)
            # The promotion was a remediation of the stable instance, audited as the agent's.
            (promotion,) = StateStore(db).remediations(instance="vllm")
            assert promotion.action == "promote" and promotion.state == "succeeded"
            assert any(a[0] == "cooldown" and a[1] == "allowed" for a in audits)
        finally:
            db.close()
        kv = str(dict(trial.values)["kv_cache_memory_bytes"])
        target = agent.target()
        assert target["main_pid"] != first_pid and kv in target["live_flags"]
        assert target["live_flags_source"] == "promoted by the tuner"
        # No canary is left once kvpilot has stopped (nor one a later firing started).
        assert agent.stop() == 0, agent.log_tail()
        assert find_vllm_mains(list_processes(), port=canary_port) == []
    finally:
        agent.stop()
        kill_servers_of(marker)
