"""vLLM general plugin (`vllm.general_plugins` entry point `kvpilot_kvpool`).

vLLM calls `register()` in every process it starts (API server, engine core, workers). It
wraps, once per class (a marker attribute makes it idempotent: with fork the patch is
inherited, with spawn `register()` runs again):

* `Scheduler.__init__`: in the engine-core process, attach to the new scheduler and serve
  `kvpool_*` on `KVPILOT_KVPOOL_PORT + data_parallel_rank`.
* `Scheduler._preempt_request`: count preemptions with engine-side timestamps, at once.
* `Scheduler.update_from_output`: the step boundary, where vLLM takes its own stats; a
  pending scrape takes its block-pool snapshot here, so it matches `kv_cache_usage_perc`.
* `Scheduler.schedule`: a step begins; until its `update_from_output` the engine is busy,
  however long the step, and nothing but the engine thread reads the pool.
* `WorkerWrapperBase.init_device`: in a worker (CPU, or one that owns a CUDA device), serve
  its memory ledger and caching allocator on `KVPILOT_KVPOOL_PORT + 100 + slot` (the
  node-local slot, DP-local rank * local world size + rank on the node, so DP engines and
  workers never collide); the engine core publishes its workers' ports (`worker_ports`).

Nothing here raises into vLLM: a failing part logs one line, counts
`kvpool_plugin_errors_total{part}` and stops doing that part.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from kvpilot.collectors.kvpool.blocks import BlockPoolSnapshot, snapshot
from kvpilot.collectors.kvpool.ledger import MemoryLedger
from kvpilot.collectors.kvpool.ledger_families import LedgerCollector
from kvpilot.collectors.kvpool.ledger_reader import (
    GRAPH_BYTES_ATTR,
    pool_blocks,
    read_cpu_ledger,
    read_cuda_ledger,
)
from kvpilot.collectors.kvpool.listen_address import DEFAULT_HOST, HOST_ENV, PORT_ENV
from kvpilot.collectors.kvpool.occupancy_export import OccupancyCollector
from kvpilot.collectors.kvpool.server import (
    AllocatorReading,
    EngineReading,
    PartErrors,
    RunningServer,
    serve,
)
from kvpilot.collectors.kvpool.worker_ports import (
    WorkerPortCollector,
    engine_worker_ports,
    worker_port,
)

log = logging.getLogger("kvpilot.kvpool")

MARKER = "_kvpilot_kvpool_wrapped"
HANDLE_ATTR = "_kvpilot_kvpool_engine"


class EngineHandle:
    """One scheduler's counters and its step-boundary snapshot exchange.

    Thread contract: `on_step_end` and `on_preempt` run on the engine thread; `reading`
    runs on the HTTP thread. A scrape raises a flag and waits (up to `wait_s`) for the
    engine thread to snapshot at its next step boundary, where vLLM takes its own stats;
    when the engine has not stepped for `idle_after_s` the scrape reads the pool itself,
    which is safe while nothing is scheduled.

    What scrapes cost the engine is bounded: a snapshot younger than `min_interval_s` is
    served again (scrape as often as you like: at most one pool pass per interval runs on
    the engine thread), concurrent scrapes share one pass, and a busy engine that does not
    answer in time gets no pass from another thread: the latest snapshot is served, its
    age exported. The engine thread's time in passes is counted (`snapshot_seconds_total`).
    """

    def __init__(
        self,
        scheduler: object,
        *,
        engine: str,
        model_name: str,
        errors: PartErrors,
        clock: Callable[[], float],
        wall_clock: Callable[[], float],
        wait_s: float = 0.5,
        idle_after_s: float = 0.2,
        min_interval_s: float = 1.0,
        worker_ports: tuple[tuple[int, int], ...] = (),
    ) -> None:
        self._scheduler = weakref.ref(scheduler)
        self.worker_ports = worker_ports  # published, so the agent reads the workers' ledgers
        self.engine = engine
        self.model_name = model_name
        self._errors = errors
        self._clock = clock
        self._wall_clock = wall_clock
        self._wait_s = wait_s
        self._idle_after_s = idle_after_s
        self._min_interval_s = min_interval_s
        self.snapshots_total = 0  # pool passes on the engine thread
        self.snapshot_seconds_total = 0.0  # and the engine thread's time in them
        self.preemptions_total = 0
        self.last_preemption_s: float | None = None
        self.last_preemption_wall_s: float | None = None
        self.steps_total = 0
        self.last_step_s: float | None = None
        self._steps_open = 0  # schedule() calls not yet answered by update_from_output()
        self._wanted = False
        self._cond = threading.Condition()
        self._generation = 0
        self._latest: BlockPoolSnapshot | None = None
        self._blocks_failed = False

    @property
    def alive(self) -> bool:
        return self._scheduler() is not None

    def pool_blocks(self) -> tuple[int, int] | None:
        """(blocks including the null block, free blocks): two counters, safe from any thread."""
        kv_manager = getattr(self._scheduler(), "kv_cache_manager", None)
        return pool_blocks(getattr(kv_manager, "block_pool", None))

    def on_preempt(self) -> None:
        """Engine thread, right after a request was preempted."""
        try:
            self.preemptions_total += 1
            self.last_preemption_s = self._clock()
            self.last_preemption_wall_s = self._wall_clock()
        except Exception as exc:
            self._errors.record("preemptions", exc)

    def on_step_start(self) -> None:
        """Engine thread, after `schedule`: a step is under way."""
        self._steps_open += 1

    def on_step_end(self) -> None:
        """Engine thread, after `update_from_output`: a flag check unless a scrape waits."""
        self._steps_open = max(0, self._steps_open - 1)
        self.steps_total += 1
        self.last_step_s = self._clock()
        if not self._wanted:
            return
        started = time.perf_counter()
        taken = self._take()
        self.snapshot_seconds_total += time.perf_counter() - started
        self.snapshots_total += 1
        with self._cond:
            self._latest = taken
            self._wanted = False
            self._generation += 1
            self._cond.notify_all()

    def _take(self) -> BlockPoolSnapshot | None:
        scheduler = self._scheduler()
        if scheduler is None or self._blocks_failed:
            return None
        try:
            return snapshot(scheduler, taken_at_s=self._clock(), wall_time_s=self._wall_clock())
        except Exception as exc:
            # A pool we cannot read stays unread: one log line, not one per scrape.
            self._blocks_failed = True
            self._errors.record("blocks", exc)
            return None

    def _snapshot_for_scrape(self) -> BlockPoolSnapshot | None:
        now = self._clock()
        latest = self._latest
        if latest is not None and now - latest.taken_at_s < self._min_interval_s:
            return latest  # fresh enough: the engine does nothing for this scrape
        last_step_s = self.last_step_s
        idle = last_step_s is None or now - last_step_s > self._idle_after_s
        if idle and self._steps_open == 0:
            taken = self._take()  # idle: nothing moves the pool while it is read
            with self._cond:
                self._latest = taken if taken is not None else self._latest
            return taken
        with self._cond:
            generation = self._generation
            self._wanted = True  # concurrent scrapes raise one flag and share one pass
            answered = self._cond.wait_for(
                lambda: self._generation != generation, timeout=self._wait_s
            )
            if not answered:
                self._wanted = False
            # Busy and slow to answer: the latest snapshot, never a read racing the engine.
            return self._latest

    def reading(self) -> EngineReading:
        """HTTP thread: this engine's figures, the snapshot taken at a step boundary if busy."""
        return EngineReading(
            engine=self.engine,
            model_name=self.model_name,
            snapshot=self._snapshot_for_scrape(),
            preemptions_total=self.preemptions_total,
            last_preemption_wall_s=self.last_preemption_wall_s,
            scheduler_steps_total=self.steps_total,
            engine_snapshots_total=self.snapshots_total,
            engine_snapshot_seconds_total=self.snapshot_seconds_total,
            worker_ports=self.worker_ports,
        )


class PluginCollector(OccupancyCollector, WorkerPortCollector, LedgerCollector):
    """Every family the plugin serves: block pool, token occupancy, workers' ports, memory
    ledger."""


class PluginState:
    """Everything the plugin holds in one process; one HTTP server per port."""

    def __init__(self, *, host: str, base_port: int) -> None:
        self.host = host
        self.base_port = base_port
        self.errors = PartErrors()
        self.clock: Callable[[], float] = time.monotonic
        self.wall_clock: Callable[[], float] = time.time
        self.engines: list[EngineHandle] = []
        self.allocator_devices: list[tuple[str, int]] = []
        # Workers in this process for the memory ledger: rank, worker, CUDA index (None: CPU).
        self.ledger_workers: list[tuple[str, weakref.ref[object], int | None]] = []
        self.servers: dict[int, RunningServer] = {}
        self._lock = threading.Lock()

    def engine_readings(self, engine: str) -> list[EngineReading]:
        # A scheduler that is gone (engine rebuilt in-process) drops out of the exposition.
        self.engines = [handle for handle in self.engines if handle.alive]
        return [handle.reading() for handle in self.engines if handle.engine == engine]

    def allocator_readings(self) -> list[AllocatorReading]:
        from kvpilot.collectors.kvpool.allocator import read_allocator_stats

        readings = []
        for rank, device in list(self.allocator_devices):
            try:
                stats = read_allocator_stats(device, clock=self.clock, wall_clock=self.wall_clock)
            except Exception as exc:
                self.errors.record("allocator", exc)
                continue
            readings.append(AllocatorReading(rank=rank, stats=stats))
        return readings

    def ledger_readings(self) -> list[MemoryLedger]:
        """Ledgers of this process's workers, served on each port of the process: the worker's
        own port (`ALLOCATOR_PORT_OFFSET`), and the engine's when the worker runs beside the
        scheduler (one GPU, uni-process executor), where the agent scrapes it. With the
        multiprocess executor (CPU always) the engine process holds no worker."""
        pools = [handle.pool_blocks() for handle in self.engines if handle.alive]
        blocks = next((found for found in pools if found is not None), None)
        ledgers = []
        for rank, ref, device in list(self.ledger_workers):
            worker = ref()
            if worker is None:
                continue
            try:
                if device is None:
                    ledgers.append(read_cpu_ledger(worker, rank=rank, blocks=blocks))
                else:
                    ledgers.append(
                        read_cuda_ledger(worker, device=device, rank=rank, blocks=blocks)
                    )
            except Exception as exc:
                self.errors.record("ledger", exc)
        return ledgers

    def ensure_server(self, port: int, *, engine: str | None, allocators: bool) -> None:
        """Start the server for `port` once; a taken port disables it with one log line."""
        with self._lock:
            if port in self.servers:
                return
            collector = PluginCollector(
                engines=functools.partial(self.engine_readings, engine) if engine else list,
                allocators=self.allocator_readings if allocators else list,
                ledgers=self.ledger_readings,
                errors=self.errors,
                clock=self.clock,
            )
            try:
                self.servers[port] = serve(collector, self.host, port)
            except Exception as exc:
                self.errors.record("server", exc)
                return
        log.info("kvpool: serving kvpool_* metrics on %s:%d", self.host, port)

    def close(self) -> None:
        """Stop every server (tests; in vLLM the daemon threads end with the process)."""
        with self._lock:
            servers, self.servers = list(self.servers.values()), {}
        for server in servers:
            server.close()


_state: PluginState | None = None


def state() -> PluginState | None:
    """This process's plugin state, or None when the plugin is idle here."""
    return _state


def _read_config() -> tuple[str, int] | None:
    raw = os.environ.get(PORT_ENV, "").strip()
    if not raw:
        return None
    port = int(raw)
    if not 0 < port < 65536:
        raise ValueError(f"{PORT_ENV}={raw} is not a TCP port")
    return os.environ.get(HOST_ENV, "").strip() or DEFAULT_HOST, port


def register() -> None:
    """vLLM's entry point: wrap the scheduler and worker classes once; never raises."""
    global _state
    try:
        config = _read_config()
    except Exception as exc:
        log.warning("kvpool: bad configuration, plugin idle: %s", exc)
        return
    if config is None:
        log.info("kvpool: %s is not set; plugin idle in this process", PORT_ENV)
        return
    if _state is None:
        _state = PluginState(host=config[0], base_port=config[1])
    current = _state
    for part, patch in (("scheduler_patch", _patch_scheduler), ("worker_patch", _patch_worker)):
        try:
            patch(current)
        except Exception as exc:
            current.errors.record(part, exc)


Method = Callable[..., Any]


def _wrap_once(cls: type, name: str, make: Callable[[Method], Method]) -> None:
    original = cls.__dict__.get(name)
    if original is None or getattr(original, MARKER, False):
        return
    wrapper = functools.wraps(original)(make(original))
    setattr(wrapper, MARKER, True)
    setattr(cls, name, wrapper)


def _patch_scheduler(current: PluginState) -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    patch_scheduler_class(Scheduler, current)


def patch_scheduler_class(cls: type, current: PluginState) -> None:
    """Wrap `__init__`, `_preempt_request`, `update_from_output` and `schedule` of `cls` once."""

    def make_init(original: Method) -> Method:
        def __init__(self: object, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            try:
                _attach(self, _state or current)
            except Exception as exc:
                (_state or current).errors.record("attach", exc)

        return __init__

    def make_preempt(original: Method) -> Method:
        def _preempt_request(self: object, *args: Any, **kwargs: Any) -> Any:
            result = original(self, *args, **kwargs)
            handle = getattr(self, HANDLE_ATTR, None)
            if handle is not None:
                handle.on_preempt()
            return result

        return _preempt_request

    def make_schedule(original: Method) -> Method:
        def schedule(self: object, *args: Any, **kwargs: Any) -> Any:
            result = original(self, *args, **kwargs)
            handle = getattr(self, HANDLE_ATTR, None)
            if handle is not None:
                handle.on_step_start()
            return result

        return schedule

    def make_update(original: Method) -> Method:
        def update_from_output(self: object, *args: Any, **kwargs: Any) -> Any:
            result = original(self, *args, **kwargs)
            handle = getattr(self, HANDLE_ATTR, None)
            if handle is not None:
                handle.on_step_end()
            return result

        return update_from_output

    _wrap_once(cls, "__init__", make_init)
    _wrap_once(cls, "_preempt_request", make_preempt)
    _wrap_once(cls, "update_from_output", make_update)
    _wrap_once(cls, "schedule", make_schedule)


def _attach(scheduler: object, current: PluginState) -> None:
    """Attach a handle to a new scheduler and serve its engine's port."""
    vllm_config = getattr(scheduler, "vllm_config", None)
    parallel = getattr(vllm_config, "parallel_config", None)
    dp_rank = getattr(parallel, "data_parallel_rank", 0)
    dp_rank = dp_rank if isinstance(dp_rank, int) and dp_rank >= 0 else 0
    model_config = getattr(vllm_config, "model_config", None)
    served = getattr(model_config, "served_model_name", None) or getattr(model_config, "model", "")
    model_name = served[0] if isinstance(served, list | tuple) and served else str(served or "")
    handle = EngineHandle(
        scheduler,
        engine=str(dp_rank),
        model_name=model_name,
        errors=current.errors,
        clock=current.clock,
        wall_clock=current.wall_clock,
        worker_ports=engine_worker_ports(current.base_port, parallel),
    )
    setattr(scheduler, HANDLE_ATTR, handle)
    current.engines.append(handle)
    current.ensure_server(current.base_port + dp_rank, engine=str(dp_rank), allocators=False)


def _patch_worker(current: PluginState) -> None:
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    def make_init_device(original: Method) -> Method:
        def init_device(self: object, *args: Any, **kwargs: Any) -> Any:
            result = original(self, *args, **kwargs)
            try:
                _attach_ledger(getattr(self, "worker", None), _state or current)
            except Exception as exc:
                (_state or current).errors.record("ledger_attach", exc)
            try:
                _attach_allocator(getattr(self, "worker", None), _state or current)
            except Exception as exc:
                (_state or current).errors.record("allocator_attach", exc)
            return result

        return init_device

    _wrap_once(WorkerWrapperBase, "init_device", make_init_device)


def _patch_graph_capture(current: PluginState) -> None:
    """Keep what `capture_model()` returns (the graphs' bytes) on the runner: vLLM logs it
    once and keeps it nowhere. Patched from a CUDA worker's `init_device`, before capture,
    so no other process imports the GPU runner."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    runners: list[type] = [GPUModelRunner]
    try:
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner as RunnerV2

        runners.append(RunnerV2)
    except Exception as exc:
        current.errors.record("graph_patch_v2", exc)

    def make_capture(original: Method) -> Method:
        def capture_model(self: object, *args: Any, **kwargs: Any) -> Any:
            result = original(self, *args, **kwargs)
            if isinstance(result, int) and not kwargs.get("profile_only", False):
                setattr(self, GRAPH_BYTES_ATTR, result)
            return result

        return capture_model

    for runner in runners:
        _wrap_once(runner, "capture_model", make_capture)


def _attach_ledger(worker: object, current: PluginState) -> None:
    """Remember a worker whose memory this process can read (CPU, or its CUDA device)."""
    device = getattr(worker, "device", None)
    kind = getattr(device, "type", None)
    index = getattr(device, "index", None)
    rank = str(getattr(worker, "rank", getattr(worker, "local_rank", 0)))
    if kind == "cpu":
        current.ledger_workers.append((rank, weakref.ref(worker), None))
        current.ensure_server(_worker_port(worker, current), engine=None, allocators=False)
    elif kind == "cuda" and isinstance(index, int):
        current.ledger_workers.append((rank, weakref.ref(worker), index))
        _patch_graph_capture(current)


def _attach_allocator(worker: object, current: PluginState) -> None:
    """Serve the allocator of the worker's CUDA device, if it has one."""
    device = getattr(worker, "device", None)
    if getattr(device, "type", None) != "cuda":
        return
    index = getattr(device, "index", None)
    if not isinstance(index, int):
        return
    current.allocator_devices.append((str(getattr(worker, "rank", 0)), index))
    current.ensure_server(_worker_port(worker, current), engine=None, allocators=True)


def _worker_port(worker: object, current: PluginState) -> int:
    """The worker's own port: the one its engine core computes and publishes for it."""
    rank = getattr(worker, "rank", 0)
    rank = rank if isinstance(rank, int) and rank >= 0 else 0
    return worker_port(current.base_port, getattr(worker, "parallel_config", None), rank)
