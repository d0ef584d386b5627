"""The cgroup's OOM-kill count, from v2's memory.events or v1's memory.oom_control."""

from __future__ import annotations

from pathlib import Path

from kvpilot.agent.remediation.oom.cgroup import own_events_file, read_oom_kills

V2 = "low 0\nhigh 0\nmax 12\noom 3\noom_kill 2\noom_group_kill 0\n"
V1 = "oom_kill_disable 0\nunder_oom 0\noom_kill 5\n"


def test_v2_memory_events(tmp_path: Path) -> None:
    path = tmp_path / "memory.events"
    path.write_text(V2)
    count = read_oom_kills(path)
    assert (count.count, count.reason) == (2, None)


def test_v1_oom_control(tmp_path: Path) -> None:
    path = tmp_path / "memory.oom_control"
    path.write_text(V1)
    assert read_oom_kills(path).count == 5


def test_absent_is_none_with_the_reason(tmp_path: Path) -> None:
    count = read_oom_kills(tmp_path / "memory.events")
    assert count.count is None and count.reason is not None and "cannot read" in count.reason


def _proc(tmp_path: Path, cgroup: str) -> Path:
    (tmp_path / "proc" / "self").mkdir(parents=True)
    (tmp_path / "proc" / "self" / "cgroup").write_text(cgroup)
    return tmp_path / "proc"


def test_the_agents_own_v2_cgroup_is_found(tmp_path: Path) -> None:
    proc = _proc(tmp_path, "0::/kvpilot.slice/agent.scope\n")
    events = tmp_path / "cg" / "kvpilot.slice" / "agent.scope" / "memory.events"
    events.parent.mkdir(parents=True)
    events.write_text(V2)
    assert own_events_file(proc_root=proc, cgroup_root=tmp_path / "cg") == events


def test_a_v1_memory_hierarchy_is_found(tmp_path: Path) -> None:
    proc = _proc(tmp_path, "9:pids:/\n4:memory:/box/1\n0::/\n")
    control = tmp_path / "cg" / "memory" / "box" / "1" / "memory.oom_control"
    control.parent.mkdir(parents=True)
    control.write_text(V1)
    assert own_events_file(proc_root=proc, cgroup_root=tmp_path / "cg") == control


def test_no_readable_count_anywhere_is_none(tmp_path: Path) -> None:
    proc = _proc(tmp_path, "4:memory:/box/1\n0::/\n")
    assert own_events_file(proc_root=proc, cgroup_root=tmp_path / "cg") is None
    assert own_events_file(proc_root=tmp_path / "nowhere", cgroup_root=tmp_path / "cg") is None
