"""The tuner's figures on `/metrics`, kept in memory: a scrape never reads the database.

The tick hands `TuningFiguresCache.refresh` the instances it already listed; the trials are
read from the trial store at most every `refresh_s` (a trial's transition shows on `/metrics`
within that time and one tick) and the families are rebuilt only when the trials or the live
flags changed. A scrape reads `current`, an immutable value swapped whole, so it never sees a
half-built one. Until the first read succeeds the trial families are absent rather than zero.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvpilot.agent.model import Instance
from kvpilot.collectors.secrets import mask_argv
from kvpilot.dashboards import tuning_metrics
from kvpilot.tuner.trials import Trial, TrialStore

log = logging.getLogger(__name__)

DEFAULT_TUNING_REFRESH_S = 15.0


@dataclass(frozen=True, slots=True)
class TuningFigures:
    """The trials as last read, the live flags as last seen, and the families built from them."""

    trials: tuple[Trial, ...] | None  # None until the store was first read
    trials_read_at_s: float | None
    live_flags: tuple[tuning_metrics.LiveFlags, ...]
    families: tuple[tuning_metrics.Family, ...]


NOTHING_YET = TuningFigures(None, None, (), ())


def live_flags(
    instances: Sequence[Instance], source_of: Callable[[Instance], tuning_metrics.FlagSource]
) -> tuple[tuning_metrics.LiveFlags, ...]:
    """Each stable instance's flags (secrets masked), and whether they are the configured or
    promoted ones."""
    return tuple(
        tuning_metrics.LiveFlags(
            server=instance.name,
            flags=" ".join(mask_argv(instance.argv or ())),
            source=source_of(instance),
        )
        for instance in instances
        if instance.role == "stable"
    )


class TuningFiguresCache:
    """Holds the latest `TuningFigures`; only `refresh` (called by the tick) reads the store."""

    def __init__(self, store: TrialStore, *, refresh_s: float = DEFAULT_TUNING_REFRESH_S) -> None:
        if refresh_s <= 0:
            raise ValueError(f"refresh_s must be positive, got {refresh_s}")
        self._store = store
        self._refresh_s = refresh_s
        self._current = NOTHING_YET
        self._last_attempt_s: float | None = None

    @property
    def current(self) -> TuningFigures:
        return self._current

    def refresh(self, now_s: float, live: Sequence[tuning_metrics.LiveFlags]) -> TuningFigures:
        """Reads the trials when `refresh_s` has passed since the last attempt; a failed read
        keeps the last trials (logged, tried again `refresh_s` later)."""
        old = self._current
        trials, read_at_s = old.trials, old.trials_read_at_s
        read = False
        last = self._last_attempt_s
        if last is None or now_s - last >= self._refresh_s:
            self._last_attempt_s = now_s
            try:
                trials, read_at_s, read = tuple(self._store.trials()), now_s, True
            except Exception:
                log.exception("tuning figures: reading the trials failed; /metrics keeps the last")
        live_now = tuple(live)
        if not read and live_now == old.live_flags:
            return old  # nothing new: the families stand
        self._current = TuningFigures(trials, read_at_s, live_now, _families(trials, live_now))
        return self._current


def _families(
    trials: tuple[Trial, ...] | None, live: tuple[tuning_metrics.LiveFlags, ...]
) -> tuple[tuning_metrics.Family, ...]:
    families = tuning_metrics.tuning_families(trials or (), live)
    if trials is not None:
        return families
    # Not read yet: a count of zero would be a lie; only the live flags are known.
    return tuple(f for f in families if f.spec.name == tuning_metrics.LIVE_FLAGS_INFO)
