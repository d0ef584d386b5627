"""The ground a tuning run stood on: the vLLM version, the model and the workload's coarse
shape. A tuned configuration holds while its ground holds; when any of them moves, the
trials that chose it measured another server (`agent.tuning.retune` re-opens tuning).

The ground of each instance's last tuning run is kept in the state database
(`tuning_ground`), written when a run completes, so it holds across restarts.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

import httpx

from kvpilot.agent.state.db import Database
from kvpilot.collectors.vllm_argv import parse_server_argv

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Ground:
    """What a tuning run's figures depend on besides the flags; None: not known (no
    `/version` read yet, no model in the argv, too little traffic to say its shape)."""

    vllm_version: str | None
    model: str | None
    workload_key: str | None

    def unknown(self) -> tuple[str, ...]:
        """What cannot be compared, and why."""
        missing = []
        if self.vllm_version is None:
            missing.append("the vLLM version is unknown (no /version read yet)")
        if self.model is None:
            missing.append("the model is unknown")
        if self.workload_key is None:
            missing.append("the workload shape is unknown (too little traffic observed)")
        return tuple(missing)


def argv_model(argv: tuple[str, ...] | None) -> str | None:
    """The model a server's flags name (its path or hub id, as the study's fingerprint
    holds it); None without flags or model."""
    return (parse_server_argv(argv).model or None) if argv else None


@dataclass(frozen=True, slots=True)
class TunedGround:
    """The ground of an instance's last completed tuning run, and when it completed."""

    ground: Ground
    tuned_wall_s: float


PARTS = ("vllm_version", "model", "workload_key")


def moved(previous: Ground, current: Ground) -> tuple[str, ...]:
    """Why `current` is not the ground `previous` was tuned on, one reason per part that
    moved; a part either side does not know is not compared (no evidence it moved)."""
    was, now = previous, current
    said = {
        "vllm_version": f"vLLM {was.vllm_version} -> {now.vllm_version}",
        "model": f"model {was.model} -> {now.model}",
        "workload_key": f"workload shape moved: {was.workload_key} -> {now.workload_key}",
    }
    return tuple(said[part] for part in moved_parts(previous, current))


def moved_parts(previous: Ground, current: Ground) -> tuple[str, ...]:
    """The names (of PARTS) of the parts known on both sides that differ."""
    return tuple(part for part in PARTS if _differ(getattr(previous, part), getattr(current, part)))


def unknown_parts(previous: Ground, current: Ground) -> tuple[str, ...]:
    """The names of the parts one side or the other does not know."""
    return tuple(
        part for part in PARTS if getattr(previous, part) is None or getattr(current, part) is None
    )


def _differ(before: str | None, now: str | None) -> bool:
    return before is not None and now is not None and before != now


class GroundStore:
    """Each instance's last tuned ground in the state database."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def load(self, instance: str) -> TunedGround | None:
        """The ground of `instance`'s last completed tuning run; None when none completed."""
        rows = self._db.read(
            "SELECT vllm_version, model, workload_key, tuned_wall_s FROM tuning_ground "
            "WHERE instance = ?",
            (instance,),
        )
        if not rows:
            return None
        row = rows[0]
        ground = Ground(row["vllm_version"], row["model"], row["workload_key"])
        return TunedGround(ground, float(row["tuned_wall_s"]))

    def save(self, instance: str, ground: Ground, wall_s: float) -> None:
        """`instance` was tuned on `ground`, completing at `wall_s`."""
        with self._db.transaction() as conn:
            conn.execute(
                "INSERT INTO tuning_ground (instance, vllm_version, model, workload_key, "
                "tuned_wall_s) VALUES (?, ?, ?, ?, ?) ON CONFLICT (instance) DO UPDATE SET "
                "vllm_version = excluded.vllm_version, model = excluded.model, "
                "workload_key = excluded.workload_key, tuned_wall_s = excluded.tuned_wall_s",
                (instance, ground.vllm_version, ground.model, ground.workload_key, wall_s),
            )


async def server_version(url: str, *, api_key: str | None = None) -> str | None:
    """The vLLM version the server at `url` reports on `/version`; None (logged) when it
    does not answer with one: the study is then fingerprinted without it."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with httpx.AsyncClient(timeout=5.0) as client:
            got = await client.get(url.rstrip("/") + "/version", headers=headers)
        version = json.loads(got.text).get("version") if got.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError) as exc:
        log.info("%s/version unreadable: %s", url, type(exc).__name__)
        return None
    return version if isinstance(version, str) and version else None
