"""The ladder's promote step: a preemption spike promotes the tuner's best validated
configuration of this study (`agent.tuning.best`), or recommends it where the runtime cannot
change flags; without one, or with it already live, the ladder goes on as before.

The study is the real one of a configuration (the rig's tiny model, the planner's bounds);
trials and rollout records are written to a real state database as a tuning run leaves them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from pathlib import Path

import pytest

from kvpilot.agent.app.parts import server_of, tuned_server
from kvpilot.agent.config import AgentConfig, ProcessRuntimeConfig, load_config
from kvpilot.agent.model import Action, AlertFacts, Instance
from kvpilot.agent.remediation import TUNING_RECOMMENDED_ALERT, Remediator, Trigger, plan_for
from kvpilot.agent.runtimes import (
    LocalInstanceSpec,
    LocalRuntime,
    ProcessRuntime,
    ProcessTarget,
)
from kvpilot.agent.state import StateStore
from kvpilot.agent.state.db import Database
from kvpilot.agent.state.trials import SqliteRolloutJournal, SqliteTrialStore
from kvpilot.agent.tuning.best import BestConfig, config_studies, remember_promotion
from kvpilot.agent.tuning.promoted import PROMOTED_FACT, Why, live_argv
from kvpilot.agent.tuning.study import Study
from kvpilot.collectors.procfs import read_proc
from kvpilot.collectors.vllm_argv import canonical_flags, flag_value, set_flag, without_flags
from kvpilot.rig.server import free_port
from kvpilot.tuner.judge.judgement import Classification, Judgement
from kvpilot.tuner.problem.objective import TrialOutcome, TrialResult
from kvpilot.tuner.rollout.canary import Phase, RolloutRecord, Strategy
from kvpilot.tuner.trials import Trial, TrialState
from tests.agent.sidecar_harness import agent_config, server_spec
from tests.fakes.remediation_journal import MemoryJournal
from tests.fakes.standin_vllm_module import install

from .remediation_helpers import Harness, condition, make_instance, remediation_config, until

SPIKE = "preemption_spike"
FAST = remediation_config(cooldown_s=0.0, preflight={"enabled": False})
KV = 32 << 20


def _config(tmp_path: Path) -> AgentConfig:
    path = agent_config(
        tmp_path,
        spec=server_spec(),
        rules={},
        notifiers=[],
        remediation={},
        listen_port=free_port(),
    )
    return load_config(path)


def _configured(config: AgentConfig) -> tuple[str, ...]:
    return tuple(config.runtime.instances[0].argv)  # type: ignore[union-attr]


def _study(config: AgentConfig) -> Study:
    study = config_studies(config.tuning, server_of(config))("vllm", _configured(config))
    assert isinstance(study, Study), study
    return study


def _trial(
    db: Database,
    study: Study,
    number: int,
    *,
    seqs: int,
    goodput: float,
    phase: Phase = Phase.PROMOTED,
    verdict: Classification = Classification.PASS,
    fingerprint: str | None = None,
) -> None:
    """A finished trial and its rollout record, as a tuning run leaves them."""
    trial_id = f"t{number}"
    values = (("kv_cache_memory_bytes", KV), ("max_num_seqs", seqs))
    trial = Trial(
        trial_id,
        fingerprint or study.fingerprint,
        number,
        values,
        TrialState.COMPLETE,
        1.0,
        2.0,
        result=TrialResult(TrialOutcome.FEASIBLE, goodput, KV, None),
        judgement=Judgement(verdict, 1.0, (), "from the test"),
    )
    SqliteTrialStore(db).add(trial)
    stable = study.configured_argv
    candidate = set_flag(stable, "--max-num-seqs", seqs)
    SqliteRolloutJournal(db).save(
        RolloutRecord(trial_id, Strategy.PARALLEL, phase, stable, candidate, 2.0)
    )


def _source(db: Database, config: AgentConfig, *instances: Instance) -> BestConfig:
    return BestConfig(
        db, lambda: tuple(instances), config_studies(config.tuning, server_of(config))
    )


def _instance(config: AgentConfig, argv: tuple[str, ...] | None = None) -> Instance:
    return dataclasses.replace(make_instance("vllm"), argv=argv or _configured(config))


@pytest.fixture
def db(tmp_path: Path) -> Database:
    return Database.open(tmp_path / "state")


def test_the_best_trial_judged_pass_and_promoted_is_the_one(tmp_path: Path, db: Database) -> None:
    config = _config(tmp_path)
    study = _study(config)
    _trial(db, study, 1, seqs=8, goodput=100.0)
    _trial(db, study, 2, seqs=16, goodput=150.0)
    _trial(db, study, 3, seqs=32, goodput=500.0, phase=Phase.ROLLED_BACK)
    _trial(db, study, 4, seqs=24, goodput=400.0, phase=Phase.REVERTED)  # the bake failed it
    _trial(db, study, 5, seqs=40, goodput=450.0, verdict=Classification.MARGINAL)
    _trial(db, study, 6, seqs=48, goodput=900.0, fingerprint="another-study")
    better = _source(db, config, _instance(config))("vllm")
    assert better is not None
    assert flag_value(better, "--max-num-seqs") == "16"
    assert flag_value(better, "--kv-cache-memory-bytes") == str(KV)
    # Every other flag is the instance's own.
    rest = [
        f
        for f in canonical_flags(better)
        if f[0] not in ("--max-num-seqs", "--kv-cache-memory-bytes")
    ]
    assert rest == [
        f
        for f in canonical_flags(_configured(config))
        if f[0] not in ("--max-num-seqs", "--kv-cache-memory-bytes")
    ]


def test_a_spike_promotes_the_best_configuration_instead_of_restarting(
    tmp_path: Path, db: Database
) -> None:
    config = _config(tmp_path)
    _trial(db, _study(config), 1, seqs=16, goodput=150.0)
    source = _source(db, config, _instance(config))

    async def main() -> None:
        h = Harness(FAST, instances=[_instance(config)], better_config=source)
        (task,) = h.tick(condition(SPIKE, "vllm", action="ladder", capacity_leak=False))
        await until(lambda: bool(h.runtime.restarts), "the promotion")
        h.tick(condition(SPIKE, "vllm", action="ladder", active=False))
        outcome = await task
        assert outcome.decision == "succeeded", outcome
        assert outcome.steps == ("promote",)
        ((name, argv, _, _),) = h.runtime.restarts
        assert name == "vllm" and argv is not None
        assert flag_value(argv, "--max-num-seqs") == "16"
        assert h.journal.records[1].action == "promote"
        (planned,) = [a for a in h.journal.audit if a.decision == "planned"]
        # The plan names what changes.
        assert f"--kv-cache-memory-bytes {KV} (was 67108864), --max-num-seqs 16" in planned.reason

    asyncio.run(main())


@pytest.mark.parametrize("what", ["nothing validated", "already live"])
def test_without_a_better_configuration_the_ladder_goes_on_as_before(
    tmp_path: Path, db: Database, what: str
) -> None:
    config = _config(tmp_path)
    study = _study(config)
    _trial(db, study, 1, seqs=16, goodput=150.0, phase=Phase.ROLLED_BACK)
    instance = _instance(config)
    if what == "already live":
        _trial(db, study, 2, seqs=8, goodput=120.0)
        rest = without_flags(_configured(config), ["--max-num-seqs", "--kv-cache-memory-bytes"])
        # The same flags in another spelling and place are the same configuration.
        live = (*rest[:3], "--max_num_seqs=8", f"--kv-cache-memory-bytes={KV}", *rest[3:])
        instance = _instance(config, live)
    source = _source(db, config, instance)

    async def main() -> None:
        advice = Harness(FAST, instances=[instance], better_config=source)
        (task,) = advice.tick(condition(SPIKE, "vllm", action="ladder", capacity_leak=False))
        outcome = await task
        # With a cap on the live command line the advice names a lower one; else a tuning run.
        advice_step = "recommend_config" if what == "already live" else "recommend_tuning"
        assert outcome.decision == "recommended" and outcome.steps == (advice_step,)
        assert advice.runtime.entered == 0
        leak = Harness(FAST, instances=[instance], better_config=source)
        (task,) = leak.tick(condition(SPIKE, "vllm", action="ladder", capacity_leak=True))
        await until(lambda: bool(leak.runtime.restarts), "the restart")
        leak.tick(condition(SPIKE, "vllm", action="ladder", active=False))
        assert (await task).decision == "succeeded"
        assert leak.runtime.restarts[0][1] is None  # the same flags

    asyncio.run(main())
    expected = "no trial of study" if what == "nothing validated" else "already runs"
    assert expected in (source.last_reason or "")
    assert source.misses_total == 2


def test_a_runtime_that_cannot_change_flags_recommends_the_configuration(
    tmp_path: Path, db: Database
) -> None:
    assert ProcessRuntime.can_change_flags is False and LocalRuntime.can_change_flags is True
    config = _config(tmp_path)
    _trial(db, _study(config), 1, seqs=16, goodput=150.0)

    async def main() -> None:
        h = Harness(
            FAST,
            instances=[_instance(config)],
            can_change_flags=False,
            better_config=_source(db, config, _instance(config)),
        )
        (task,) = h.tick(condition(SPIKE, "vllm", action="ladder", capacity_leak=True))
        outcome = await task
        assert outcome.decision == "recommended" and outcome.steps == ("recommend_config",)
        assert h.runtime.entered == 0 and not h.journal.records
        audited = [a for a in h.journal.audit if a.action == "recommend_config"]
        assert [a.decision for a in audited] == ["recommended"]
        assert "--max-num-seqs 16" in audited[0].reason
        (event,) = h.remediator.take_events()
        notes = dict(event.annotations)
        assert dict(event.labels)["alertname"] == TUNING_RECOMMENDED_ALERT
        assert "validated flags" in notes["summary"]
        assert "--max-num-seqs 16" in notes["recommended_flags"]

    asyncio.run(main())


def test_the_recommendation_masks_the_secrets_of_the_flags() -> None:
    argv = ("vllm", "serve", "m", "--api-key", "s3cret-key", "--max-num-seqs", "8")
    better = (*argv[:-1], "16")
    plan = plan_for(
        SPIKE,
        AlertFacts(Action.LADDER, False),
        "vllm",
        light_step_enabled=False,
        better_config=lambda _name: better,
        can_change_flags=False,
        current_argv=argv,
    )
    assert plan.steps == ("recommend_config",) and plan.argv == better
    assert "--max-num-seqs 16 (was 8)" in plan.reason and "s3cret" not in plan.reason


def test_the_process_runtime_studies_the_server_as_it_runs(tmp_path: Path) -> None:
    config = _config(tmp_path)
    process = config.model_copy(
        update={"runtime": ProcessRuntimeConfig(kind="process", name="vllm", port=8000)}
    )
    studied = config_studies(process.tuning, server_of(process))("vllm", _configured(config))
    assert isinstance(studied, Study)
    assert studied.fingerprint == _study(config).fingerprint
    assert "not one tuning can read" in str(
        config_studies(process.tuning, server_of(process))("vllm", ("sleep", "1"))
    )


def test_a_spike_promotes_through_the_real_local_runtime(tmp_path: Path) -> None:
    """A stand-in vLLM process under the local runtime is restarted with the new flags."""
    config = _config(tmp_path)
    db = Database.open(tmp_path / "db")
    _trial(db, _study(config), 1, seqs=16, goodput=150.0)
    env = {
        "PYTHONPATH": str(install(tmp_path / "standin")),
        "STANDIN_STARTS": str(tmp_path / "starts"),
        "STANDIN_TAG": str(tmp_path),
    }
    spec = LocalInstanceSpec("vllm", _configured(config), env=tuple(env.items()))
    runtime = LocalRuntime([spec], tmp_path / "logs")
    store = StateStore(db)
    remediator = Remediator(
        runtime,
        MemoryJournal(),
        FAST,
        better_config=BestConfig(
            db, runtime.instances, config_studies(config.tuning, server_of(config))
        ),
        on_promoted=remember_promotion(tuned_server(config), store, "sha-1"),
    )
    facts = AlertFacts(Action.LADDER, capacity_leak=False)

    async def main() -> None:
        try:
            first = await runtime.start("vllm", ready_timeout_s=30)
            trigger = Trigger("vllm", SPIKE, None, "inc-1", facts=facts)
            outcome = await remediator.remediate(trigger)
            assert outcome.decision == "succeeded", outcome
            assert outcome.steps == ("promote",) and outcome.new_pid != first.main_pid
            (now,) = runtime.instances()
            assert flag_value(now.argv or (), "--max-num-seqs") == "16"
            assert now.main_pid is not None
            running = read_proc(now.main_pid)
            assert running is not None and flag_value(running.argv, "--max-num-seqs") == "16"
            assert (tmp_path / "starts").read_text() == "2"
            # Noted as the promoted flags: the next start under this YAML runs them.
            live = live_argv(_configured(config), store.get_fact(PROMOTED_FACT), "sha-1")
            assert live.why is Why.PROMOTED and live.argv == now.argv
        finally:
            await runtime.aclose(drain_timeout_s=5)

    asyncio.run(main())
    assert not [p for p in os.listdir("/proc") if p.isdigit() and _tagged(p, str(tmp_path))]


def test_the_process_runtime_recommends_the_configuration_of_the_server_it_finds(
    tmp_path: Path,
) -> None:
    """A stand-in vLLM kvpilot did not start: its study comes from the argv it runs, and the
    spike records a recommendation naming the flags; the server is not touched."""
    config = _config(tmp_path)
    db = Database.open(tmp_path / "db")
    _trial(db, _study(config), 1, seqs=16, goodput=150.0)
    port = int(flag_value(_configured(config), "--port") or 0)
    env = {
        "PYTHONPATH": str(install(tmp_path / "standin")),
        "STANDIN_STARTS": str(tmp_path / "starts"),
        "STANDIN_TAG": str(tmp_path),
    }
    elsewhere = LocalRuntime(  # starts the server; the agent under test only finds it
        [LocalInstanceSpec("vllm", _configured(config), env=tuple(env.items()))], tmp_path / "l"
    )
    process = ProcessRuntime([ProcessTarget("vllm", port=port)])
    process_config = config.model_copy(
        update={"runtime": ProcessRuntimeConfig(kind="process", name="vllm", port=port)}
    )
    journal = MemoryJournal()
    remediator = Remediator(
        process,
        journal,
        FAST,
        better_config=BestConfig(
            db,
            process.instances,
            config_studies(process_config.tuning, server_of(process_config)),
        ),
    )
    facts = AlertFacts(Action.LADDER, capacity_leak=True)  # a restart, were there no tuning

    async def main() -> None:
        try:
            started = await elsewhere.start("vllm", ready_timeout_s=30)
            (found,) = process.instances()
            assert found.main_pid == started.main_pid
            trigger = Trigger("vllm", SPIKE, None, "inc-1", facts=facts)
            outcome = await remediator.remediate(trigger)
            assert outcome.decision == "recommended", outcome
            assert outcome.steps == ("recommend_config",)
            (event,) = remediator.take_events()
            assert "--max-num-seqs 16" in dict(event.annotations)["recommended_flags"]
            (audited,) = [a for a in journal.audit if a.action == "recommend_config"]
            assert audited.decision == "recommended" and "--max-num-seqs 16" in audited.reason
            assert process.instances()[0].main_pid == started.main_pid  # untouched
            assert (tmp_path / "starts").read_text() == "1"
        finally:
            await elsewhere.aclose(drain_timeout_s=5)

    asyncio.run(main())


def _tagged(pid: str, tag: str) -> bool:
    try:
        return tag in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False
