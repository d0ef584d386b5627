"""Vetoes a Deployment keeps, merged into one replica's: taken in, dropped when lifted on
another replica, a change made here and not yet kept left alone, and the mark of what the
Deployment keeps surviving a restart of kvpilot."""

from __future__ import annotations

from kvpilot.agent.remediation.audit import AuditTrail
from kvpilot.agent.remediation.trigger import Trigger
from kvpilot.agent.remediation.vetoes import VetoChange, Vetoes, veto_row
from tests.fakes.remediation_journal import MemoryJournal

WALL0 = 1_800_000_000.0


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def mono(self) -> float:
        return self.now_s

    def wall(self) -> float:
        return self.now_s + WALL0


def vetoes(journal: MemoryJournal, clock: Clock) -> Vetoes:
    return Vetoes(journal, AuditTrail(journal, clock.wall), clock.wall, clock.mono)


def row(target: str, *, until_wall_s: float | None = None) -> dict[str, object]:
    return {
        "kind": "instance",
        "target": target,
        "reason": "kept",
        "requested_by": "oncall",
        "since_wall_s": WALL0,
        "until_wall_s": until_wall_s,
    }


def vetoed(v: Vetoes, instance: str) -> bool:
    return v.against(Trigger(instance, "manual", None, None)) is not None


def test_kept_vetoes_are_taken_in_and_dropped_when_lifted_elsewhere() -> None:
    clock, journal = Clock(), MemoryJournal()
    v = vetoes(journal, clock)
    heard: list[VetoChange] = []
    v.watch(heard.append)
    assert v.merge_kept([row("llm", until_wall_s=clock.wall() + 60), row("ended", until_wall_s=1)])
    assert vetoed(v, "llm") and not vetoed(v, "ended")
    assert not heard  # a merged veto is no operator's change to keep again
    clock.now_s += 61
    assert not vetoed(v, "llm")  # its duration runs on this replica's monotonic clock
    assert v.merge_kept([row("llm")]) == 1 and vetoed(v, "llm")
    assert v.merge_kept([]) == 1 and not vetoed(v, "llm")  # lifted on another replica


def test_a_change_made_here_and_not_yet_kept_is_left_alone() -> None:
    clock, journal = Clock(), MemoryJournal()
    v = vetoes(journal, clock)
    heard: list[VetoChange] = []
    v.watch(heard.append)
    made = v.add(requested_by="oncall", reason="hold", instance="mine")
    assert heard == [VetoChange(made, lifted=False)] and veto_row(made)["target"] == "mine"
    # The Deployment does not keep it yet: it stays, whether or not it is pending.
    assert v.merge_kept([], pending={("instance", "mine")}) == 0 and vetoed(v, "mine")
    v.merge_kept([row("theirs")])
    assert v.lift(requested_by="oncall", reason="done", instance="theirs")
    assert heard[-1].lifted and heard[-1].veto.target == "theirs"
    # The lift is not kept yet: the Deployment's copy does not bring it back.
    v.merge_kept([row("theirs")], pending={("instance", "theirs")})
    assert not vetoed(v, "theirs") and vetoed(v, "mine")


def test_what_the_deployment_keeps_is_remembered_across_a_restart_of_kvpilot() -> None:
    clock, journal = Clock(), MemoryJournal()
    vetoes(journal, clock).merge_kept([row("llm")])
    again = vetoes(journal, clock)  # a new process over the same journal
    again.restore()
    assert vetoed(again, "llm")
    assert again.merge_kept([]) == 1 and not vetoed(again, "llm")  # lifted while it was down
