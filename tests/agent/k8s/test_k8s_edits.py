"""A person's edit of the stable Deployment during a trial wins: the promotion is refused,
the trial fails saying so, and the Deployment stays as the person left it; a controller's
status update (a new resourceVersion, the same generation) is no edit. Against the fake API
server (a fake: no API server runs here) and a stand-in vLLM."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import pytest

from kvpilot.agent.runtimes.kubernetes.edits import EditedMeanwhile
from kvpilot.agent.tuning.pod.adapter import KubernetesTunerAdapter
from kvpilot.collectors.vllm_argv import flag_value
from kvpilot.tuner.trials import TrialState
from tests.agent.k8s.conftest import NAMESPACE, base_deployment, make_runtime
from tests.agent.k8s.test_k8s_tuning import CANARY, DeploymentObserver, session, stable_args

NEW_IMAGE = "vllm/vllm-openai:v0.99.0"


class MeanwhileObserver(DeploymentObserver):
    """The scripted windows; `meanwhile` happens while the canary is observed."""

    def __init__(self, fake, meanwhile: Callable[[], None]) -> None:
        super().__init__(fake)
        self.meanwhile = meanwhile

    async def observe(self, urls: Sequence[str], *, prompts: str | None = None):
        if len(urls) > 1:
            self.meanwhile()
        return await super().observe(urls)


def run_trial(fake, standin, tmp_path, meanwhile: Callable[[], None]):
    runtime = make_runtime(fake, standin.port, tmp_path, promote="apply")
    adapter = KubernetesTunerAdapter(runtime, drain_timeout_s=5)
    run, store = session(adapter, fake)
    run._observer = MeanwhileObserver(fake, meanwhile)
    return run, store


def image(fake) -> str:
    return fake.deployment(NAMESPACE, "vllm")["spec"]["template"]["spec"]["containers"][0]["image"]


def test_an_edit_during_the_trial_wins_over_the_promotion(fake, standin, tmp_path) -> None:
    fake.add_deployment(base_deployment(standin.port))
    before = stable_args(fake)

    def edit(spec: dict) -> None:
        spec["template"]["spec"]["containers"][0]["image"] = NEW_IMAGE

    run, store = run_trial(
        fake, standin, tmp_path, lambda: fake.edit_deployment(NAMESPACE, "vllm", edit)
    )

    with pytest.raises(EditedMeanwhile, match="changed by someone else during the trial"):
        asyncio.run(run.run(1))

    assert image(fake) == NEW_IMAGE and stable_args(fake) == before  # as the person left it
    assert fake.writes("PATCH") == []
    (trial,) = store.trials()
    assert trial.state is TrialState.COMPLETE  # measured; its rollout failed, saying why
    assert fake.deployment(NAMESPACE, CANARY) is None


def test_a_status_update_during_the_trial_is_no_edit(fake, standin, tmp_path) -> None:
    fake.add_deployment(base_deployment(standin.port))

    run, _ = run_trial(fake, standin, tmp_path, lambda: fake.update_status(NAMESPACE, "vllm"))

    (outcome,) = asyncio.run(run.run(1)).outcomes

    assert outcome.record.phase.value == "promoted", outcome.record.reason
    assert flag_value(tuple(stable_args(fake)), "--max-num-seqs") == "8"
