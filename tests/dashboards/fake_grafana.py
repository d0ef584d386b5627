"""A fake of Grafana's documented folder and dashboard HTTP API, strict about what it accepts.

Implements `GET/POST /api/folders`, `GET /api/dashboards/uid/:uid` and
`POST /api/dashboards/db` as Grafana documents them: a bearer token in `Authorization`
(401 otherwise), JSON bodies of the documented shape (400 otherwise), 404 for an unknown
dashboard, 409 for a folder uid taken, and a settable status for saves (412 to act out a
version mismatch). Every request is recorded; anything outside the API is a violation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any

from kvpilot.rig.server import free_port
from tests.http_helpers import ServedInThread, send_json


@dataclass
class Recorded:
    method: str
    path: str
    authorization: str | None
    body: Any


@dataclass
class GrafanaState:
    token: str
    folders: dict[str, dict[str, Any]] = field(default_factory=dict)
    dashboards: dict[str, dict[str, Any]] = field(default_factory=dict)
    requests: list[Recorded] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    save_status: int | None = None  # set to answer every save with this error status
    next_id: int = 1


class _Handler(BaseHTTPRequestHandler):
    state: GrafanaState

    def log_message(self, format: str, *args: Any) -> None:
        pass  # quiet: the requests are recorded instead

    def _reply(self, status: int, body: Any) -> None:
        send_json(self, status, body)

    def _body(self) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        if not length:
            return None
        raw = self.rfile.read(length)
        if self.headers.get("Content-Type", "").split(";")[0] != "application/json":
            self.state.violations.append(f"{self.command} {self.path}: body is not JSON")
        return json.loads(raw)

    def _handle(self) -> None:
        body = self._body()
        auth = self.headers.get("Authorization")
        self.state.requests.append(Recorded(self.command, self.path, auth, body))
        if auth != f"Bearer {self.state.token}":
            self._reply(401, {"message": "Invalid API key"})
            return
        route = (self.command, self.path.split("?")[0])
        if route == ("GET", "/api/folders"):
            self._reply(200, list(self.state.folders.values()))
        elif route == ("POST", "/api/folders"):
            self._create_folder(body)
        elif self.command == "GET" and route[1].startswith("/api/dashboards/uid/"):
            self._get_dashboard(route[1].removeprefix("/api/dashboards/uid/"))
        elif route == ("POST", "/api/dashboards/db"):
            self._save_dashboard(body)
        else:
            self.state.violations.append(f"not part of the API: {self.command} {self.path}")
            self._reply(404, {"message": "Not found"})

    do_GET = _handle
    do_POST = _handle
    do_PUT = _handle
    do_DELETE = _handle

    def _create_folder(self, body: Any) -> None:
        if not isinstance(body, dict) or not isinstance(body.get("title"), str):
            self.state.violations.append(f"folder body without a title: {body!r}")
            self._reply(400, {"message": "bad request data"})
            return
        uid = body.get("uid") or f"generated-{self.state.next_id}"
        if uid in self.state.folders:
            self._reply(409, {"message": "a folder with the same uid already exists"})
            return
        folder = {"id": self.state.next_id, "uid": uid, "title": body["title"]}
        self.state.next_id += 1
        self.state.folders[uid] = folder
        self._reply(200, {**folder, "url": f"/dashboards/f/{uid}/", "version": 1})

    def _get_dashboard(self, uid: str) -> None:
        stored = self.state.dashboards.get(uid)
        if stored is None:
            self._reply(404, {"message": "Dashboard not found"})
            return
        self._reply(200, stored)

    def _save_dashboard(self, body: Any) -> None:
        problems = []
        if not isinstance(body, dict):
            problems.append("body is not an object")
            body = {}
        dashboard = body.get("dashboard")
        if (
            not isinstance(dashboard, dict)
            or not dashboard.get("uid")
            or not dashboard.get("title")
        ):
            problems.append("dashboard without uid or title")
        if not isinstance(body.get("overwrite"), bool):
            problems.append("overwrite is not a boolean")
        if body.get("folderUid") not in self.state.folders:
            problems.append(f"unknown folderUid {body.get('folderUid')!r}")
        if problems:
            self.state.violations.extend(problems)
            self._reply(400, {"message": "; ".join(problems)})
            return
        if self.state.save_status is not None:
            self._reply(
                self.state.save_status,
                {"message": "version-mismatch", "status": "version-mismatch"},
            )
            return
        uid = dashboard["uid"]
        previous = self.state.dashboards.get(uid)
        if previous is not None and not body["overwrite"]:
            self._reply(412, {"message": "version-mismatch", "status": "version-mismatch"})
            return
        version = 1 if previous is None else previous["dashboard"]["version"] + 1
        dashboard_id = self.state.next_id if previous is None else previous["dashboard"]["id"]
        self.state.next_id += 1
        saved = {**dashboard, "id": dashboard_id, "version": version}
        self.state.dashboards[uid] = {
            "dashboard": saved,
            "meta": {"folderUid": body["folderUid"], "version": version, "slug": uid},
        }
        self._reply(
            200,
            {"id": dashboard_id, "uid": uid, "status": "success", "version": version, "url": ""},
        )


class FakeGrafana(ServedInThread):
    """The fake on a free loopback port, served from a thread."""

    def __init__(self, token: str) -> None:
        self.state = GrafanaState(token=token)
        handler = type("Handler", (_Handler,), {"state": self.state})
        super().__init__(handler, free_port())
        self.url = f"http://127.0.0.1:{self.port}"
