"""The pod runtime: the Kubernetes runtime as the sidecar in vLLM's pod runs it.

The sidecar reads its instances on every tick. The Kubernetes runtime reads them from the API
server (the stable Deployment, its pods, the canary); when the API server does not answer or
refuses, collecting, alerting and restarting vLLM by signal must go on: the stable instance
then comes from the process runtime alone (the pod's own vLLM, found in /proc), and the
failure is logged once per outage. Every change (a canary, a promotion) still goes through
the API, and fails there; so does every read the tuner makes (`strict_reads`): its
decisions are never made on the process's view.

Reading the API server on every tick (each second) would cost a fleet three reads per pod per
second; so outside strict reads the API's view is reused for `api_read_interval_s`, with the
stable's PIDs refreshed from the pod's processes on every tick (a restart by signal changes
them), and dropped at once after any change this runtime makes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Iterator, Sequence
from contextvars import ContextVar

from kvpilot.agent.model import Instance
from kvpilot.agent.runtimes.base import RuntimeFailure, StopResult
from kvpilot.agent.runtimes.kubernetes.api import deadline
from kvpilot.agent.runtimes.kubernetes.fleet.gate import FleetGate
from kvpilot.agent.runtimes.kubernetes.handover_configmap import HandoverConfigMap
from kvpilot.agent.runtimes.kubernetes.runtime import KubernetesRuntime
from kvpilot.agent.runtimes.kubernetes.values import Promotion
from kvpilot.tuner.oom import container_termination_reason

log = logging.getLogger(__name__)

_STRICT: ContextVar[bool] = ContextVar("kvpilot_pod_strict_reads", default=False)
# The fleet's budget is 0.2 API requests a second a sidecar at steady state: this view's
# three reads every 120 s (0.025), the live switch's 0.133 and the kept vetoes' 0.017.
API_READ_INTERVAL_S = 120.0
# A read made on the event loop itself (the OOM guard's, the status API's) stops it while it
# waits: briefly, then (see `_recently_failed`) not at all while the API server fails.
ON_LOOP_DEADLINE_S = (0.5, 1.0)


def _loop_deadline() -> contextlib.AbstractContextManager[None]:
    """ON_LOOP_DEADLINE_S for calls made on a running event loop's thread; else as usual."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # a worker thread: the usual deadline, the loop goes on meanwhile
        return contextlib.nullcontext()
    return deadline(ON_LOOP_DEADLINE_S)


@contextlib.contextmanager
def strict_reads() -> Iterator[None]:
    """Within this block (and the tasks and threads started in it) the pod runtime's reads
    fail when the API server does: the tuner's reads."""
    token = _STRICT.set(True)
    try:
        yield
    finally:
        _STRICT.reset(token)


class PodRuntime(KubernetesRuntime):
    """A KubernetesRuntime whose instances fall back to the pod's own vLLM process while the
    API server fails; `api_failures_total` counts the reads that fell back."""

    api_failures_total = 0
    _failing: str | None = None
    # Set where kubernetes.handover is `configmap` (several replicas).
    handover_map: HandoverConfigMap | None = None
    # The Deployment's restart budget: every restart of the stable waits for its turn.
    restart_gate: FleetGate | None = None

    def record_decision(self, reason: str, message: str) -> None:
        """The decision as an Event on this pod and its Deployment (a refused Event is
        logged, never raised)."""
        if self.restart_gate is not None:
            self.restart_gate.events.record(reason, message)

    api_read_interval_s = 0.0  # build_pod_runtime sets API_READ_INTERVAL_S
    api_reads_total = 0
    _view: tuple[float, tuple[Instance, ...]] | None = None

    _failed_at_s: float | None = None
    _reading_since: float | None = None  # a tick's API read under way since

    def instances(self) -> tuple[Instance, ...]:
        if not _STRICT.get() and self._view is not None:
            read_at_s, view = self._view
            if self._clock() - read_at_s < self.api_read_interval_s:
                return self._with_local_pids(view)
        local_now = self._while_failing()
        if local_now is not None:
            return (local_now,)
        try:
            self.api_reads_total += 1
            self._reading_since = self._clock()
            with _loop_deadline():
                found = super().instances()
        except RuntimeFailure as exc:
            if _STRICT.get():
                raise
            self.api_failures_total += 1
            if self._failing is None:
                log.warning(
                    "the API server failed (%s): the stable instance is read from "
                    "the pod's processes until it answers",
                    exc,
                )
            self._failing = str(exc)
            self._failed_at_s = self._clock()
            local = self._local_stable()
            if local is None:
                raise
            return (local,)
        finally:
            self._reading_since = None
        if self._failing is not None:
            log.info("the API server answers again")
        self._failing = self._failed_at_s = None
        self._view = (self._clock(), found)
        return found

    def _while_failing(self) -> Instance | None:
        """The pod's own stable instance while the API server was failing a moment ago: each
        try costs a tick up to the request deadline, so it is tried again only once per
        `api_read_interval_s` (strict reads always try)."""
        if _STRICT.get() or not self._recently_failed():
            return None
        return self._local_stable()

    def _recently_failed(self) -> bool:
        """The API server failed a read a moment ago, or a read has waited over a second."""
        failed, reading = self._failed_at_s, self._reading_since
        if reading is not None and self._clock() - reading > 1.0:
            return True
        return failed is not None and self._clock() - failed < self.api_read_interval_s

    def _with_local_pids(self, view: tuple[Instance, ...]) -> tuple[Instance, ...]:
        local = self._local_stable()
        if local is None:
            return view
        return tuple(
            dataclasses.replace(i, pids=local.pids, main_pid=local.main_pid)
            if i.role == "stable"
            else i
            for i in view
        )

    # Any change this runtime makes drops the reused view, so the next tick reads it anew.

    async def start_canary(self, argv: Sequence[str] | None, *, ready_timeout_s: float) -> Instance:
        self._view = None
        try:
            return await super().start_canary(argv, ready_timeout_s=ready_timeout_s)
        finally:
            self._view = None

    async def stop(self, name: str, *, drain_timeout_s: float) -> StopResult:
        self._view = None
        try:
            return await super().stop(name, drain_timeout_s=drain_timeout_s)
        finally:
            self._view = None

    async def restart(
        self,
        name: str,
        *,
        drain_timeout_s: float,
        ready_timeout_s: float,
        argv: Sequence[str] | None = None,
    ) -> Instance:
        self._view = None
        try:
            if self.restart_gate is None or name != self.target.stable_name:
                return await super().restart(
                    name,
                    drain_timeout_s=drain_timeout_s,
                    ready_timeout_s=ready_timeout_s,
                    argv=argv,
                )
            # A signal goes around the PDB, so the gate asks it; a promotion rolls out.
            by_signal = argv is None and self.target.restart == "signal"
            why = f"restart of {name}" if argv is None else f"restart of {name} with new flags"
            async with self.restart_gate.turn(why, by_signal=by_signal):
                return await super().restart(
                    name,
                    drain_timeout_s=drain_timeout_s,
                    ready_timeout_s=ready_timeout_s,
                    argv=argv,
                )
        finally:
            self._view = None

    async def promote(self, argv: Sequence[str], *, ready_timeout_s: float) -> Promotion:
        self._view = None
        try:
            return await super().promote(argv, ready_timeout_s=ready_timeout_s)
        finally:
            self._view = None

    def termination_reason(self, name: str) -> str | None:
        """The kubelet's reason for the vLLM container's last termination (`OOMKilled`), as
        the OOM guard reads it, from this pod alone for the stable (its name known); None
        when no pod says one or the API does not answer."""
        stable = name == self.target.stable_name
        # The stable's vLLM is this pod's: another replica's old OOMKilled is not its death.
        own = self.pod_name if stable else None
        if self._recently_failed() and not _STRICT.get():
            return None  # the API server is failing: the guard is called on the event loop
        try:
            with _loop_deadline():
                deployment = self._get(self.target.deployment if stable else name)
                pods = self._pods(deployment, only=own) if deployment is not None else []
        except RuntimeFailure:
            self._failed_at_s = self._clock()
            return None
        reasons = (container_termination_reason(p, self.target.container) for p in pods)
        return next((r for r in reasons if r is not None), None)

    def _local_stable(self) -> Instance | None:
        if self._process is None:
            return None
        local = next(iter(self._process.instances()), None)
        if local is None:
            return None
        return dataclasses.replace(local, name=self.target.stable_name, role="stable")
