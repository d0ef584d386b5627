"""A promotion outlives the pod that promoted it: the stopping sidecar hands the rollout over
(its journal keeps `baking`, nothing reverts the patch), and a fresh runtime over the same
state directory (the PersistentVolumeClaim) resumes the bake. Against the fake API server (a
fake: no API server runs here) and a stand-in vLLM; the windows are scripted."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence

from kvpilot.agent.state.db import Database
from kvpilot.agent.state.trials import SqliteRolloutJournal, SqliteTrialStore
from kvpilot.agent.tuning.handover import HandoverJournal, HandoverRuntime, resume_handed_over
from kvpilot.agent.tuning.pod.adapter import KubernetesTunerAdapter
from kvpilot.collectors.vllm_argv import flag_value
from kvpilot.tuner.problem.objective import evaluate
from kvpilot.tuner.rollout.canary import Phase, RolloutRecord, RolloutSettings, Strategy, recover
from kvpilot.tuner.rollout.ports import Observation
from kvpilot.tuner.session import TuningSession
from kvpilot.tuner.suggest import GridSuggester
from kvpilot.tuner.trials import TrialState, new_trial
from tests.agent.k8s.conftest import base_deployment, make_runtime
from tests.agent.k8s.test_k8s_tuning import SPACE, stable_args
from tests.tuner.rollout.test_canary import SLO, window

SETTINGS = RolloutSettings(slo=SLO, ready_timeout_s=10)


class Windows:
    """Scripted windows: the judging window favours the canary; the bake window's scale is
    `bake_scale`, and with `hold_bake` the bake window waits until the test cancels it."""

    def __init__(self, bake_scale: float = 0.5, hold_bake: bool = False) -> None:
        self.bake_scale = bake_scale
        self.hold_bake = hold_bake
        self.baking = asyncio.Event() if hold_bake else None
        self.bakes = 0

    async def warm(self, urls: Sequence[str]) -> None:
        return None

    async def observe(
        self, urls: Sequence[str], *, prompts: str | None = None
    ) -> tuple[Observation, ...]:
        if len(urls) == 2:
            return window(1.0), window(0.5)
        self.bakes += 1
        if self.baking is not None:
            self.baking.set()
            await asyncio.Event().wait()  # until cancelled: the pod is being replaced
        return (window(self.bake_scale),)


def stores(tmp_path):
    db = Database.open(tmp_path / "state")
    return db, SqliteTrialStore(db), SqliteRolloutJournal(db)


def promoted_deployment(port: int, candidate_args: list[str]) -> dict:
    body = base_deployment(port)
    body["spec"]["template"]["spec"]["containers"][0]["args"] = candidate_args
    return body


def handed_over_record(fake, standin, tmp_path, *, phase: Phase):
    """A trial whose promotion patch is live, its record left in `phase` by a stopped pod."""
    old = base_deployment(standin.port)["spec"]["template"]["spec"]["containers"][0]["args"]
    new = [*old, "--max-num-seqs=8"]
    fake.add_deployment(promoted_deployment(standin.port, new))
    command = ["python3", "-m", "vllm.entrypoints.openai.api_server"]
    db, store, journal = stores(tmp_path)
    trial = new_trial("t1", "k8s", 1, {"max_num_seqs": 8}, 100.0)
    trial = trial.to(TrialState.RUNNING, at_wall_s=101.0).to(
        TrialState.COMPLETE, at_wall_s=102.0, result=evaluate(window(0.5).measurement, SLO)
    )
    store.add(trial)
    journal.save(
        RolloutRecord("t1", Strategy.PARALLEL, phase, (*command, *old), (*command, *new), 103.0)
    )
    return db, store, journal, old, new


def resume(fake, standin, tmp_path, store, journal, observer):
    runtime = make_runtime(fake, standin.port, tmp_path, promote="apply")  # the new pod's
    adapter = KubernetesTunerAdapter(runtime, drain_timeout_s=5)
    clock = itertools.count(200.0)
    return asyncio.run(
        resume_handed_over(
            journal, store, adapter, observer, SETTINGS, wall_clock=lambda: float(next(clock))
        )
    )


def test_a_handed_over_bake_that_holds_ends_promoted(fake, standin, tmp_path) -> None:
    db, store, journal, _, new = handed_over_record(fake, standin, tmp_path, phase=Phase.BAKING)
    observer = Windows(bake_scale=0.5)

    (done,) = resume(fake, standin, tmp_path, store, journal, observer)

    assert (done.was, done.now) == (Phase.BAKING, Phase.PROMOTED)
    assert observer.bakes == 1  # the bake window was watched here
    record = journal.get("t1")
    assert record.phase is Phase.PROMOTED and "resumed in a new pod" in record.reason
    assert record.bake_goodput_tokens_per_s is not None
    assert stable_args(fake) == new and fake.writes("PATCH") == []
    db.close()


def test_a_handed_over_bake_that_degrades_reverts_the_deployment(fake, standin, tmp_path) -> None:
    db, store, journal, old, _ = handed_over_record(fake, standin, tmp_path, phase=Phase.PROMOTING)

    (done,) = resume(fake, standin, tmp_path, store, journal, Windows(bake_scale=3.0))

    assert (done.was, done.now) == (Phase.PROMOTING, Phase.REVERTED)
    assert journal.get("t1").phase is Phase.REVERTED
    assert stable_args(fake) == old  # patched back
    db.close()


def test_a_promotion_that_never_went_live_is_left_to_recovery(fake, standin, tmp_path) -> None:
    db, store, journal, old, _ = handed_over_record(fake, standin, tmp_path, phase=Phase.PROMOTING)
    fake.add_deployment(base_deployment(standin.port))  # the patch never landed
    runtime = make_runtime(fake, standin.port, tmp_path, promote="apply")
    adapter = KubernetesTunerAdapter(runtime, drain_timeout_s=5)

    assert resume(fake, standin, tmp_path, store, journal, Windows()) == []
    asyncio.run(recover(journal, store, adapter, at_wall_s=300.0))

    assert journal.get("t1").phase is Phase.ABORTED
    assert stable_args(fake) == old and fake.writes("PATCH") == []
    db.close()


def test_a_pod_replaced_while_baking_hands_over_and_the_next_pod_bakes(
    fake, standin, tmp_path
) -> None:
    fake.add_deployment(base_deployment(standin.port))
    before = stable_args(fake)
    db, store, sqlite_journal = stores(tmp_path)
    journal = HandoverJournal(sqlite_journal)
    adapter = KubernetesTunerAdapter(
        make_runtime(fake, standin.port, tmp_path, promote="apply"), drain_timeout_s=5
    )
    observer = Windows(hold_bake=True)
    clock, ids = itertools.count(100.0), (f"t{i}" for i in itertools.count(1))
    session = TuningSession(
        space=SPACE,
        suggester=GridSuggester(SPACE),
        store=store,
        journal=journal,
        runtime=HandoverRuntime(adapter, journal),
        observer=observer,
        fingerprint="k8s",
        settings=SETTINGS,
        strategy=Strategy.PARALLEL,
        wall_clock=lambda: float(next(clock)),
        new_id=lambda: next(ids),
    )

    async def replaced_while_baking() -> None:
        run = asyncio.create_task(session.run(1))
        assert observer.baking is not None
        await asyncio.wait_for(observer.baking.wait(), 30)
        assert journal.hand_over() is not None  # kvpilot is stopping
        run.cancel()
        await asyncio.gather(run, return_exceptions=True)

    asyncio.run(replaced_while_baking())

    promoted = stable_args(fake)
    assert promoted != before and flag_value(tuple(promoted), "--max-num-seqs") == "8"
    (left,) = sqlite_journal.open_records()  # kept for the next pod, not aborted
    assert left.phase is Phase.BAKING
    assert len(fake.writes("PATCH")) == 1  # the promotion only: nothing patched it back

    (done,) = resume(fake, standin, tmp_path, store, sqlite_journal, Windows(bake_scale=0.5))

    assert (done.was, done.now) == (Phase.BAKING, Phase.PROMOTED)
    assert stable_args(fake) == promoted and sqlite_journal.open_records() == []
    db.close()
