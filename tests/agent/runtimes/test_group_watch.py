"""A process group's id can pass to unrelated processes once its members are gone: the local
runtime kills only the members that belong to the process it started.

PID reuse cannot be forced on a real kernel, so these tests read a fake /proc (named as
such: `FakeProc`), the one part that stands in; the class reads it as it reads /proc.
"""

from __future__ import annotations

from pathlib import Path

from kvpilot.agent.runtimes.processes import GroupWatch


class FakeProc:
    """A fake /proc: `stat` and `cmdline` files for the processes a test declares."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def add(self, pid: int, *, ppid: int, pgid: int, start: int, state: str = "S") -> None:
        folder = self.root / str(pid)
        folder.mkdir(parents=True, exist_ok=True)
        rest = ["0"] * 16 + [str(start)] + ["0"] * 4  # start time is field 22 (index 19 here)
        (folder / "stat").write_text(f"{pid} (vllm) {state} {ppid} {pgid} {' '.join(rest)}\n")
        (folder / "cmdline").write_bytes(b"vllm\0serve\0m\0")

    def remove(self, pid: int) -> None:
        for name in ("stat", "cmdline"):
            (self.root / str(pid) / name).unlink()
        (self.root / str(pid)).rmdir()


def test_a_reused_group_id_names_none_of_its_new_members(tmp_path: Path) -> None:
    proc = FakeProc(tmp_path)
    proc.add(100, ppid=1, pgid=100, start=5000)  # the server we started: the group's leader
    proc.add(101, ppid=100, pgid=100, start=5001)  # its engine core
    leader = [True]
    watch = GroupWatch(100, lambda: leader[0], tmp_path)
    assert [r.pid for r in watch.members()] == [100, 101]

    leader[0] = False  # reaped; then every member went, and PID 100 went to a stranger
    proc.remove(100)
    proc.remove(101)
    proc.add(100, ppid=1, pgid=100, start=9000)  # a new session leader with the same id
    proc.add(130, ppid=100, pgid=100, start=9001)
    assert watch.members() == [], "a stranger's processes would be killed"


def test_members_seen_while_the_leader_held_the_id_and_their_children_count(
    tmp_path: Path,
) -> None:
    proc = FakeProc(tmp_path)
    proc.add(200, ppid=1, pgid=200, start=10)
    proc.add(201, ppid=200, pgid=200, start=11)
    leader = [True]
    watch = GroupWatch(200, lambda: leader[0], tmp_path)
    leader[0] = False  # the leader exited and was reaped; its worker lingers
    proc.remove(200)
    proc.add(202, ppid=201, pgid=200, start=12)  # a process the worker started since
    proc.add(203, ppid=1, pgid=200, start=13)  # in the group, but from nowhere we know
    assert [r.pid for r in watch.members()] == [201, 202]
