"""A trial the cluster fails (its canary cannot be scheduled, its image not pulled, the API
server refuses the promotion) fails as the cluster's failure: recorded and reported, never
told to the optimiser as an infeasible configuration. Against the fake API server (a fake:
no API server runs here) and a stand-in vLLM."""

from __future__ import annotations

import asyncio

import pytest

from kvpilot.agent.runtimes.kubernetes.api import InfrastructureFailure
from kvpilot.agent.tuning.pod.adapter import KubernetesTunerAdapter
from kvpilot.tuner.rollout.canary import Strategy
from kvpilot.tuner.trials import TrialState, history
from tests.agent.k8s.conftest import NAMESPACE, base_deployment, make_runtime
from tests.agent.k8s.test_k8s_tuning import CANARY, session, stable_args


def failed_trial(fake, standin, tmp_path, says: str, **settings):
    runtime = make_runtime(fake, standin.port, tmp_path, promote="apply")
    adapter = KubernetesTunerAdapter(runtime, drain_timeout_s=5)
    run, store = session(adapter, fake, ready_timeout_s=1, **settings)

    with pytest.raises(InfrastructureFailure, match=says):
        asyncio.run(run.run(1))

    (trial,) = store.trials()
    assert trial.state is TrialState.FAILED and trial.result is None, trial
    assert says.split(" ")[0] in (trial.reason or "")
    assert history(store, "k8s") == []  # nothing for the optimiser to learn
    assert fake.deployment(NAMESPACE, CANARY) is None  # cleaned up all the same
    return trial


@pytest.mark.parametrize(
    ("fault", "says"),
    [
        ("crash", "ImagePullBackOff"),
        ("unschedulable", "unschedulable: 0/3 nodes are available"),
    ],
)
def test_a_canary_the_cluster_cannot_run_fails_the_trial_not_the_flags(
    fake, standin, tmp_path, fault, says
) -> None:
    fake.add_deployment(base_deployment(standin.port))
    if fault == "crash":
        fake.crash["canary"] = ("ImagePullBackOff", "")
    else:
        fake.unschedulable["canary"] = "0/3 nodes are available: 3 Insufficient nvidia.com/gpu"
    before = stable_args(fake)

    failed_trial(fake, standin, tmp_path, says)

    assert stable_args(fake) == before


def test_a_switch_the_api_server_fails_is_not_an_infeasible_candidate(
    fake, standin, tmp_path
) -> None:
    """Sequential: the stable itself takes the candidate's flags; the patch fails (500)."""
    fake.add_deployment(base_deployment(standin.port))
    fake.fail("PATCH", r"/deployments/vllm$", 500, times=3)
    before = stable_args(fake)

    trial = failed_trial(
        fake, standin, tmp_path, "the Kubernetes API failed the trial", strategy=Strategy.SEQUENTIAL
    )

    assert "HTTP 500" in (trial.reason or "")
    assert stable_args(fake) == before
