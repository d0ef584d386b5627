"""What the tick's after-steps work on: the re-tune watch, the learned workload's window and
its keeper. Built before the loop and handed to it, so that no step is attached afterwards."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvpilot.agent.model import Instance
from kvpilot.agent.tuning.retune import RetuneWatch
from kvpilot.agent.tuning.workload.keep import WindowKeeper
from kvpilot.agent.tuning.workload.window import WorkloadWindow
from kvpilot.collectors.vllm_metrics import VllmScrape


class CompletedRuns:
    """Tuning runs that completed since the re-tune step last looked: the schedule marks
    them as they end, the next tick's re-tune step takes them (the schedule and the watch
    each need the other, so neither holds the other)."""

    def __init__(self) -> None:
        self._unseen = 0

    def mark(self) -> None:
        self._unseen += 1

    def take(self) -> bool:
        seen, self._unseen = self._unseen > 0, 0
        return seen


@dataclass(frozen=True, slots=True)
class AfterTick:
    """The parts of the after-steps; each one absent skips its step."""

    retune: RetuneWatch | None = None
    completed_runs: CompletedRuns = field(default_factory=CompletedRuns)
    learned: WorkloadWindow | None = None
    keeper: WindowKeeper | None = None

    def retune_step(self) -> None:
        """A completed run is the ground tuning now stands on; then a check when due."""
        if self.retune is None:
            return
        if self.completed_runs.take():
            self.retune.tuned()
        self.retune.check()

    def feed_window(
        self, instances: Sequence[Instance], latest_vllm: Callable[[str], VllmScrape | None]
    ) -> None:
        """The stable server's latest scrape into the learned workload's window."""
        if self.learned is not None:
            feed_window(self.learned, instances, latest_vllm)

    def keep_window(self) -> None:
        if self.keeper is not None:
            self.keeper.maybe_save()


def feed_window(
    window: WorkloadWindow,
    instances: Sequence[Instance],
    latest_vllm: Callable[[str], VllmScrape | None],
) -> None:
    """The stable server's latest scrape into `window`."""
    for instance in instances:
        if instance.role == "stable":
            scrape = latest_vllm(instance.name)
            if scrape is not None:
                window.observe(scrape)
            return
