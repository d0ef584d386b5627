"""The cgroup's OOM-kill count: `oom_kill` in cgroup v2's `memory.events`, or in v1's
`memory.oom_control`. A server the agent starts shares the agent's cgroup, so the agent's
own is read unless a file is configured. Missing or damaged is a count of None and why.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True, slots=True)
class OomKillCount:
    """The count read from `path`, or None with the reason it could not be read."""

    count: int | None
    path: Path | None
    reason: str | None = None


def read_oom_kills(path: Path) -> OomKillCount:
    """`oom_kill N` from a memory.events (v2) or memory.oom_control (v1) file."""
    try:
        text = path.read_bytes().decode("ascii")
    except OSError as exc:
        return OomKillCount(None, path, f"cannot read {path}: {exc.strerror or exc}")
    except UnicodeDecodeError:
        return OomKillCount(None, path, f"{path} is not text (a damaged file)")
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == "oom_kill":
            try:
                count = int(parts[1])
            except ValueError:
                return OomKillCount(None, path, f"{path}: oom_kill is not a number: {parts[1]!r}")
            if count < 0:
                return OomKillCount(None, path, f"{path}: oom_kill is negative: {count}")
            return OomKillCount(count, path)
    return OomKillCount(None, path, f"{path} has no oom_kill line")


def own_events_file(
    pid: int | str = "self", proc_root: Path = PROC, cgroup_root: Path = CGROUP_ROOT
) -> Path | None:
    """The file holding the OOM-kill count of `pid`'s memory cgroup: v2's memory.events
    (the `0::` line), else v1's memory.oom_control; None where neither exists."""
    try:
        lines = (proc_root / str(pid) / "cgroup").read_text().splitlines()
    except OSError:
        return None
    found: list[Path] = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        relative = path.lstrip("/")
        if hierarchy == "0" and controllers == "":
            found.append(cgroup_root / relative / "memory.events")
            found.append(cgroup_root / "unified" / relative / "memory.events")  # hybrid
        elif "memory" in controllers.split(","):
            found.append(cgroup_root / "memory" / relative / "memory.oom_control")
    return next((p for p in found if _has_count(p)), None)


def _has_count(path: Path) -> bool:
    return read_oom_kills(path).count is not None
