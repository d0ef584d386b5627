"""The tuner end to end on the real CPU vLLM: a canary promoted, one rolled back, one that
cannot start, and a `kvpilot tune` killed mid-canary then recovered by `kvpilot trials`."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from kvpilot.agent.config import load_config
from kvpilot.agent.runtimes.local import LocalInstanceSpec, LocalRuntime
from kvpilot.agent.runtimes.processes import find_vllm_mains
from kvpilot.agent.state.db import Database
from kvpilot.agent.state.store import StateStore
from kvpilot.agent.tuning.local.adapter import LocalTunerAdapter, open_stores
from kvpilot.agent.tuning.observer import LoadObserver
from kvpilot.agent.tuning.promoted import PROMOTED_FACT, yaml_hash
from kvpilot.collectors.procfs import list_processes
from kvpilot.rig.server import free_port
from kvpilot.tuner.judge.judgement import (
    DEFAULT_METRICS,
    Classification,
    JudgeConfig,
    with_margins,
)
from kvpilot.tuner.load.generator import LengthDist, Workload
from kvpilot.tuner.problem.objective import Slo, TrialOutcome, TrialResult
from kvpilot.tuner.problem.space import Candidate, Knob, KnobKind, SearchSpace
from kvpilot.tuner.problem.startup_errors import StartupFailureKind
from kvpilot.tuner.rollout.canary import Phase, RolloutOutcome, RolloutSettings, Strategy
from kvpilot.tuner.session import Progress, SessionSummary, TuningSession
from kvpilot.tuner.suggest import SearchExhausted
from kvpilot.tuner.trials import TrialState
from tests.agent.sidecar_harness import agent_config, kill_servers_of, server_spec, wait_for
from tests.tuner.tune_study import (
    BLOCK_BYTES,
    CANARY_CPUS,
    CONCURRENCY,
    INTER_TOKEN_P95_S,
    MAX_SEQS,
    OUTPUT_LEN,
    POOR_KV_BYTES,
    PROMPT_LEN,
    REQUESTS,
    STABLE_CPUS,
    TTFT_P95_S,
    needs_two_cores,
    quiet,
)

pytestmark = [pytest.mark.slow, needs_two_cores, quiet]

WORKLOAD = Workload(
    REQUESTS, LengthDist.fixed(PROMPT_LEN), LengthDist.fixed(OUTPUT_LEN), CONCURRENCY
)
BAD_KV_BYTES = 40 * BLOCK_BYTES  # 2 or 3 at a time: more queueing and more preemption
GOOD_KV_BYTES = 512 * BLOCK_BYTES  # every request at once, no preemption
TOO_SMALL_KV_BYTES = 16 * BLOCK_BYTES  # half of one request of max_model_len (32 blocks)
READY_TIMEOUT_S = 300.0
SCRAPE_INTERVAL_S = 0.25  # a window of a few seconds gives the judge a dozen scrapes or more
SLO = Slo(ttft_p95_s=TTFT_P95_S, inter_token_p95_s=INTER_TOKEN_P95_S)
# The mechanics end to end, not the statistics (tests/tuner/judge holds those): one window a
# side and a bake of one, with margins a window of 64 requests can show.
RIG = RolloutSettings(
    slo=SLO,
    ready_timeout_s=READY_TIMEOUT_S,
    windows=1,
    bake_windows=1,
    judge=JudgeConfig(
        metrics=with_margins(DEFAULT_METRICS, errors_ratio=0.05, preemptions_per_request=0.1)
    ),
)
# The CLI's runs: five windows a side, the error margin and memory saving a CPU rig can show.
RIG_TUNING = {"windows": 5, "error_margin_ratio": 0.05, "min_memory_saving_bytes": 1 << 20}


class ListSuggester:
    """Proposes a fixed list of candidates, in order (the test chooses good and bad)."""

    def __init__(self, candidates: list[Candidate]) -> None:
        self._left = list(candidates)
        self.told: list[tuple[Candidate, TrialResult]] = []

    def ask(self) -> Candidate:
        if not self._left:
            raise SearchExhausted("the list is used up")
        return self._left.pop(0)

    def tell(self, candidate: Candidate, result: TrialResult) -> None:
        self.told.append((candidate, result))


def _space() -> SearchSpace:
    return SearchSpace(
        knobs=(
            Knob("kv_cache_memory_bytes", KnobKind.INTEGER, BLOCK_BYTES, 64 << 20, log_scale=True),
            Knob("max_num_seqs", KnobKind.INTEGER, 1, 64, log_scale=True),
        )
    )


def _health(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def _servers_on(port: int) -> list[int]:
    return [info.pid for info in find_vllm_mains(list_processes(), port=port)]


@pytest.fixture
def study(tmp_path: Path) -> Iterator[tuple[Path, str, int]]:
    """A kvpilot YAML whose stable instance has a KV budget far too small for the load."""
    marker = f"tune-e2e-{uuid.uuid4().hex[:8]}"
    spec = server_spec(
        served_model_name=marker,
        kv_cache_memory_bytes=POOR_KV_BYTES,
        max_num_seqs=MAX_SEQS,
        cpus=STABLE_CPUS,
    )
    path = agent_config(
        tmp_path, spec=spec, rules={}, notifiers=[], remediation={}, listen_port=free_port()
    )
    data = yaml.safe_load(path.read_text())
    data["tuning"] = {**data.get("tuning", {}), **RIG_TUNING}
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    try:
        yield path, marker, spec.port
    finally:
        kill_servers_of(marker)


def _runtime(path: Path, canary_port: int, db: Database) -> tuple[LocalRuntime, LocalTunerAdapter]:
    cfg = load_config(path)
    inst = cfg.runtime.instances[0]
    env = tuple(inst.env.items())
    log_dir = cfg.state_dir / "logs"
    stable = LocalInstanceSpec(
        inst.name, tuple(inst.argv), "stable", env, inst.kvpool_port, inst.cpus
    )
    runtime = LocalRuntime([stable], log_dir)
    adapter = LocalTunerAdapter(
        runtime,
        stable_name=inst.name,
        canary_port=canary_port,
        log_dir=log_dir,
        db=db,
        configured_argv=tuple(inst.argv),
        config_sha256=yaml_hash(path),
        canary_env=env,
        canary_cpus=CANARY_CPUS,
        drain_timeout_s=5.0,
    )
    return runtime, adapter


def _affinity(pids: list[int]) -> set[int]:
    return set().union(*(os.sched_getaffinity(pid) for pid in pids))


def _print_outcomes(summary: SessionSummary) -> None:
    for o in summary.outcomes:
        print(f"trial {o.trial.number}: {o.record.phase.value}: {o.record.reason}")
        for v in o.trial.judgement.metrics if o.trial.judgement else ():
            print(f"  {v.name}: {v.verdict.value}, {v.reason}")
        for name, r in (("candidate", o.trial.result), ("stable", o.baseline)):
            if r is not None and r.metrics is not None:
                m = r.metrics
                print(
                    f"  {name}: goodput {r.goodput_tokens_per_s:.0f} tok/s, attainment "
                    f"{m.attainment_ratio}, preemptions per request {m.preemptions_per_request}"
                )


def _check_promoted(
    outcome: RolloutOutcome, runtime: LocalRuntime, db: Database, stable_pid: int
) -> None:
    """Promoted: clearly better goodput, fewer preemptions, the new flags live and recorded."""
    assert outcome.record.phase is Phase.PROMOTED, outcome.record.reason
    canary, baseline = outcome.trial.result, outcome.baseline
    assert canary is not None and baseline is not None
    assert canary.metrics is not None and baseline.metrics is not None
    ratio = canary.goodput_tokens_per_s / max(baseline.goodput_tokens_per_s, 1e-9)
    pre_c = canary.metrics.preemptions_per_request
    pre_b = baseline.metrics.preemptions_per_request
    print(
        f"promoted: goodput {canary.goodput_tokens_per_s:.0f} vs stable "
        f"{baseline.goodput_tokens_per_s:.0f} tok/s (ratio {ratio:.2f}); preemptions per "
        f"request {pre_c} vs {pre_b}; bake goodput {outcome.record.bake_goodput_tokens_per_s}"
    )
    assert ratio >= 1.2
    assert pre_b is not None and pre_c is not None and pre_c < pre_b
    live = next(i for i in runtime.instances() if i.name == "vllm")
    assert str(GOOD_KV_BYTES) in live.argv and live.main_pid != stable_pid
    assert _health(live.url)
    fact = StateStore(db).get_fact(PROMOTED_FACT)
    assert fact is not None and tuple(fact["argv"]) == tuple(live.argv)


def test_parallel_canary_promotes_rolls_back_and_records_a_failed_start(study) -> None:
    path, marker, _stable_port = study
    canary_port = free_port()
    db, store, journal = open_stores(load_config(path).state_dir)
    runtime, adapter = _runtime(path, canary_port, db)
    space = _space()
    infeasible = space.candidate(
        {"kv_cache_memory_bytes": TOO_SMALL_KV_BYTES, "max_num_seqs": MAX_SEQS}
    )
    bad = space.candidate({"kv_cache_memory_bytes": BAD_KV_BYTES, "max_num_seqs": MAX_SEQS})
    good = space.candidate({"kv_cache_memory_bytes": GOOD_KV_BYTES, "max_num_seqs": MAX_SEQS})
    suggester = ListSuggester([infeasible, bad, good])
    # What the stable instance looked like when each trial that must not touch it ended.
    seen: dict[int, dict[str, object]] = {}
    pinned: dict[str, set[int]] = {}

    def on_progress(p: Progress) -> None:
        print(f"trial {p.trial_number} {dict(p.values)} -> {p.phase.value}", flush=True)
        stable = next(i for i in runtime.instances() if i.name == "vllm")
        if p.phase is Phase.OBSERVING and not pinned:
            pinned["stable"] = _affinity(sorted(stable.pids))
            pinned["canary"] = _affinity(_servers_on(canary_port))
        if p.phase in (Phase.INFEASIBLE, Phase.ROLLED_BACK):
            seen[p.trial_number] = {
                "pid": stable.main_pid,
                "argv": tuple(stable.argv),
                "serving": _health(stable.url),
                "canaries": _servers_on(canary_port),
            }

    async def scenario():
        stable = await runtime.start("vllm", ready_timeout_s=READY_TIMEOUT_S)
        session = _session(space, suggester, store, journal, adapter, marker, on_progress)
        try:
            return stable, await session.run(3)
        finally:
            await adapter.stop_canary()

    try:
        stable, summary = asyncio.run(scenario())
        _print_outcomes(summary)
        configured = tuple(stable.argv)
        first, second, third = summary.outcomes
        assert pinned == {"stable": set(STABLE_CPUS), "canary": set(CANARY_CPUS)}

        # 1. The candidate that cannot hold one request: infeasible with vLLM's reason.
        assert first.record.phase is Phase.INFEASIBLE
        assert first.trial.state is TrialState.INFEASIBLE
        failure = first.trial.result.startup_failure
        assert failure is not None and failure.kind is StartupFailureKind.CACHE_TOO_SMALL
        assert "max seq len" in (failure.log_line or ""), failure
        assert seen[first.trial.number] == {
            "pid": stable.main_pid,
            "argv": configured,
            "serving": True,
            "canaries": [],
        }

        # 2. Less KV than the poor stable instance: judged a fail, rolled back.
        assert second.record.phase is Phase.ROLLED_BACK, second.record.reason
        assert second.trial.judgement is not None
        assert second.trial.judgement.classification is Classification.FAIL, second.record.reason
        assert seen[second.trial.number] == {
            "pid": stable.main_pid,
            "argv": configured,
            "serving": True,
            "canaries": [],
        }

        # 3. Eight times the KV budget: promoted.
        _check_promoted(third, runtime, db, stable.main_pid)
        assert _servers_on(canary_port) == []
        states = [t.state for t in store.trials()]
        # The bad candidate ran, yet preempts far beyond the SLO's limit: infeasible too.
        assert states == [TrialState.INFEASIBLE, TrialState.INFEASIBLE, TrialState.COMPLETE]
        assert second.trial.result is not None
        assert second.trial.result.outcome is TrialOutcome.PREEMPTED, second.trial.result.reason
    finally:
        asyncio.run(runtime.aclose(drain_timeout_s=5.0))
        db.close()
        kill_servers_of(marker)


def test_sequential_canary_switches_the_one_instance_and_promotes(study) -> None:
    path, marker, _stable_port = study
    canary_port = free_port()
    db, store, journal = open_stores(load_config(path).state_dir)
    runtime, adapter = _runtime(path, canary_port, db)
    space = _space()
    good = space.candidate({"kv_cache_memory_bytes": GOOD_KV_BYTES, "max_num_seqs": MAX_SEQS})
    phases: list[Phase] = []

    def on_progress(p: Progress) -> None:
        print(f"trial {p.trial_number} {dict(p.values)} -> {p.phase.value}", flush=True)
        phases.append(p.phase)
        assert _servers_on(canary_port) == []  # one instance only, never a second one

    async def scenario():
        stable = await runtime.start("vllm", ready_timeout_s=READY_TIMEOUT_S)
        session = _session(
            space,
            ListSuggester([good]),
            store,
            journal,
            adapter,
            marker,
            on_progress,
            strategy=Strategy.SEQUENTIAL,
        )
        return stable, await session.run(1)

    try:
        stable, summary = asyncio.run(scenario())
        _print_outcomes(summary)
        (outcome,) = summary.outcomes
        assert outcome.record.strategy is Strategy.SEQUENTIAL
        assert Phase.OBSERVING_BASELINE in phases
        assert phases.index(Phase.OBSERVING_BASELINE) < phases.index(Phase.STARTING)
        # A-B-A: back to the stable flags and observed again before the promotion's restart.
        returned = phases.index(Phase.RETURNING)
        assert returned < phases.index(Phase.OBSERVING_BASELINE_AFTER)
        assert phases.index(Phase.OBSERVING_BASELINE_AFTER) < phases.index(Phase.PROMOTING)
        _check_promoted(outcome, runtime, db, stable.main_pid)
    finally:
        asyncio.run(runtime.aclose(drain_timeout_s=5.0))
        db.close()
        kill_servers_of(marker)


def _session(
    space,
    suggester,
    store,
    journal,
    adapter,
    marker,
    on_progress,
    *,
    strategy: Strategy = Strategy.PARALLEL,
) -> TuningSession:
    return TuningSession(
        space=space,
        suggester=suggester,
        store=store,
        journal=journal,
        runtime=adapter,
        observer=LoadObserver(WORKLOAD, model=marker, scrape_interval_s=SCRAPE_INTERVAL_S),
        fingerprint="e2e",
        settings=RIG,
        strategy=strategy,
        wall_clock=time.time,
        on_progress=on_progress,
    )


def test_killed_mid_canary_is_recovered_by_trials(study) -> None:
    path, marker, stable_port = study
    canary_port = free_port()
    log = path.parent / "tune.log"
    argv = [
        sys.executable,
        "-m",
        "kvpilot.agent",
        "tune",
        "--config",
        str(path),
        "--trials",
        "1",
        "--canary-port",
        str(canary_port),
        "--kv-max-bytes",
        str(GOOD_KV_BYTES),
        "--max-seqs",
        str(MAX_SEQS),
        "--requests",
        str(REQUESTS),
        "--concurrency",
        str(CONCURRENCY),
        "--canary-cpus",
        ",".join(map(str, CANARY_CPUS)),
    ]
    with log.open("ab") as out:
        tune = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, "COLUMNS": "200"},
        )
    try:
        cfg = load_config(path)
        _, _, journal = open_stores(cfg.state_dir)

        def observing() -> bool:
            assert tune.poll() is None, log.read_text(errors="replace")[-3000:]
            return any(r.phase is Phase.OBSERVING for r in journal.open_records())

        wait_for("the canary under load", observing, 2 * READY_TIMEOUT_S, poll_s=0.25)
        stable_pids = _servers_on(stable_port)
        assert len(stable_pids) == 1 and _servers_on(canary_port)
        os.kill(tune.pid, signal.SIGKILL)
        tune.wait(timeout=10)

        shown = subprocess.run(
            [
                sys.executable,
                "-m",
                "kvpilot.agent",
                "trials",
                "--config",
                str(path),
                "--canary-port",
                str(canary_port),
            ],
            capture_output=True,
            text=True,
            timeout=180,
            env={**os.environ, "COLUMNS": "200"},
        )
        assert shown.returncode == 0, shown.stdout + shown.stderr
        print(shown.stdout)
        assert _servers_on(canary_port) == []
        assert _servers_on(stable_port) == stable_pids
        assert _health(f"http://127.0.0.1:{stable_port}")
        (record,) = journal.records()
        assert record.phase is Phase.ABORTED and "observing" in (record.reason or "")
        _, store, _ = open_stores(cfg.state_dir)
        (trial,) = store.trials()
        assert trial.state is TrialState.ABORTED
        assert "aborted" in shown.stdout.lower()
        # The stable instance still serves the configured flags.
        (info,) = find_vllm_mains(list_processes(), port=stable_port)
        assert info.argv == tuple(cfg.runtime.instances[0].argv)

        # The next run of the same study (same model, flags, workload and SLO) goes on from
        # its history: its trial is number 2.
        again = subprocess.run(
            [*argv, "--no-bake"],
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, "COLUMNS": "200"},
        )
        assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
        print(again.stdout[-2000:])
        assert "recovered trial" not in again.stdout  # nothing was left to recover
        first, second = sorted(store.trials(), key=lambda t: t.number)
        assert (first.number, first.state) == (1, TrialState.ABORTED)
        assert second.number == 2 and second.state in (
            TrialState.COMPLETE,
            TrialState.INFEASIBLE,
        ), second
        assert _servers_on(canary_port) == []
        # The stable server the killed run started was that run's: the next run names it as
        # such and stops it at its end, so no run leaves a server behind.
        assert "a killed kvpilot tune left running is this run's" in again.stdout
        assert f"stopped the stable server {cfg.runtime.instances[0].name!r}" in again.stdout
        assert _servers_on(stable_port) == []
    finally:
        if tune.poll() is None:
            os.killpg(tune.pid, signal.SIGKILL)
            tune.wait(timeout=10)
        kill_servers_of(marker)
