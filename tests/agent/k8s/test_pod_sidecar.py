"""`kvpilot run` on the pod runtime, in-process, against the fake API server (a fake: no API
server runs here) and a stand-in vLLM: the sidecar ticks on the Deployment's stable instance,
and at start-up resumes the promotion the pod it replaced handed over (tuning.bake off, so
the outcome does not hang on a measured window)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import TypeVar

from kvpilot.agent.app.compose import run_sidecar
from kvpilot.agent.config import validate_config
from kvpilot.agent.state.trials import SqliteRolloutJournal
from kvpilot.agent.tick.sidecar import Sidecar
from kvpilot.rig.server import free_port
from kvpilot.tuner.rollout.canary import Phase
from tests.agent.k8s.conftest import NAMESPACE
from tests.agent.k8s.test_k8s_tuning import stable_args
from tests.agent.k8s.test_pod_handover import handed_over_record
from tests.agent.k8s.test_pod_schedule import TINY

T = TypeVar("T")


async def wait_for(what: str, probe: Callable[[], T | None], timeout_s: float = 30.0) -> T:
    deadline = time.monotonic() + timeout_s
    while (found := probe()) is None:
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
        await asyncio.sleep(0.05)
    return found


def test_the_sidecar_resumes_a_handed_over_promotion_at_start_up(fake, standin, tmp_path) -> None:
    db, _, _, _, new = handed_over_record(fake, standin, tmp_path, phase=Phase.BAKING)
    db.close()  # the pod that promoted is gone; its state stays on the volume
    config = validate_config(
        {
            "listen": {"host": "127.0.0.1", "port": free_port()},
            "interval_s": 0.2,
            "state_dir": str(tmp_path / "state"),
            "runtime": {
                "kind": "pod",
                "port": standin.port,
                "model_config": str(TINY),
                "kubernetes": {"namespace": NAMESPACE, "deployment": "vllm", "api_url": fake.host},
            },
            "tuning": {"schedule": "0 3 * * *", "bake": False},
        },
        {},
        warn=False,
    )

    async def main() -> tuple[Sidecar, str]:
        stop = asyncio.Event()
        ticked: list[Sidecar] = []
        agent = asyncio.create_task(run_sidecar(config, stop=stop, on_tick=ticked.append))
        try:
            sidecar = await wait_for("first tick", lambda: ticked[0] if ticked else None)
            journal = SqliteRolloutJournal(sidecar.store.db)
            record = await wait_for(
                "the resumed promotion",
                lambda: r if (r := journal.get("t1")) and r.phase.final else None,
            )
            return sidecar, record.phase.value
        finally:
            stop.set()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(agent, timeout=30)

    sidecar, phase = asyncio.run(main())

    assert phase == "promoted"
    assert [i.name for i in sidecar.runtime.instances()] == ["vllm"]  # the Deployment's stable
    reads = [r for r in fake.requests if r.method == "GET" and r.path.endswith("/vllm")]
    assert reads  # each tick reads the stable through the API server
    assert fake.writes("PATCH") == [] and stable_args(fake) == new  # the promotion stands
