"""Uploads the dashboards into a Grafana folder through its HTTP API (`grafana-client`).

Idempotent: the folder is created once (by uid), and a dashboard is posted only when its
model differs from the one stored under the same uid; each post overwrites by uid.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from grafana_client.api import GrafanaApi
from grafana_client.client import (
    GrafanaClientError,
    GrafanaException,
    GrafanaServerError,
    GrafanaUnauthorizedError,
)

from kvpilot.dashboards.build import DashboardFile

FOLDER_UID = "kvpilot"
FOLDER_TITLE = "kvpilot"
# Fields Grafana sets itself on save; they never make a dashboard differ.
_SERVER_FIELDS = frozenset({"id", "version"})


class PushOutcome(enum.StrEnum):
    CREATED = "created"
    UPDATED = "updated"
    UNCHANGED = "unchanged"


@dataclass(frozen=True, slots=True)
class PushResult:
    """What one push did: to the folder, and to each dashboard by uid."""

    folder: PushOutcome
    dashboards: tuple[tuple[str, str, PushOutcome], ...]  # (uid, title, outcome)

    def lines(self) -> list[str]:
        out = [f"folder {FOLDER_TITLE!r}: {self.folder}"]
        out += [
            f"dashboard {title!r} ({uid}): {outcome}" for uid, title, outcome in self.dashboards
        ]
        return out


class PushError(Exception):
    """A push that failed, with a message for people and the exit code the CLI returns."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


# Exit codes: 1 Grafana refused a request, 2 the token was rejected, 3 Grafana unreachable.
REFUSED, UNAUTHORIZED, UNREACHABLE = 1, 2, 3


def _comparable(model: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in model.items() if k not in _SERVER_FIELDS}


class _Session:
    """Wraps the client so every failure turns into a `PushError` with a clear message."""

    def __init__(self, api: GrafanaApi, url: str) -> None:
        self._api = api
        self._url = url

    def call(self, what: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except GrafanaUnauthorizedError as exc:
            raise PushError(
                f"Grafana at {self._url} rejected the token while trying to {what} (401): "
                "pass a service-account token with the Editor role (--token or "
                "KVPILOT_GRAFANA_TOKEN).",
                UNAUTHORIZED,
            ) from exc
        except GrafanaClientError as exc:
            if exc.status_code == 403:
                raise PushError(
                    f"Grafana at {self._url} refused to {what} (403 forbidden): the token's "
                    "role cannot write dashboards or folders.",
                    UNAUTHORIZED,
                ) from exc
            if exc.status_code == 412:
                raise PushError(
                    f"Grafana at {self._url} refused to {what} (412 precondition failed: "
                    f"{_message(exc)}): another dashboard with the same title exists in the "
                    "folder, or it changed on the server meanwhile; rename or delete it in "
                    "Grafana, then push again.",
                    REFUSED,
                ) from exc
            raise PushError(
                f"Grafana at {self._url} refused to {what} ({exc.status_code}: {_message(exc)}).",
                REFUSED,
            ) from exc
        except GrafanaServerError as exc:
            raise PushError(
                f"Grafana at {self._url} failed to {what} ({exc.status_code}: {_message(exc)}).",
                REFUSED,
            ) from exc
        except (GrafanaException, OSError) as exc:
            # Status 0: no HTTP answer at all (refused connection, DNS, timeout).
            status = getattr(exc, "status_code", 0)
            if status:
                raise PushError(
                    f"Grafana at {self._url} failed to {what} ({status}: {_message(exc)}).",
                    REFUSED,
                ) from exc
            raise PushError(
                f"cannot reach Grafana at {self._url} to {what}: {exc}", UNREACHABLE
            ) from exc


def _message(exc: GrafanaException | OSError) -> str:
    response = getattr(exc, "response", None)
    if isinstance(response, dict) and "message" in response:
        return str(response["message"])
    return str(getattr(exc, "message", exc))


def _ensure_folder(session: _Session, api: GrafanaApi) -> PushOutcome:
    folders = session.call("list folders", api.folder.get_all_folders)
    if any(folder.get("uid") == FOLDER_UID for folder in folders or ()):
        return PushOutcome.UNCHANGED
    session.call("create the folder", api.folder.create_folder, FOLDER_TITLE, FOLDER_UID)
    return PushOutcome.CREATED


def _stored(session: _Session, api: GrafanaApi, uid: str) -> dict[str, Any] | None:
    try:
        found: dict[str, Any] = session.call(
            f"read dashboard {uid}", api.dashboard.get_dashboard, uid
        )
    except PushError as exc:
        cause = exc.__cause__
        if isinstance(cause, GrafanaClientError) and cause.status_code == 404:
            return None
        raise
    return found


def push(
    url: str, token: str, dashboards: Sequence[DashboardFile], *, timeout_s: float = 10.0
) -> PushResult:
    """Create the folder if needed and upload each dashboard that differs from Grafana's copy."""
    api = GrafanaApi.from_url(url, credential=token, timeout=timeout_s)
    session = _Session(api, url)
    folder = _ensure_folder(session, api)
    results = []
    for dashboard in dashboards:
        model = dashboard.model()
        stored = _stored(session, api, dashboard.uid)
        if stored is not None:
            same_folder = stored.get("meta", {}).get("folderUid") == FOLDER_UID
            if same_folder and _comparable(stored.get("dashboard", {})) == _comparable(model):
                results.append((dashboard.uid, dashboard.title, PushOutcome.UNCHANGED))
                continue
        body = {
            "dashboard": {**model, "id": None},
            "folderUid": FOLDER_UID,
            "overwrite": True,
            "message": "kvpilot dashboards push",
        }
        session.call(f"save dashboard {dashboard.uid}", api.dashboard.update_dashboard, body)
        outcome = PushOutcome.CREATED if stored is None else PushOutcome.UPDATED
        results.append((dashboard.uid, dashboard.title, outcome))
    return PushResult(folder=folder, dashboards=tuple(results))
