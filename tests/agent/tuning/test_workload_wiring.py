"""`kvpilot run` replays what its window learned: the choice for the tuned instance, the
ladder's lookup of validated trials (which must build the study tuning recorded under), and
the retune watch's workload key all follow the same learned workload."""

from __future__ import annotations

from pathlib import Path

from kvpilot.agent.app.parts import server_of, tuned_server
from kvpilot.agent.config import AgentConfig, load_config
from kvpilot.agent.tuning.best import config_studies
from kvpilot.agent.tuning.study import Study, build_study
from kvpilot.agent.tuning.workload.choice import WorkloadChoice, window_choice
from kvpilot.agent.tuning.workload.window import WorkloadWindow
from kvpilot.rig.server import free_port
from kvpilot.tuner.load.learned import WorkloadShape
from tests.agent.sidecar_harness import agent_config, server_spec
from tests.agent.tuning.workload_scrapes import served


def _shape(requests: int, prompt: int = 300) -> WorkloadShape | None:
    window = WorkloadWindow(3600)
    window.observe(served(0, at_s=0.0, prompt=prompt))
    window.observe(served(requests, at_s=requests / 2.0, prompt=prompt))
    return window.shape()


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


def test_the_window_choice_learns_past_the_floor_and_says_why_below_it(tmp_path: Path) -> None:
    config = _config(tmp_path)
    empty = window_choice(config.tuning, tuned_server(config), None)
    assert empty is not None and empty.source == "configured" and empty.key is None
    assert "no finished request yet" in empty.reason
    few = window_choice(config.tuning, tuned_server(config), _shape(50))
    assert few is not None and few.source == "configured" and "below the floor" in few.reason
    full = window_choice(config.tuning, tuned_server(config), _shape(400))
    assert full is not None and full.source == "learned" and full.key is not None


def test_the_ladders_lookup_builds_the_learned_study_tuning_recorded_under(
    tmp_path: Path,
) -> None:
    """Trials of a learned run are recorded under `learned:<key>`; a lookup that built the
    configured study would never find them, and the ladder would never promote."""
    config = _config(tmp_path)
    argv = tuple(config.runtime.instances[0].argv)
    now: list[WorkloadChoice | None] = [
        window_choice(config.tuning, tuned_server(config), _shape(400))
    ]
    recorded = build_study(tuned_server(config), config.tuning, None, chosen=now[0])
    studies = config_studies(config.tuning, server_of(config), workload_of=lambda: now[0])
    looked_up = studies("vllm", argv)
    assert isinstance(looked_up, Study) and looked_up.fingerprint == recorded.fingerprint
    assert looked_up.choice is not None and looked_up.choice.source == "learned"
    now[0] = window_choice(
        config.tuning, tuned_server(config), _shape(400, prompt=1800)
    )  # the traffic really moved
    moved = studies("vllm", argv)
    assert isinstance(moved, Study) and moved.fingerprint != recorded.fingerprint
    now[0] = None  # nothing to say: the default (configured) study
    default = studies("vllm", argv)
    assert isinstance(default, Study)
    assert default.fingerprint == build_study(tuned_server(config), config.tuning, None).fingerprint
