"""The operator's commands (`kvpilot status`, `alerts`, `silence`, `veto`, `breaker`,
`remediations`) against a real agent app served over HTTP on loopback."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner, Result

from kvpilot.agent.cli.agent_client import AgentAddress, AgentClient, AgentError
from kvpilot.agent.cli.main import app
from kvpilot.agent.model import Condition, labels_of
from kvpilot.agent.tick.sidecar import Sidecar
from tests.agent.cli.served_agent import TOKEN, ServedAgent


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedAgent]:
    with ServedAgent(tmp_path_factory.mktemp("agent") / "state") as served:
        served.on_loop(_raise_an_alert)
        yield served


@pytest.fixture(scope="module")
def token_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("secret") / "token"
    path.write_text(TOKEN + "\n")
    return path


def _raise_an_alert(sidecar: Sidecar) -> None:
    labels = labels_of({"alertname": "VllmKvCacheSaturated", "instance": "vllm"})
    condition = Condition("VllmKvCacheSaturated", labels, active=True, value=0.97, summary="s")
    sidecar.alerts.tracker.update([condition], now_s=100.0, now_wall_s=1.7e9)


def kvpilot(*args: str) -> Result:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPILOT_")}
    return CliRunner().invoke(app, list(args), env={**env, "COLUMNS": "200"})


def _json(result: Result) -> Any:
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_version_is_the_packages() -> None:
    from importlib.metadata import version

    result = kvpilot("--version")
    assert result.exit_code == 0 and result.stdout.strip() == f"kvpilot {version('kvpilot')}"


def test_status_and_alerts_show_the_agents_servers_and_alerts(agent: ServedAgent) -> None:
    body = _json(kvpilot("status", "--url", agent.url, "--json"))
    assert [t["name"] for t in body["targets"]] == ["vllm"]
    table = kvpilot("status", "--url", agent.url)
    assert table.exit_code == 0, table.output
    assert "vllm" in table.stdout and "VllmKvCacheSaturated" in table.stdout
    alerts = _json(kvpilot("alerts", "--url", agent.url, "--json"))["alerts"]
    assert [a["rule"] for a in alerts] == ["VllmKvCacheSaturated"]
    assert "VllmKvCacheSaturated" in kvpilot("alerts", "--url", agent.url).stdout


def test_a_veto_needs_the_token_and_then_shows_in_status(
    agent: ServedAgent, token_file: Path
) -> None:
    args = ("veto", "add", "--instance", "vllm", "--reason", "maintenance", "--url", agent.url)
    refused = kvpilot(*args)
    assert refused.exit_code == 1 and "refused the token" in refused.stderr
    assert TOKEN not in refused.output
    assert kvpilot(*args, "--token-file", str(token_file)).exit_code == 0
    status = _json(kvpilot("status", "--url", agent.url, "--json"))
    assert "vllm" in status["remediation"]["vetoed_instances"]
    lift = ("veto", "lift", "--instance", "vllm", "--url", agent.url)
    assert kvpilot(*lift, "--token-file", str(token_file)).exit_code == 0
    status = _json(kvpilot("status", "--url", agent.url, "--json"))
    assert "vllm" not in status["remediation"]["vetoed_instances"]


def test_the_token_is_read_from_the_environment_too(agent: ServedAgent) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPILOT_")}
    result = CliRunner().invoke(
        app,
        ["silence", "add", "--match", "instance=vllm", "--duration", "30m", "--url", agent.url],
        env={**env, "KVPILOT_API_TOKEN": TOKEN},
    )
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("silence ")


def test_a_silence_is_listed_until_expired(agent: ServedAgent, token_file: Path) -> None:
    auth = ("--url", agent.url, "--token-file", str(token_file))
    made = _json(kvpilot("silence", "add", "--match", "rule=X", *auth, "--json"))
    silence_id = made["silence"]["silence_id"]
    assert silence_id in kvpilot("silence", "list", *auth).stdout
    assert kvpilot("silence", "expire", silence_id, *auth).exit_code == 0
    listed = _json(kvpilot("silence", "list", *auth, "--json"))["silences"]
    assert silence_id not in [s["silence_id"] for s in listed]
    again = kvpilot("silence", "expire", silence_id, *auth)
    assert again.exit_code == 1 and "in force" in again.stderr  # the agent's own 404


def test_bad_input_is_a_usage_error_not_a_traceback(agent: ServedAgent) -> None:
    for args in (
        ("silence", "add", "--match", "novalue", "--url", agent.url),
        ("silence", "add", "--match", "a=b", "--duration", "soon", "--url", agent.url),
        ("veto", "add", "--reason", "r", "--url", agent.url),  # neither target
    ):
        result = kvpilot(*args)
        assert result.exit_code == 2 and "Traceback" not in result.output, args


def test_an_unknown_breaker_is_the_agents_own_404(agent: ServedAgent, token_file: Path) -> None:
    result = kvpilot(
        "breaker", "reset", "nosuch", "--url", agent.url, "--token-file", str(token_file)
    )
    assert result.exit_code == 1 and "unknown instance 'nosuch'" in result.stderr
    closed = kvpilot(
        "breaker", "reset", "vllm", "--url", agent.url, "--token-file", str(token_file)
    )
    assert closed.exit_code == 0 and "was not open" in closed.stdout


def test_a_queued_remediation_is_listed(agent: ServedAgent, token_file: Path) -> None:
    queued = kvpilot(
        "remediations",
        "queue",
        "vllm",
        "--reason",
        "by hand",
        "--url",
        agent.url,
        "--token-file",
        str(token_file),
    )
    assert queued.exit_code == 0, queued.output
    listed = _json(kvpilot("remediations", "list", "--url", agent.url, "--json"))
    assert set(listed) == {"active", "recent"}
    with httpx.Client(base_url=agent.url) as client:
        for limit in ("0", "501", "abc", "9" * 5000):
            response = client.get("/api/v1/remediations", params={"limit": limit})
            assert response.status_code == 422, (limit, response.text[:200])
    assert kvpilot("remediations", "list", "--url", agent.url).exit_code == 0


def test_a_missing_route_says_the_agent_does_not_support_it(agent: ServedAgent) -> None:
    with (
        AgentClient(AgentAddress(agent.url)) as client,
        pytest.raises(AgentError, match="this agent does not support frobbing"),
    ):
        client.get("/api/v1/frob", "frobbing")


def test_no_agent_is_a_sentence_naming_port_forward() -> None:
    result = kvpilot("status", "--url", "http://127.0.0.1:9")
    assert result.exit_code == 1 and "port-forward" in result.stderr
    assert "Traceback" not in result.output


def test_tuning_held_and_release_reach_the_agent_and_refuse_bad_input(
    agent: ServedAgent, token_file: Path
) -> None:
    listed = kvpilot("tuning", "held", "--url", agent.url, "--json")
    assert listed.exit_code == 0 and _json(listed) == {"held": []}
    release = ("tuning", "release", "t1", "--reason", "r", "--url", agent.url)
    both = kvpilot(*release, "--promote", "--rollback")
    assert both.exit_code == 2 and "exactly one of --promote or --rollback" in both.output
    refused = kvpilot(*release, "--rollback", "--token-file", str(token_file))
    assert refused.exit_code == 1 and "nothing is held" in refused.stderr, refused.output
