"""Tuning of a server kvpilot starts on this machine: the canary beside it on the local
runtime, its study from the configured flags, its recovery the abort of a trial a dead
kvpilot left open. One machine has one tuner (no Lease to take)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable

from kvpilot.agent.config.tuning import TuningConfig
from kvpilot.agent.runtimes.device_memory import server_device_memory_bytes
from kvpilot.agent.runtimes.local import LocalRuntime
from kvpilot.agent.state.db import Database
from kvpilot.agent.tuning.entry import Recovery, ShowProgress
from kvpilot.agent.tuning.local.adapter import LocalTunerAdapter, recover_at_startup
from kvpilot.agent.tuning.server import TunedServer
from kvpilot.agent.tuning.study import Study, build_study, make_session, read_gpu
from kvpilot.agent.tuning.workload.choice import WorkloadChoice
from kvpilot.tuner.session import TuningSession


class LocalTuner:
    """The `Tuner` of the local runtime's stable server. `vllm_version` reads its vLLM
    version (part of the fingerprint; None while unknown), `workload` what a run replays
    (the learned workload once its window is full; None: the configured one)."""

    start_wait_s = 0.0

    def __init__(
        self,
        server: TunedServer,
        runtime: LocalRuntime,
        adapter: LocalTunerAdapter,
        db: Database,
        *,
        tuning: TuningConfig,
        api_key: str | None = None,
        vllm_version: Callable[[], str | None] = lambda: None,
        workload: Callable[[], WorkloadChoice | None] = lambda: None,
    ) -> None:
        self.server = server
        self.runtime = runtime
        self.adapter = adapter
        self.tuning = tuning
        self._db = db
        self._api_key = api_key
        self._vllm_version = vllm_version
        self._workload = workload

    @property
    def name(self) -> str:
        return self.server.name

    async def study(self, tuning: TuningConfig | None = None) -> Study:
        # The stable server's own GPU memory is room for the search (a promotion restarts it).
        pids = frozenset(
            pid for i in self.runtime.instances() if i.name == self.name for pid in i.pids
        )
        return build_study(
            self.server,
            tuning or self.tuning,
            read_gpu(pids),
            vllm_version=self._vllm_version(),
            chosen=self._workload(),
        )

    @contextlib.asynccontextmanager
    async def lease(self, *, wait_s: float = 0.0) -> AsyncIterator[None]:
        yield  # one machine, one tuner: nothing to take

    async def recover(self, study: Study) -> Recovery:
        return Recovery(recovered=tuple(await recover_at_startup(self._db, self.adapter)))

    def session(self, study: Study, *, on_progress: ShowProgress | None = None) -> TuningSession:
        return make_session(
            study,
            self.adapter,
            self._db,
            device_memory=server_device_memory_bytes,
            api_key=self._api_key,
            on_progress=on_progress,
        )

    def stable_argv(self) -> tuple[str, ...]:
        return self.adapter.stable_argv()

    def hand_over(self) -> None:
        """Nothing is handed over: a rollout under way undoes itself as its task ends."""
