"""The server tuning is for, as one value: what the study, the canary and the promotion need
of it, whichever runtime runs it (built beside the runtime, in `agent.app.parts`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class TunedServer:
    """The stable server a study tunes: its flags as configured (or, on the pod runtime, as
    its Deployment runs them), and what a canary of it inherits."""

    name: str
    argv: tuple[str, ...]
    ready_timeout_s: float  # how long a (re)started server may take to become healthy
    drain_timeout_s: float  # after SIGTERM, how long it may drain before SIGKILL
    env: tuple[tuple[str, str], ...] = ()
    kvpool_port: int | None = None
    cpus: tuple[int, ...] = ()
    model_config: Path | None = None  # the model's config.json where configured, for the planner


# The server tuning studies for an instance by the argv it runs, or why there is none.
ServerOf = Callable[[str, tuple[str, ...]], "TunedServer | str"]
