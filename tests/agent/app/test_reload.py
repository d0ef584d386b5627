"""`POST /-/reload` on a real agent: token first, notifiers and rules applied, the sections
that need a restart named, an invalid file refused with its problems, each reload audited."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import httpx

from tests.faults.running_agent import Agent, base_config, free_port, write_config

TOKEN = "reload-test-token"


def _hook(url: str) -> dict[str, object]:
    return {"kind": "webhook", "name": "oncall", "url": url}


def _reload_successful(port: int) -> str | None:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    for line in text.splitlines():
        if line.startswith("kvpilot_config_last_reload_successful "):
            return line.split()[1]
    return None


def test_reload_over_http(tmp_path: Path) -> None:
    config = base_config(tmp_path, [], api={"token": TOKEN})
    config["runtime"] = {
        "kind": "attach",
        "servers": [
            {"name": "vllm", "url": f"http://127.0.0.1:{free_port()}"},
        ],
    }
    config["notifiers"] = [_hook("http://127.0.0.1:9/one")]
    path = write_config(tmp_path / "kvpilot.yaml", config)
    port = config["listen"]["port"]
    url = f"http://127.0.0.1:{port}/-/reload"
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with Agent("run", "--config", str(path)) as agent:
        agent.wait_healthy(port)
        assert httpx.post(url, timeout=10).status_code == 401

        same = httpx.post(url, headers=auth, timeout=10)
        assert same.json() == {"applied": [], "needs_restart": []}
        assert _reload_successful(port) == "1.0"

        config["notifiers"] = [_hook("http://127.0.0.1:9/two")]
        config["rules"] = {"server_down": {"for_s": 30}}
        config["interval_s"] = 0.7
        write_config(path, config)
        changed = httpx.post(url, headers=auth, timeout=10)
        assert changed.status_code == 200
        assert sorted(changed.json()["applied"]) == ["notifiers", "rules"]
        assert changed.json()["needs_restart"] == ["interval_s"]

        path.write_text("notifiers: [{kind: webhook, url: 7, surprise: 1}]\n")
        refused = httpx.post(url, headers=auth, timeout=10)
        assert refused.status_code == 400
        problems = " ".join(refused.json()["problems"])
        assert "url" in problems and "surprise" in problems, problems
        agent.check_alive("after a refused reload")
        assert _reload_successful(port) == "0.0"  # set by the reload itself, not a later tick
        assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code == 200
    with sqlite3.connect(tmp_path / "state" / "kvpilot.db") as db:
        audited = db.execute(
            "SELECT decision, reason FROM audit WHERE action = 'reload' ORDER BY id"
        ).fetchall()
    assert [decision for decision, _ in audited] == ["applied", "applied", "refused"]
    assert "interval_s changed too: these apply when kvpilot restarts" in audited[1][1]
