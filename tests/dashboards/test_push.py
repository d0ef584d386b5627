"""`kvpilot dashboards push` against a strict fake of Grafana's folder and dashboard API."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import typer
from fake_grafana import FakeGrafana
from typer.testing import CliRunner

from kvpilot.agent.cli.dashboards_cmd import register
from kvpilot.dashboards.build import build_dashboards
from kvpilot.rig.server import free_port

TOKEN = "glsa_test_token"


@pytest.fixture
def grafana() -> Iterator[FakeGrafana]:
    with FakeGrafana(TOKEN) as fake:
        yield fake
        assert fake.state.violations == []


def _push(url: str, token: str = TOKEN) -> object:
    app = typer.Typer()
    register(app)
    return CliRunner().invoke(
        app, ["dashboards", "push", "--grafana-url", url, "--token", token, "--timeout", "5"]
    )


def test_first_push_creates_the_folder_and_every_dashboard(grafana: FakeGrafana) -> None:
    result = _push(grafana.url)
    assert result.exit_code == 0, result.output
    dashboards = build_dashboards()
    assert "folder 'kvpilot': created" in result.output
    for dashboard in dashboards:
        assert f"dashboard {dashboard.title!r} ({dashboard.uid}): created" in result.output
        stored = grafana.state.dashboards[dashboard.uid]
        assert stored["meta"]["folderUid"] == "kvpilot"
        assert {k: v for k, v in stored["dashboard"].items() if k not in {"id", "version"}} == {
            k: v for k, v in dashboard.model().items() if k != "id"
        }
    assert set(grafana.state.folders) == {"kvpilot"}
    saves = [r for r in grafana.state.requests if r.path == "/api/dashboards/db"]
    assert len(saves) == len(dashboards)
    for save in saves:
        assert save.method == "POST"
        assert save.authorization == f"Bearer {TOKEN}"
        assert save.body["overwrite"] is True and save.body["folderUid"] == "kvpilot"


def test_second_push_changes_nothing(grafana: FakeGrafana) -> None:
    assert _push(grafana.url).exit_code == 0
    before = len(grafana.state.requests)
    versions = {uid: d["dashboard"]["version"] for uid, d in grafana.state.dashboards.items()}
    again = _push(grafana.url)
    assert again.exit_code == 0, again.output
    assert "folder 'kvpilot': unchanged" in again.output
    assert again.output.count(": unchanged") == 1 + len(build_dashboards())
    new = grafana.state.requests[before:]
    assert all(r.method == "GET" for r in new), [(r.method, r.path) for r in new]
    assert {uid: d["dashboard"]["version"] for uid, d in grafana.state.dashboards.items()} == (
        versions
    )


def test_a_dashboard_edited_in_grafana_is_updated_by_uid(grafana: FakeGrafana) -> None:
    assert _push(grafana.url).exit_code == 0
    uid = build_dashboards()[0].uid
    grafana.state.dashboards[uid]["dashboard"]["title"] = "edited by hand"
    result = _push(grafana.url)
    assert result.exit_code == 0, result.output
    assert f"({uid}): updated" in result.output
    stored = grafana.state.dashboards[uid]["dashboard"]
    assert stored["title"] == build_dashboards()[0].title
    assert stored["version"] == 2


def test_bad_token_fails_clearly(grafana: FakeGrafana) -> None:
    result = _push(grafana.url, token="wrong")
    assert result.exit_code == 2
    assert "rejected the token" in result.output and "401" in result.output
    assert grafana.state.dashboards == {} and grafana.state.folders == {}
    assert grafana.state.requests[0].authorization == "Bearer wrong"


def test_unreachable_grafana_fails_clearly() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    result = _push(url)
    assert result.exit_code == 3
    assert f"cannot reach Grafana at {url}" in result.output


def test_version_mismatch_fails_clearly(grafana: FakeGrafana) -> None:
    grafana.state.save_status = 412
    result = _push(grafana.url)
    assert result.exit_code == 1
    assert "412" in result.output and "version-mismatch" in result.output
    assert "push again" in result.output
