"""`kvpilot demo`: the sidecar loop of `kvpilot run` on a local CPU vLLM, a webhook receiver
of its own, and a scripted scenario (`scenario.py`) in four phases, then a summary.

Everything it starts (the server, the canary, the receiver, the agent's HTTP listener) stops
with it: the sidecar's shutdown path stops the servers, the receiver closes after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import tempfile
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path

from kvpilot.agent.app.compose import run_sidecar
from kvpilot.agent.cli.demo.receiver import Delivery, WebhookReceiver
from kvpilot.agent.cli.demo.scenario import (
    BURST,
    PHASES,
    STABLE,
    STEADY,
    WEBHOOK_SECRET_BYTES,
    DemoPhase,
    Load,
    demo_config,
)
from kvpilot.agent.cli.demo.state import snapshot_of, trial_rows
from kvpilot.agent.cli.demo.view import DemoSnapshot, DemoView, LogPanel, TrialRow, export
from kvpilot.agent.config import validate_config
from kvpilot.agent.state.trials import SqliteTrialStore
from kvpilot.agent.tick.sidecar import Sidecar
from kvpilot.agent.tuning.schedule import ScheduledTuning
from kvpilot.collectors.kvpool.client import KvPoolScrape
from kvpilot.collectors.vllm_metrics import VllmScrape
from kvpilot.rig.server import free_kvpool_port, free_port
from kvpilot.tuner.load.generator import run_load

log = logging.getLogger("kvpilot.demo")
SPIKE = "VllmPreemptionSpike"
POLL_S = 0.5


@dataclass(frozen=True, slots=True)
class DemoSettings:
    duration_s: float | None = None
    listen_port: int = 8474
    live_view: bool = True
    pin_cpus: bool = True  # the stable server on core 0, the canary on core 1
    log_file: Path | None = None  # the whole log, beside the view's panel
    capture: Path | None = None  # the view's last screen as .txt and .svg (the README's)
    trials: int = 2  # the tuning session's


@dataclass(slots=True)
class _Handles:
    """What the scenario drives, as the sidecar hands it over."""

    sidecar: Sidecar | None = None
    tuning: ScheduledTuning | None = None
    phase: str = "starting the CPU vLLM (about a minute)"
    deliveries: list[str] = field(default_factory=list)
    last: DemoSnapshot | None = None  # the view's latest screen
    outcomes: list[str] = field(default_factory=list)  # the summary's lines


class PhaseTimeout(Exception):
    """A phase's condition did not come within its deadline."""


async def _until(what: str, check: Callable[[], bool], deadline_s: float) -> None:
    end = time.monotonic() + deadline_s
    while not check():
        if time.monotonic() > end:
            raise PhaseTimeout(f"{what}: not within {deadline_s:.0f} s")
        await asyncio.sleep(POLL_S)


async def _loop_load(url: str, load: Load, stop: asyncio.Event, *, repeat: bool) -> int:
    """The load until `stop` (or once); returns the requests that failed (a restarting
    server refuses some: that is the story, not an error)."""
    failed, seed = 0, 0
    while not stop.is_set():
        report = await run_load(url, load.workload(seed), stop=stop)
        failed += len(report.failed)
        seed += 1
        if not repeat:
            break
        if report.failed:
            await asyncio.sleep(1.0)  # the server is restarting: do not spin
    return failed


async def _stop_load(load: tuple[asyncio.Event, asyncio.Task[int]]) -> None:
    load[0].set()
    await load[1]


def _preemptions(sidecar: Sidecar, *, kvpool: bool = False) -> float | None:
    """The stable server's `vllm:num_preemptions_total`, or the kvpool plugin's counter
    (lag-free: the rule sees a spike there first)."""
    for view in sidecar.watched.servers():
        if view.server != STABLE or view.state.latest is None:
            continue
        source = view.state.latest.kvpool if kvpool else view.state.latest.vllm
        if isinstance(source, VllmScrape | KvPoolScrape) and source.engines:
            return source.engines[0].preemptions_total
    return None


def _spike_state(sidecar: Sidecar) -> str:
    states = [
        a.state
        for a in sidecar.alerts.alerts()
        if dict(a.labels).get("alertname") == SPIKE and dict(a.labels).get("instance") == STABLE
    ]
    return (
        "firing"
        if "firing" in states
        else "pending"
        if "pending" in states
        else (states[0] if states else "inactive")
    )


class Scenario:
    """Plays the four phases against the running sidecar, logging each step."""

    def __init__(self, handles: _Handles, cooldown_s: float, url: str) -> None:
        self.h = handles
        self.cooldown_s = cooldown_s  # remediation's, which a tuning session waits out
        self.url = url
        self._peak, self._peak_kvpool = 0.0, 0.0

    @property
    def sidecar(self) -> Sidecar:
        assert self.h.sidecar is not None
        return self.h.sidecar

    def _enter(self, phase: DemoPhase) -> None:
        self.h.phase = f"phase {phase.number}/{len(PHASES)}: {phase.name}"
        log.info("%s: %s", self.h.phase, phase.story)

    def _outcome(self, line: str) -> None:
        log.info("%s: %s", self.h.phase, line)
        self.h.outcomes.append(f"{self.h.phase}: {line}")

    async def play(self) -> None:
        start = time.monotonic()
        await _until("the server's first scrape", self._scraping, 300)
        steady: tuple[asyncio.Event, asyncio.Task[int]] | None = None
        try:
            for phase, step in zip(PHASES, self._steps(), strict=True):
                if phase.steady_load and steady is None:
                    stop = asyncio.Event()
                    steady = (
                        stop,
                        asyncio.create_task(_loop_load(self.url, STEADY, stop, repeat=True)),
                    )
                elif not phase.steady_load and steady is not None:
                    await _stop_load(steady)
                    steady = None
                self._enter(phase)
                try:
                    await asyncio.wait_for(step(phase), timeout=phase.deadline_s)
                except (PhaseTimeout, TimeoutError) as exc:
                    self._outcome(f"did not finish: {exc or 'deadline'}; moving on")
        finally:
            if steady is not None:
                await _stop_load(steady)
        self.h.phase = "summary"
        took = f"the scenario took {time.monotonic() - start:.0f} s after the server's first scrape"
        log.info("%s", took)
        self.h.outcomes.append(took)

    def _steps(self) -> tuple[Callable[[DemoPhase], Awaitable[None]], ...]:
        return (self._steady, self._burst, self._tune, self._burst_again)

    def _scraping(self) -> bool:
        return self.h.sidecar is not None and _preemptions(self.sidecar) is not None

    async def _steady(self, phase: DemoPhase) -> None:
        await asyncio.sleep(15)  # a few windows of figures under the trickle
        self._outcome(
            f"settled, preemptions {_preemptions(self.sidecar)}, spike {_spike_state(self.sidecar)}"
        )

    async def _burst(self, phase: DemoPhase) -> None:
        before = _preemptions(self.sidecar) or 0.0
        stop = asyncio.Event()
        burst = asyncio.create_task(_loop_load(self.url, BURST, stop, repeat=True))
        peak = asyncio.create_task(self._peak_preemptions())
        try:
            await _until(
                "VllmPreemptionSpike pending",
                lambda: _spike_state(self.sidecar) in ("pending", "firing"),
                phase.deadline_s,
            )
            self._outcome(
                f"{SPIKE} pending (preemptions {before:.0f} -> "
                f"{_preemptions(self.sidecar) or 0:.0f})"
            )
            await _until(
                f"{SPIKE} firing",
                lambda: _spike_state(self.sidecar) == "firing" or self._remediations() > 0,
                phase.deadline_s,
            )
            self._outcome(f"{SPIKE} firing (preemptions {_preemptions(self.sidecar) or 0:.0f})")
        finally:
            stop.set()
            await burst
            peak.cancel()
        self._outcome(
            f"vllm:num_preemptions_total rose from {before:.0f} to {self._peak:.0f} "
            f"(the kvpool plugin counted {self._peak_kvpool:.0f})"
        )
        await _until(
            "the signed webhook",
            lambda: any(d.startswith(SPIKE) and "firing" in d for d in self.h.deliveries),
            60,
        )
        self._outcome(f"webhook received: {self._delivery(SPIKE, 'firing')}")
        await _until("the restart", self._remediation_finished, phase.deadline_s)
        self._outcome(f"remediation: {self._last_remediation()}")
        await _until(f"{SPIKE} resolved", lambda: _spike_state(self.sidecar) != "firing", 60)
        self._outcome(f"{SPIKE} {_spike_state(self.sidecar)}")

    async def _tune(self, phase: DemoPhase) -> None:
        tuning = self.h.tuning
        if tuning is None:
            self._outcome("no tuning configured")
            return
        # First aid done, the cure: from here on the spike climbs the ladder (the product's
        # default): recommend tuning, or promote what tuning validated. A restart would also
        # cut the session short, whose replay of the burst preempts on the stable server.
        self._use_ladder()
        # The restart's cooldown must pass first, or the session is refused.
        await asyncio.sleep(self.cooldown_s + 1)
        watcher = asyncio.create_task(self._watch_trials())
        try:
            said = await tuning.fire()
        finally:
            watcher.cancel()
        for row in self._trials():
            self._outcome(f"trial {row.number} ({row.candidate}): {row.state}, {row.verdict}")
        self._outcome(f"tuning {said}")
        flags = next((i.argv for i in self.sidecar.runtime.instances() if i.name == STABLE), None)
        self._outcome(f"stable runs: {_memory_flags(flags or ())}")

    async def _peak_preemptions(self) -> None:
        """The highest counter read while the burst ran (the restart resets it)."""
        self._peak, self._peak_kvpool = 0.0, 0.0
        while True:
            self._peak = max(self._peak, _preemptions(self.sidecar) or 0.0)
            kvpool = _preemptions(self.sidecar, kvpool=True) or 0.0
            self._peak_kvpool = max(self._peak_kvpool, kvpool)
            await asyncio.sleep(POLL_S)

    def _use_ladder(self) -> None:
        rules = self.sidecar.settings.rules  # as the sidecar runs them
        spike = rules.preemption_spike.model_copy(update={"action": "ladder"})
        self.sidecar.use_rules(rules.model_copy(update={"preemption_spike": spike}))
        self._outcome("the VllmPreemptionSpike rule's action is now the ladder (the default)")

    def _trials(self) -> tuple[TrialRow, ...]:
        return trial_rows(SqliteTrialStore(self.sidecar.store.db).trials())

    async def _watch_trials(self) -> None:
        """Each trial's progress in the log as the session goes (the view shows it too)."""
        said: dict[int, str] = {}
        while True:
            for row in self._trials():
                if said.get(row.number) != row.state:
                    said[row.number] = row.state
                    verdict = f", {row.verdict}" if row.verdict else ""
                    log.info(
                        "%s: trial %d (%s): %s%s",
                        self.h.phase,
                        row.number,
                        row.candidate,
                        row.state,
                        verdict,
                    )
            await asyncio.sleep(POLL_S)

    async def _burst_again(self, phase: DemoPhase) -> None:
        await _until("the promoted server", self._scraping, 240)
        before, restarts = _preemptions(self.sidecar) or 0.0, self._remediations()
        since = time.time()
        seen = {"pending": False, "firing": False}

        async def watch() -> None:
            while True:
                state = _spike_state(self.sidecar)
                if state in seen:
                    seen[state] = True
                await asyncio.sleep(POLL_S)

        watcher = asyncio.create_task(watch())
        try:
            await _loop_load(self.url, BURST, asyncio.Event(), repeat=False)
            await asyncio.sleep(self.sidecar.settings.rules.preemption_spike.window_s)
        finally:
            watcher.cancel()
        after = _preemptions(self.sidecar) or 0.0
        if not seen["firing"] and self._remediations() == restarts:
            self._outcome(f"no spike: preemptions {before:.0f} -> {after:.0f}")
        else:
            self._outcome(
                f"spike came ({after - before:.0f} preemptions); "
                f"ladder: {self._ladder_since(since, restarts)}"
            )

    def _remediations(self) -> int:
        return len(self.sidecar.store.remediations(limit=100))

    def _remediation_finished(self) -> bool:
        records = self.sidecar.store.remediations(limit=1)
        return bool(records) and records[0].finished

    def _last_remediation(self) -> str:
        records = self.sidecar.store.remediations(limit=1)
        if not records:
            return "none"
        r = records[0]
        return f"{r.action} {r.state} (pid {r.old_pid} -> {r.new_pid}): {r.reason}"

    def _ladder_since(self, since_wall_s: float, restarts: int) -> str:
        """What the ladder did about this phase's spike: a remediation it ran, else its
        newest decision in the audit (a recommendation), never an earlier phase's."""
        if self._remediations() > restarts:
            return self._last_remediation()
        for record in self.sidecar.store.audit_records(since_wall_s=since_wall_s):
            if record.target == STABLE and record.action not in _NOT_THE_LADDER:
                return f"{record.action} {record.decision}: {record.reason}"
        return "no decision yet"

    def _delivery(self, name: str, status: str) -> str:
        return next(d for d in self.h.deliveries if d.startswith(name) and status in d)


# Audit rows of this phase that are not the ladder's answer to the spike.
_NOT_THE_LADDER = frozenset({"alert", "circuit_breaker", "retune", "tune", "adopt"})


def _memory_flags(argv: tuple[str, ...]) -> str:
    shown = []
    for flag in ("--kv-cache-memory-bytes", "--max-num-seqs"):
        if flag in argv and argv.index(flag) + 1 < len(argv):
            shown.append(f"{flag} {argv[argv.index(flag) + 1]}")
    return " ".join(shown) or "(defaults)"


async def run_demo(settings: DemoSettings) -> list[str]:
    """Plays the scenario; returns the summary's lines (also logged)."""
    if settings.log_file is None:
        return await _run_demo(settings)
    handler = logging.FileHandler(settings.log_file, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for other in logging.getLogger().handlers:  # secret masking, as on the terminal
        for f in other.filters:
            handler.addFilter(f)
    logging.getLogger().addHandler(handler)
    try:
        return await _run_demo(settings)
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()


async def _run_demo(settings: DemoSettings) -> list[str]:
    handles = _Handles()
    secret = secrets.token_hex(WEBHOOK_SECRET_BYTES)

    def received(delivery: Delivery) -> None:
        handles.deliveries.append(delivery.describe())
        log.info("receiver: %s", delivery.describe())

    with tempfile.TemporaryDirectory(prefix="kvpilot-demo-") as state_dir:
        async with WebhookReceiver(secret, on_delivery=received) as receiver:
            server_port = free_port()
            config = validate_config(
                demo_config(
                    listen_port=settings.listen_port,
                    server_port=server_port,
                    kvpool_port=free_kvpool_port(),
                    canary_port=free_port(),
                    state_dir=state_dir,
                    webhook_url=receiver.url,
                    webhook_secret=secret,
                    cpus=(0, 1) if settings.pin_cpus else None,
                    trials=settings.trials,
                )
            )
            view = DemoView() if settings.live_view else None
            panel = view.panel if view is not None else LogPanel()
            if view is None and settings.capture is not None:
                logging.getLogger().addHandler(panel)  # the capture's log panel
            title = f"kvpilot demo: http://127.0.0.1:{server_port}"

            def on_tick(sidecar: Sidecar) -> None:
                handles.sidecar = sidecar
                if view is None and settings.capture is None:
                    return
                handles.last = snapshot_of(
                    sidecar,
                    title=title,
                    phase=handles.phase,
                    deliveries=tuple(handles.deliveries),
                    logs=panel.lines(),
                )
                if view is not None:
                    view.show(handles.last)

            def got_tuning(tuning: ScheduledTuning) -> None:
                handles.tuning = tuning

            def sidecar_to(stop: asyncio.Event) -> Coroutine[object, object, None]:
                return run_sidecar(config, stop=stop, on_tick=on_tick, on_tuning=got_tuning)

            url = f"http://127.0.0.1:{server_port}"
            scenario = Scenario(handles, config.remediation.cooldown_s, url)
            try:
                with view if view is not None else contextlib.nullcontext():
                    await _play(sidecar_to, scenario, handles, settings)
            finally:
                logging.getLogger().removeHandler(panel)
    if settings.capture is not None and handles.last is not None:
        export(handles.last, settings.capture)
        log.info("the view's last screen: %s.txt and .svg", settings.capture)
    for line in handles.outcomes:
        log.info("summary: %s", line)
    return handles.outcomes


async def _play(
    sidecar_to: Callable[[asyncio.Event], Coroutine[object, object, None]],
    scenario: Scenario,
    handles: _Handles,
    settings: DemoSettings,
) -> None:
    """The sidecar (run until `stop`) and the scenario beside it, to the first to end."""
    stop = asyncio.Event()
    sidecar = asyncio.create_task(sidecar_to(stop), name="sidecar")
    script = asyncio.create_task(scenario.play(), name="scenario")
    timer = (
        asyncio.get_running_loop().call_later(settings.duration_s, stop.set)
        if settings.duration_s
        else None
    )
    stopped = asyncio.create_task(stop.wait())
    try:
        done, _ = await asyncio.wait(
            {sidecar, script, stopped}, return_when=asyncio.FIRST_COMPLETED
        )
        if script in done and script.exception() is not None:
            log.error("the scenario failed: %r", script.exception())
        elif stopped in done and script not in done:
            handles.outcomes.append(f"stopped during {handles.phase}")
    finally:
        if timer is not None:
            timer.cancel()
        script.cancel()
        stopped.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await script
        stop.set()
        await sidecar  # its shutdown path stops the servers; an error here is raised
