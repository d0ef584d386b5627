"""The tuner's figures on /metrics come from memory: scrapes read no trial, the tick refreshes.

The sidecar test runs a real `Sidecar` (SQLite state, the real tick, the exposition and the
HTTP app wired as `kvpilot run` wires them) on one event loop, scraping through ASGI; the
trial store is wrapped to count the reads that reach it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvpilot.agent.app.exposition import build_registry, sidecar_families, tuning_families
from kvpilot.agent.app.http import build_app
from kvpilot.agent.app.parts import tick_settings
from kvpilot.agent.config import AgentConfig
from kvpilot.agent.model import Instance
from kvpilot.agent.remediation import Remediator
from kvpilot.agent.runtimes.base import InstanceStatus
from kvpilot.agent.state import StateStore
from kvpilot.agent.state.trials import SqliteTrialStore
from kvpilot.agent.tick.sidecar import Sidecar
from kvpilot.agent.tick.tuning_figures import TuningFiguresCache
from kvpilot.agent.tick.watched import WatchedServers
from kvpilot.collectors.nvml import NvmlCollector
from kvpilot.dashboards import tuning_metrics
from kvpilot.rig.server import free_port
from kvpilot.tuner.problem.objective import TrialOutcome, TrialResult
from kvpilot.tuner.trials import Trial, TrialState, new_trial
from tests.fakes.trial_store import CountingTrialStore, InMemoryTrialStore

REFRESH_S = 15.0
PORT = free_port()  # nobody listens there: the tick's scrape is refused at once
CONFIGURED = ("vllm", "serve", "tiny", "--port", str(PORT), "--max-num-seqs", "8")
PROMOTED = ("vllm", "serve", "tiny", "--port", str(PORT), "--max-num-seqs", "16")

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def planned(trial_id: str, number: int) -> Trial:
    return new_trial(trial_id, "study", number, {"max_num_seqs": 8 * number}, float(number))


def finished(trial_id: str, number: int, goodput: float) -> Trial:
    running = planned(trial_id, number).to(TrialState.RUNNING, at_wall_s=number + 0.1)
    result = TrialResult(TrialOutcome.FEASIBLE, goodput, None, None)
    return running.finish(result, at_wall_s=number + 0.5)


def add_finished(store: SqliteTrialStore, trial_id: str, number: int, goodput: float) -> None:
    """As the tuner writes it: planned, then each transition saved."""
    store.add(planned(trial_id, number))
    done = finished(trial_id, number, goodput)
    store.save(dataclasses.replace(done, state=TrialState.RUNNING, result=None))
    store.save(done)


@dataclass
class OneServer:
    """The runtime of the configured stable server, served by nobody."""

    url: str = f"http://127.0.0.1:{PORT}"
    argv: tuple[str, ...] = CONFIGURED
    instance_calls: int = 0

    def instances(self) -> tuple[Instance, ...]:
        self.instance_calls += 1
        return (Instance("vllm", "stable", self.url, None, frozenset(), 4242, self.argv, 1.0),)

    def status(self, name: str) -> InstanceStatus:
        return InstanceStatus(name, "running", 4242, 1.0)

    async def restart(self, name: str, **_: Any) -> Instance:
        raise AssertionError("a dry run restarts nothing")


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


@dataclass
class Rig:
    sidecar: Sidecar
    runtime: OneServer
    clock: Clock
    counting: CountingTrialStore
    writer: SqliteTrialStore  # the tuner, writing through its own store on the same file
    scrape: httpx.AsyncClient

    async def metrics(self) -> str:
        response = await self.scrape.get("/metrics")
        assert response.status_code == 200
        return response.text


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    server = {"name": "vllm", "role": "stable", "argv": list(CONFIGURED)}
    config = AgentConfig.model_validate(
        {
            "state_dir": str(tmp_path),
            "runtime": {"kind": "local", "instances": [server]},
            "remediation": {"dry_run": True},
        }
    )
    runtime, clock = OneServer(), Clock()
    with StateStore.open(tmp_path) as store:
        counting = CountingTrialStore(SqliteTrialStore(store.db))
        sidecar = Sidecar(
            tick_settings(config),
            store=store,
            runtime=runtime,
            notifiers={},
            remediator=Remediator(runtime, store, config.remediation, clock=clock),
            watched=WatchedServers(
                tick_settings(config),
                NvmlCollector(),  # type: ignore[arg-type]
                clock=clock,
            ),
            wall_clock=lambda: 1_760_000_000.0 + clock(),
            tuning_figures=TuningFiguresCache(counting, refresh_s=REFRESH_S),
        )
        own = sidecar_families(sidecar.counters)

        def extra(out: Any) -> None:  # as `kvpilot run` wires /metrics
            own(out)
            tuning_families(sidecar.tuning_families())(out)

        app = build_app(
            sidecar,
            build_registry(sidecar.watched.servers, extra),
            clock=clock,
            stale_after_s=60.0,
        )
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://kvpilot") as scrape:
            yield Rig(sidecar, runtime, clock, counting, SqliteTrialStore(store.db), scrape)
        await sidecar.aclose()


def live_flags(families: Sequence[tuning_metrics.Family]) -> list[tuple[str, str]]:
    (family,) = (f for f in families if f.spec.name == tuning_metrics.LIVE_FLAGS_INFO)
    return [(dict(s.labels)["flags"], dict(s.labels)["source"]) for s in family.samples]


def goodput_line(trial_id: str, goodput: float) -> str:
    return (
        f'kvpilot_tuning_trial_goodput_tokens_per_second{{state="complete",trial="{trial_id}",'
        f'verdict="unjudged"}} {goodput}'
    )


async def test_scrapes_read_no_trial_and_a_new_trial_shows_after_the_refresh(rig: Rig) -> None:
    add_finished(rig.writer, "t1", 1, 100.0)
    await rig.sidecar.tick()
    assert rig.counting.reads == 1  # the first tick reads the trials once

    for _ in range(25):
        text = await rig.metrics()
        assert goodput_line("t1", 100.0) in text.splitlines()
    assert rig.counting.reads == 1  # 25 scrapes, no read of the trial store

    add_finished(rig.writer, "t2", 2, 250.0)  # the tuner finishes a trial
    assert goodput_line("t2", 250.0) not in (await rig.metrics()).splitlines()
    rig.clock.now_s += REFRESH_S - 1
    await rig.sidecar.tick()  # before the refresh point: still the last read
    assert rig.counting.reads == 1
    assert goodput_line("t2", 250.0) not in (await rig.metrics()).splitlines()

    rig.clock.now_s += 1
    await rig.sidecar.tick()  # the refresh point
    assert rig.counting.reads == 2
    lines = (await rig.metrics()).splitlines()
    assert goodput_line("t2", 250.0) in lines and goodput_line("t1", 100.0) in lines
    assert "kvpilot_tuning_best_goodput_tokens_per_second 250.0" in lines
    assert 'kvpilot_tuning_trials_total{state="complete"} 2.0' in lines
    for _ in range(10):
        await rig.metrics()
    assert rig.counting.reads == 2


async def test_promoted_flags_show_at_the_next_tick_without_reading_trials(rig: Rig) -> None:
    await rig.sidecar.tick()
    configured = (
        f'kvpilot_live_flags_info{{flags="{" ".join(CONFIGURED)}",server="vllm",'
        'source="configured"} 1.0'
    )
    assert configured in (await rig.metrics()).splitlines()
    reads, instance_calls = rig.counting.reads, rig.runtime.instance_calls
    rig.runtime.argv = PROMOTED  # the remediator restarted it with the tuner's flags
    for _ in range(5):
        assert live_flags(rig.sidecar.tuning_families()) == [(" ".join(CONFIGURED), "configured")]
    assert rig.runtime.instance_calls == instance_calls  # the tuning figures ask it nothing
    rig.clock.now_s += 1
    await rig.sidecar.tick()
    lines = (await rig.metrics()).splitlines()
    promoted = (
        f'kvpilot_live_flags_info{{flags="{" ".join(PROMOTED)}",server="vllm",source="promoted"}} '
        "1.0"
    )
    assert promoted in lines and configured not in lines
    assert rig.counting.reads == reads  # the trials were not due


# --- the cache on its own -------------------------------------------------------------


class BrokenOnce(InMemoryTrialStore):
    def __init__(self) -> None:
        super().__init__()
        self.fail = False

    def trials(self, fingerprint: str | None = None) -> list[Trial]:
        if self.fail:
            raise OSError("database is locked")
        return super().trials(fingerprint)


LIVE = (tuning_metrics.LiveFlags("vllm", "--max-num-seqs 8", tuning_metrics.FlagSource.CONFIGURED),)


def names(families: Sequence[tuning_metrics.Family]) -> set[str]:
    return {f.spec.name for f in families if f.samples}


def test_before_the_first_read_only_the_live_flags_are_known() -> None:
    store = BrokenOnce()
    store.fail = True
    cache = TuningFiguresCache(store, refresh_s=REFRESH_S)
    assert cache.current.families == ()
    figures = cache.refresh(0.0, LIVE)
    assert figures.trials is None
    assert names(figures.families) == {tuning_metrics.LIVE_FLAGS_INFO}  # no count of zero


def test_a_failed_read_keeps_the_last_trials_and_is_tried_again_later(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = BrokenOnce()
    store.add(finished("t1", 1, 100.0))
    cache = TuningFiguresCache(store, refresh_s=REFRESH_S)
    first = cache.refresh(0.0, LIVE)
    assert first.trials == (store.get("t1"),)
    store.add(finished("t2", 2, 200.0))
    store.fail = True
    kept = cache.refresh(REFRESH_S, LIVE)
    assert kept is first and "reading the trials failed" in caplog.text
    store.fail = False
    assert cache.refresh(REFRESH_S + 1, LIVE) is first  # not again at once
    again = cache.refresh(2 * REFRESH_S, LIVE)
    assert again.trials is not None and [t.trial_id for t in again.trials] == ["t1", "t2"]
    assert again.trials_read_at_s == 2 * REFRESH_S


def test_unchanged_inputs_keep_the_same_value() -> None:
    cache = TuningFiguresCache(InMemoryTrialStore(), refresh_s=REFRESH_S)
    first = cache.refresh(0.0, LIVE)
    assert cache.refresh(1.0, LIVE) is first
    assert cache.refresh(2.0, ()) is not first  # the live flags changed


def test_the_refresh_interval_is_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        TuningFiguresCache(InMemoryTrialStore(), refresh_s=0.0)
