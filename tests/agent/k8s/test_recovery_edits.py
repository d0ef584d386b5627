"""Recovery leaves a person's change: a trial interrupted while reverting would have its old
flags restored, but the Deployment was edited since (a flag no knob tunes), so the restore is
not made and says why. Against the fake API server (a fake: no API server runs here)."""

from __future__ import annotations

import asyncio

from kvpilot.tuner.rollout.canary import Phase
from tests.agent.k8s.conftest import NAMESPACE
from tests.agent.k8s.test_k8s_tuning import stable_args
from tests.agent.k8s.test_pod_handover import handed_over_record
from tests.agent.k8s.test_pod_handover_configmap import pod_tuner

EDITED = "--max-model-len=1024"  # a person's change, no knob of the study


def recover(fake, standin, tmp_path):
    tuner, db = pod_tuner(fake, tmp_path / "a" / "state", standin.port, "pod-a")

    async def run():
        study = await tuner.study()
        assert "--max-num-seqs" in [k.flag for k in study.space.knobs]
        async with tuner.lease():
            return await tuner.recover(study)

    done = asyncio.run(run())
    db.close()
    return done


def test_recovery_does_not_restore_over_a_persons_edit(fake, standin, tmp_path) -> None:
    seeded, _, _, _, new = handed_over_record(fake, standin, tmp_path / "a", phase=Phase.REVERTING)
    seeded.close()

    def edit(spec: dict) -> None:
        spec["template"]["spec"]["containers"][0]["args"].append(EDITED)

    fake.edit_deployment(NAMESPACE, "vllm", edit)

    done = recover(fake, standin, tmp_path)

    assert stable_args(fake) == [*new, EDITED]  # as the person left it
    assert fake.writes("PATCH") == []
    (kept,) = done.kept
    assert "changed meanwhile" in kept and EDITED.split("=")[0] in kept


def test_recovery_restores_what_only_the_trial_changed(fake, standin, tmp_path) -> None:
    seeded, _, _, old, _ = handed_over_record(fake, standin, tmp_path / "a", phase=Phase.REVERTING)
    seeded.close()

    done = recover(fake, standin, tmp_path)

    assert stable_args(fake) == old and done.kept == ()
