"""An in-memory `TrialStore` (see `kvpilot.tuner.trials`): a dict, for tuner tests that need
no database. It passes the same contract as the agent's SQLite store
(tests/tuner/test_trial_store_contract.py). `CountingTrialStore` wraps any store and counts
the reads that reach it.
"""

from __future__ import annotations

from kvpilot.tuner.trials import Trial, TrialStore


class InMemoryTrialStore:
    """A TrialStore in a dict; single-threaded use only."""

    def __init__(self) -> None:
        self._trials: dict[str, Trial] = {}

    def add(self, trial: Trial) -> None:
        if trial.trial_id in self._trials:
            raise ValueError(f"trial {trial.trial_id} exists")
        self._trials[trial.trial_id] = trial

    def save(self, trial: Trial) -> None:
        if trial.trial_id not in self._trials:
            raise KeyError(trial.trial_id)
        self._trials[trial.trial_id] = trial

    def get(self, trial_id: str) -> Trial | None:
        return self._trials.get(trial_id)

    def trials(self, fingerprint: str | None = None) -> list[Trial]:
        chosen = [t for t in self._trials.values() if fingerprint in (None, t.fingerprint)]
        return sorted(chosen, key=lambda t: (t.created_wall_s, t.number))

    def unfinished(self) -> list[Trial]:
        return [t for t in self.trials() if not t.state.terminal]


class CountingTrialStore:
    """Wraps a TrialStore and counts the reads that reach it (`reads`), for tests that must
    show a path reads nothing."""

    def __init__(self, inner: TrialStore) -> None:
        self.inner = inner
        self.reads = 0

    def add(self, trial: Trial) -> None:
        self.inner.add(trial)

    def save(self, trial: Trial) -> None:
        self.inner.save(trial)

    def get(self, trial_id: str) -> Trial | None:
        self.reads += 1
        return self.inner.get(trial_id)

    def trials(self, fingerprint: str | None = None) -> list[Trial]:
        self.reads += 1
        return self.inner.trials(fingerprint)

    def unfinished(self) -> list[Trial]:
        self.reads += 1
        return self.inner.unfinished()
