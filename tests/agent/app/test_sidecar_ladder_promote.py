"""The sidecar as `kvpilot run` composes it: a preemption spike, after a tuning trial was
judged pass and promoted, restarts the server with that trial's flags (not the same ones).

In process (`run_sidecar`), with the local runtime running a stand-in vLLM process whose
/metrics come from a file the test writes: the preemption counter climbs until the server
runs new flags, then stands still, so the spike clears after the promotion.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from kvpilot.agent.app.compose import run_sidecar
from kvpilot.agent.app.parts import server_of
from kvpilot.agent.config import load_config
from kvpilot.agent.state import StateStore
from kvpilot.agent.state.trials import SqliteRolloutJournal, SqliteTrialStore
from kvpilot.agent.tick.sidecar import Sidecar
from kvpilot.agent.tuning.best import config_studies
from kvpilot.agent.tuning.promoted import PROMOTED_FACT
from kvpilot.agent.tuning.study import Study
from kvpilot.collectors.vllm_argv import flag_value, set_flag
from kvpilot.tuner.judge.judgement import Classification, Judgement
from kvpilot.tuner.problem.objective import TrialOutcome, TrialResult
from kvpilot.tuner.rollout.canary import Phase, RolloutRecord, Strategy
from kvpilot.tuner.trials import Trial, TrialState
from tests.faults.running_agent import base_config, free_port, standin_instance, write_config

T = TypeVar("T")
LABELS = '{engine="0",model_name="standin"}'


def _metrics(preemptions: int) -> str:
    return (
        f"# TYPE vllm:num_preemptions_total counter\n"
        f"vllm:num_preemptions_total{LABELS} {preemptions}\n"
        f"# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{LABELS} 0.5\n"
        f"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{LABELS} 8\n"
        f"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{LABELS} 2\n"
    )


async def _until(what: str, probe: Callable[[], T | None], timeout_s: float = 30.0) -> T:
    deadline = time.monotonic() + timeout_s
    while (value := probe()) is None or value is False:
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what}")
        await asyncio.sleep(0.05)
    return value


def _promoted_trial(store: StateStore, study: Study, seqs: int) -> None:
    values = (("kv_cache_memory_bytes", 32 << 20), ("max_num_seqs", seqs))
    trial = Trial(
        "t1",
        study.fingerprint,
        1,
        values,
        TrialState.COMPLETE,
        1.0,
        2.0,
        result=TrialResult(TrialOutcome.FEASIBLE, 150.0, 32 << 20, None),
        judgement=Judgement(Classification.PASS, 1.0, (), "from the test"),
    )
    SqliteTrialStore(store.db).add(trial)
    candidate = set_flag(study.configured_argv, "--max-num-seqs", seqs)
    record = RolloutRecord(
        "t1", Strategy.PARALLEL, Phase.PROMOTED, study.configured_argv, candidate, 2.0
    )
    SqliteRolloutJournal(store.db).save(record)


def test_a_spike_after_a_validated_trial_promotes_its_flags(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.prom"
    metrics.write_text(_metrics(0))
    instance = standin_instance(tmp_path, "vllm", free_port(), metrics=metrics)
    instance["argv"] += ["--kv-cache-memory-bytes", str(64 << 20), "--max-num-seqs", "4"]
    data: dict[str, Any] = base_config(
        tmp_path,
        [instance],
        rules={"preemption_spike": {"window_s": 2.0, "floor_per_s": 1.0}},
        remediation={"cooldown_s": 0, "preflight": {"enabled": False}},
    )
    config = load_config(write_config(tmp_path / "kvpilot.yaml", data))
    study = config_studies(config.tuning, server_of(config))("vllm", tuple(instance["argv"]))
    assert isinstance(study, Study), study
    config.state_dir.mkdir(parents=True)
    with StateStore.open(config.state_dir) as store:
        _promoted_trial(store, study, seqs=16)
    ticked: list[Sidecar] = []
    count = {"preemptions": 0}

    def on_tick(sidecar: Sidecar) -> None:
        ticked.append(sidecar)
        running = next(iter(sidecar.runtime.instances()))
        if flag_value(running.argv or (), "--max-num-seqs") == "4" and running.main_pid:
            count["preemptions"] += 5  # 10 per second while the old flags serve
            metrics.write_text(_metrics(count["preemptions"]))

    async def main() -> None:
        stop = asyncio.Event()
        agent = asyncio.create_task(
            run_sidecar(config, stop=stop, config_sha256="sha-1", on_tick=on_tick)
        )
        try:
            sidecar = await _until("the first tick", lambda: ticked[-1] if ticked else None)

            def promoted() -> bool:
                running = next(iter(sidecar.runtime.instances()))
                return flag_value(running.argv or (), "--max-num-seqs") == "16"

            await _until("the promotion", promoted)
            await _until("the remediation's end", lambda: not sidecar.remediator.in_progress())
            (record,) = sidecar.store.remediations(limit=5)
            assert (record.action, record.state) == ("promote", "succeeded"), record
            fact = sidecar.store.get_fact(PROMOTED_FACT)
            assert fact["yaml_sha256"] == "sha-1" and "--max-num-seqs" in fact["argv"]
            restarts = [a for a in sidecar.store.audit_records() if a.action == "restart"]
            assert restarts == []  # a promotion, not a restart with the same flags
        finally:
            stop.set()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(agent, timeout=30)

    asyncio.run(main())
    assert (tmp_path / "vllm.starts").read_text() == "2"
