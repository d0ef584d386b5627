"""Wiring for the tuner: a runtime adapter over the local runtime, the load observer, the
stores on the state database, start-up recovery, and the plain values `/metrics` exports.

Promoted flags win over the YAML's engine flags until the YAML itself changes: a promotion is
stored as a fact with the YAML's hash, and `live_stable_argv` applies it only while the hash
still matches.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import os
import signal
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvpilot.agent.runtimes.base import RuntimeFailure
from kvpilot.agent.runtimes.local import LocalInstanceSpec, LocalRuntime
from kvpilot.agent.runtimes.procfs import find_vllm_mains, list_processes
from kvpilot.agent.state.db import Database
from kvpilot.agent.state.trials import SqliteRolloutJournal, SqliteTrialStore
from kvpilot.collectors.vllm_argv import set_flag
from kvpilot.collectors.vllm_metrics import VllmMetricsSource, VllmScrape
from kvpilot.rig.loadgen import LoadReport, Workload, run_load
from kvpilot.rig.server import live_group_members
from kvpilot.tuner.objective import Measurement, Slo, best_index
from kvpilot.tuner.ports import CandidateStartFailed, Observation, RestartRefused
from kvpilot.tuner.rollout import Phase, Recovered, RolloutRecord, recover
from kvpilot.tuner.trials import Trial, TrialState

PROMOTED_FACT = "tuning.promoted"
CANARY_NAME = "canary"
_START_HEADER = "===== kvpilot: start #"

# Restarts the stable instance with (argv, reason, restore); raises RestartRefused when its
# guards say no and RuntimeFailure when the server does not come back.
StableRestarter = Callable[[tuple[str, ...], str, bool], Awaitable[None]]


def yaml_hash(path: Path) -> str:
    """sha256 of the configuration file's bytes: a promotion holds while it is unchanged."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def live_stable_argv(
    configured: Sequence[str], promoted: dict | None, current_yaml_hash: str
) -> tuple[tuple[str, ...], str]:
    """The stable flags to run and why: ("promoted ...") when a promotion holds, else configured."""
    if promoted and promoted.get("yaml_sha256") == current_yaml_hash:
        return tuple(promoted["argv"]), f"promoted ({promoted.get('reason', 'by the tuner')})"
    if promoted:
        return tuple(configured), "configured (the YAML changed since the last promotion)"
    return tuple(configured), "configured"


class LocalTunerAdapter:
    """The tuner's TunerRuntime over a LocalRuntime: the canary is a second local instance."""

    def __init__(
        self,
        runtime: LocalRuntime,
        *,
        stable_name: str,
        canary_port: int,
        log_dir: Path,
        db: Database,
        configured_argv: Sequence[str],
        config_sha256: str,
        canary_env: Sequence[tuple[str, str]] = (),
        canary_cpus: Sequence[int] = (),
        drain_timeout_s: float = 10.0,
        remediation_in_progress: Callable[[], bool] = lambda: False,
        restart_stable: StableRestarter | None = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._runtime = runtime
        self._stable = stable_name
        self._canary_port = canary_port
        self._log_dir = log_dir
        self._db = db
        self._configured = tuple(configured_argv)
        self._sha = config_sha256
        self._canary_env = tuple(canary_env)
        self._canary_cpus = tuple(canary_cpus)
        self._drain_s = drain_timeout_s
        self._remediating = remediation_in_progress
        self._restart_stable = restart_stable
        self._wall = wall_clock
        self._canary: LocalRuntime | None = None
        self.last_trial_number: int | None = None

    def stable_argv(self) -> tuple[str, ...]:
        for instance in self._runtime.instances():
            if instance.name == self._stable:
                return tuple(instance.argv)
        raise RuntimeFailure(f"no stable instance {self._stable!r}")

    def stable_url(self) -> str:
        return next(i.url for i in self._runtime.instances() if i.name == self._stable)

    def canary_url(self) -> str:
        return f"http://127.0.0.1:{self._canary_port}"

    async def start_canary(self, argv: Sequence[str], *, ready_timeout_s: float) -> str:
        # The stable's environment (offline mode, thread binding), never its plugin port.
        spec = LocalInstanceSpec(
            CANARY_NAME, set_flag(argv, "--port", self._canary_port), "canary", self._canary_env,
            cpus=self._canary_cpus,
        )  # fmt: skip
        self._canary = LocalRuntime([spec], self._log_dir)
        try:
            await self._canary.start(CANARY_NAME, ready_timeout_s=ready_timeout_s)
        except RuntimeFailure as exc:
            raise CandidateStartFailed(
                str(exc), _last_start(self._canary.log_path(CANARY_NAME))
            ) from exc
        return self.canary_url()

    async def stop_canary(self) -> None:
        if self._canary is not None:
            await self._canary.stop(CANARY_NAME, drain_timeout_s=self._drain_s)
            self._canary = None
        await kill_servers_on_port(self._canary_port)  # one a dead kvpilot left behind

    async def set_stable(
        self, argv: Sequence[str], *, reason: str, ready_timeout_s: float, restore: bool = False
    ) -> None:
        """Restart the stable instance with `argv`: through `restart_stable` (the agent's
        remediator, with its guards) when given, else straight through the runtime (an
        operator's `kvpilot tune`). A refusal changes nothing and is not recorded."""
        try:
            if self._restart_stable is not None:
                await self._restart_stable(tuple(argv), reason, restore)
            else:
                await self._runtime.restart(
                    self._stable, drain_timeout_s=self._drain_s, ready_timeout_s=ready_timeout_s,
                    argv=argv,
                )  # fmt: skip
        except RestartRefused:
            raise
        except RuntimeFailure as exc:
            log = _last_start(self._runtime.log_path(self._stable))
            raise CandidateStartFailed(str(exc), log) from exc
        finally:
            self._record(tuple(argv), reason)

    def _record(self, argv: tuple[str, ...], reason: str) -> None:
        from kvpilot.agent.state.store import StateStore

        store = StateStore(self._db)
        if argv == self._configured:
            store.delete_fact(PROMOTED_FACT)
        else:
            fact = {"argv": list(argv), "yaml_sha256": self._sha, "reason": reason}
            store.set_fact(PROMOTED_FACT, fact, self._wall())

    def remediation_in_progress(self) -> bool:
        return self._remediating()


async def kill_servers_on_port(port: int, deadline_s: float = 30.0) -> list[int]:
    """SIGKILL the process group of every vLLM server listening on `port`; returns the PIDs."""
    killed = []
    for info in find_vllm_mains(list_processes(), port=port):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(info.pgid, signal.SIGKILL)
        killed.append(info.pid)
        loop = asyncio.get_running_loop()
        end = loop.time() + deadline_s
        # Polls /proc: nothing signals the end of a process group that is not our child.
        while live_group_members(info.pgid) and loop.time() < end:  # noqa: ASYNC110
            await asyncio.sleep(0.2)
    return killed


def _last_start(path: Path) -> str:
    """The log of the last start only (earlier starts' errors are not this one's reason)."""
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return ""
    return text[text.rfind(_START_HEADER) :] if _START_HEADER in text else text


class LoadObserver:
    """The Observer over the shared load generator, with /metrics scraped during the window."""

    def __init__(
        self,
        workload: Workload,
        *,
        model: str,
        warm_requests: int = 2,
        scrape_interval_s: float = 0.25,  # short windows still give the judge a dozen scrapes
        api_key: str | None = None,
    ) -> None:
        self._workload = workload
        self._model = model
        self._warm = warm_requests
        self._interval_s = scrape_interval_s
        self._api_key = api_key

    async def warm(self, urls: Sequence[str]) -> None:
        from dataclasses import replace

        small = replace(
            self._workload, num_requests=self._warm, concurrency=self._warm, rate_rps=None
        )
        await asyncio.gather(
            *(run_load(u, small, model=self._model, api_key=self._api_key) for u in urls)
        )

    async def observe(self, urls: Sequence[str]) -> tuple[Observation, ...]:
        async with httpx.AsyncClient() as client:
            return tuple(await asyncio.gather(*(self._one(client, u) for u in urls)))

    async def _one(self, client: httpx.AsyncClient, url: str) -> Observation:
        source = VllmMetricsSource(url, client=client, api_key=self._api_key)
        scrapes: list[VllmScrape] = []
        done = asyncio.Event()

        async def scrape_until_done() -> None:
            while True:
                got = await source.scrape()
                if isinstance(got, VllmScrape):
                    scrapes.append(got)
                if done.is_set():
                    return
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(done.wait(), self._interval_s)

        scraper = asyncio.create_task(scrape_until_done())
        try:
            report = await run_load(url, self._workload, model=self._model, api_key=self._api_key)
        finally:
            done.set()
            await scraper
        return Observation(
            url, Measurement(report=report, scrapes=tuple(scrapes)), samples(report, scrapes)
        )


def samples(report: LoadReport, scrapes: Sequence[VllmScrape]) -> dict[str, tuple[float, ...]]:
    """The judge's samples: per-request latencies and errors, per-interval preemptions and KV."""
    out: dict[str, tuple[float, ...]] = {
        "ttft_s": tuple(report.ttfts_s()),
        "inter_token_s": tuple(report.inter_tokens_s()),
        "e2e_s": tuple(report.e2es_s()),
        "errors_ratio": tuple(0.0 if r.ok else 1.0 for r in report.results),
    }
    rates, usage = [], []
    for a, b in itertools.pairwise(scrapes):
        span = b.taken_at_s - a.taken_at_s
        pa = _sum(e.preemptions_total for e in a.engines)
        pb = _sum(e.preemptions_total for e in b.engines)
        if span > 0 and pa is not None and pb is not None:
            rates.append(max(0.0, pb - pa) / span)  # a reset counts as no preemption
    for scrape in scrapes:
        u = [e.kv_usage_ratio for e in scrape.engines if e.kv_usage_ratio is not None]
        if u:
            usage.append(max(u))
    out["preemptions_per_s"] = tuple(rates)
    out["kv_usage_ratio"] = tuple(usage)
    return out


def _sum(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def open_stores(state_dir: Path) -> tuple[Database, SqliteTrialStore, SqliteRolloutJournal]:
    """The state database with the trial store and rollout journal on it."""
    db = Database.open(state_dir)
    return db, SqliteTrialStore(db), SqliteRolloutJournal(db)


async def recover_at_startup(
    db: Database, adapter: LocalTunerAdapter, *, wall_clock: Callable[[], float] = time.time
) -> list[Recovered]:
    """A trial left running by a dead kvpilot: stop its canary, keep or restore the stable
    flags, record it aborted. Returns what was recovered."""
    return await recover(
        SqliteRolloutJournal(db), SqliteTrialStore(db), adapter, at_wall_s=wall_clock()
    )


# --- what /metrics and dashboards export ---------------------------------------------


@dataclass(frozen=True, slots=True)
class TrialView:
    """One finished trial, as exported."""

    number: int
    state: str
    verdict: str | None  # the judge's classification; None when it was never judged
    rollout_phase: str | None
    goodput_tokens_per_s: float | None
    preemptions_per_request: float | None
    flags: tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class MetricComparison:
    """Canary and baseline medians of one judged metric of the latest judged trial."""

    trial_number: int
    metric: str
    verdict: str
    canary_median: float | None
    baseline_median: float | None


@dataclass(frozen=True, slots=True)
class TuningView:
    """The tuner's state as plain values for the agent's /metrics."""

    trials: tuple[TrialView, ...]
    best_goodput_tokens_per_s: float | None
    stable_flags: tuple[str, ...]
    stable_flags_source: str  # "configured" or "promoted"
    stable_flags_reason: str
    comparisons: tuple[MetricComparison, ...]


def tuning_view(
    trials: Sequence[Trial],
    records: Sequence[RolloutRecord],
    *,
    configured_argv: Sequence[str],
    promoted_fact: dict | None,
    config_sha256: str,
    slo: Slo,
) -> TuningView:
    """The view of finished trials, the best goodput, the live flags and the last canary."""
    phases = {r.trial_id: r.phase for r in records}
    finished = [t for t in trials if t.state.terminal]
    views = tuple(
        TrialView(
            number=t.number,
            state=t.state.value,
            verdict=t.judgement.classification.value if t.judgement else None,
            rollout_phase=phases[t.trial_id].value if t.trial_id in phases else None,
            goodput_tokens_per_s=t.result.goodput_tokens_per_s if t.result else None,
            preemptions_per_request=(
                t.result.metrics.preemptions_per_request if t.result and t.result.metrics else None
            ),
            flags=tuple((k, str(v)) for k, v in t.values),
        )
        for t in finished
    )
    results = [
        t.result for t in finished if t.result is not None and t.state is TrialState.COMPLETE
    ]
    best = best_index(results, slo)
    argv, reason = live_stable_argv(configured_argv, promoted_fact, config_sha256)
    judged = [t for t in finished if t.judgement is not None]
    comparisons: tuple[MetricComparison, ...] = ()
    if judged:
        last = judged[-1]
        assert last.judgement is not None
        comparisons = tuple(
            MetricComparison(
                last.number, m.name, m.verdict.value, m.canary_median, m.baseline_median
            )
            for m in last.judgement.metrics
        )
    return TuningView(
        trials=views,
        best_goodput_tokens_per_s=None if best is None else results[best].goodput_tokens_per_s,
        stable_flags=argv,
        stable_flags_source="promoted" if reason.startswith("promoted") else "configured",
        stable_flags_reason=reason,
        comparisons=comparisons,
    )


__all__ = [
    "LoadObserver",
    "LocalTunerAdapter",
    "MetricComparison",
    "Phase",
    "TrialView",
    "TuningView",
    "kill_servers_on_port",
    "live_stable_argv",
    "open_stores",
    "recover_at_startup",
    "samples",
    "tuning_view",
    "yaml_hash",
]
