"""The ladder's promote step: the best configuration the tuner validated for this study.

Validated means the trial was judged pass, beat the stable instance, and its rollout ended
`promoted`. With `tuning.bake` on that phase is reached only after the bake window held;
with bake off the operator chose to trust the judge alone, and the rollout goes straight to
`promoted`: both count, since `promoted` is where the tuner itself says "this serves". A
rollout that reverted in its bake, was rolled back or refused never counts.

Of those trials, the best by the objective's own ordering (`tuner.problem.objective.better`) is
returned as the instance's current argv with the trial's knob values applied, the way a
tuning run builds a candidate (`tuner.session.candidate_argv`). When those are the flags the
instance already runs (compared as `collectors.vllm_argv.canonical_flags` compares) there
is nothing better to promote: None.

The study (its fingerprint and search space) is the one `kvpilot tune` and scheduled tuning
build (`agent.tuning.study.build_study`); for a server kvpilot did not start (the process
runtime) it is built from the argv the server runs. Missing is None with a reason, logged.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from kvpilot.agent.config.tuning import TuningConfig
from kvpilot.agent.model import Instance
from kvpilot.agent.state.db import Database
from kvpilot.agent.state.store import StateStore
from kvpilot.agent.state.trials import SqliteRolloutJournal, SqliteTrialStore
from kvpilot.agent.tuning.promoted import PROMOTED_FACT
from kvpilot.agent.tuning.server import ServerOf, TunedServer
from kvpilot.agent.tuning.study import Study, build_study, read_gpu
from kvpilot.agent.tuning.workload.choice import WorkloadChoice
from kvpilot.collectors.vllm_argv import canonical_flags
from kvpilot.tuner.problem.objective import Slo, TrialResult, better
from kvpilot.tuner.problem.space import Candidate, SearchSpace
from kvpilot.tuner.rollout.canary import Phase
from kvpilot.tuner.session import candidate_argv
from kvpilot.tuner.trials import Trial, TrialState

log = logging.getLogger(__name__)

# The study of one instance whose server runs `argv`, or why there is none.
StudyFor = Callable[[str, Sequence[str]], "Study | str"]
VersionOf = Callable[[str], "str | None"]  # a server's vLLM version, None while unknown
# The workload tuning replays now (the learned one once its window is full); None: default.
WorkloadOf = Callable[[], "WorkloadChoice | None"]


def best_validated(db: Database, fingerprint: str, slo: Slo) -> Trial | None:
    """The study's best trial that was judged pass and whose rollout ended promoted."""
    journal = SqliteRolloutJournal(db)
    best: tuple[Trial, TrialResult] | None = None
    for trial in SqliteTrialStore(db).trials(fingerprint):
        result = trial.result
        if result is None or not _validated(trial, journal):
            continue
        if best is None or better(result, best[1], slo):
            best = (trial, result)
    return None if best is None else best[0]


def _validated(trial: Trial, journal: SqliteRolloutJournal) -> bool:
    if trial.state is not TrialState.COMPLETE or trial.result is None:
        return False
    if not trial.result.feasible or trial.judgement is None or not trial.judgement.promote:
        return False
    record = journal.get(trial.trial_id)
    return record is not None and record.phase is Phase.PROMOTED


def applied(current: Sequence[str], space: SearchSpace, trial: Trial) -> tuple[str, ...] | None:
    """`current` with the trial's knob values, or None when a knob of the space has none."""
    values = dict(trial.values)
    if any(name not in values for name in space.names):
        return None
    return candidate_argv(current, space, Candidate(tuple((n, values[n]) for n in space.names)))


def same_flags(a: Sequence[str], b: Sequence[str]) -> bool:
    return canonical_flags(a) == canonical_flags(b)


class BestConfig:
    """A `BetterConfig` (see `agent.remediation.ladder`) over the state database.

    `instances` is the runtime's view (the current argv of each server); `study_for` gives
    the study of an instance from the argv it runs. `last_reason` says why the last call
    found nothing; `misses_total` counts those calls.
    """

    def __init__(
        self,
        db: Database,
        instances: Callable[[], tuple[Instance, ...]],
        study_for: StudyFor,
    ) -> None:
        self._db = db
        self._instances = instances
        self._study_for = study_for
        self.last_reason: str | None = None
        self.misses_total = 0

    def __call__(self, instance: str) -> tuple[str, ...] | None:
        try:
            found = self._find(instance)
        except Exception as exc:  # the ladder goes on without a promotion, never stops here
            found = f"the lookup failed: {type(exc).__name__}: {exc}"
        if isinstance(found, str):
            self.last_reason = found
            self.misses_total += 1
            log.info(
                "instance %s: no validated better configuration to promote: %s", instance, found
            )
            return None
        self.last_reason = None
        return found

    def _find(self, name: str) -> tuple[str, ...] | str:
        instance = next((i for i in self._instances() if i.name == name), None)
        if instance is None or not instance.argv:
            return "the instance's flags are unknown"
        study = self._study_for(name, instance.argv)
        if isinstance(study, str):
            return study
        trial = best_validated(self._db, study.fingerprint, study.slo)
        if trial is None:
            return f"no trial of study {study.fingerprint} was judged pass and promoted"
        argv = applied(instance.argv, study.space, trial)
        if argv is None:
            return f"trial {trial.number} lacks a value for a knob of the study"
        if same_flags(argv, instance.argv):
            return f"trial {trial.number}'s configuration already runs"
        return argv


def remember_promotion(
    tuned: TunedServer | None, store: StateStore, config_sha256: str | None
) -> Callable[[str, tuple[str, ...], str], None]:
    """Notes each promotion of the tuned server (its configured flags in `tuned`) as the
    promoted flags (the fact the next start reads, `agent.tuning.promoted`), so that the
    ladder's promotion holds as the tuner's does; without a YAML to hold it to, or a server
    kvpilot starts, nothing is noted."""

    def noted(name: str, argv: tuple[str, ...], reason: str) -> None:
        if tuned is None or tuned.name != name or config_sha256 is None:
            return
        if tuple(argv) == tuple(tuned.argv):
            store.delete_fact(PROMOTED_FACT)
        else:
            fact = {"argv": list(argv), "yaml_sha256": config_sha256, "reason": reason}
            store.set_fact(PROMOTED_FACT, fact, time.time())

    return noted


def config_studies(
    tuning: TuningConfig,
    server_of: ServerOf,
    version_of: VersionOf = lambda _n: None,
    workload_of: WorkloadOf = lambda: None,
) -> StudyFor:
    """The study of an instance under `tuning`, as tuning builds it, of the server
    `server_of` says (the configured stable instance's, or the server's as it runs). Built
    once per argv; a study that cannot be built is its reason."""
    built: dict[tuple[str, tuple[str, ...], str | None, str | None], Study | str] = {}

    def study_for(name: str, argv: Sequence[str]) -> Study | str:
        version, chosen = version_of(name), workload_of()
        key = (name, tuple(argv), version, chosen.served() if chosen else None)
        if key not in built:
            built[key] = _build(tuning, server_of(name, tuple(argv)), name, version, chosen)
        return built[key]

    return study_for


def _build(
    tuning: TuningConfig,
    server: TunedServer | str,
    name: str,
    version: str | None,
    chosen: WorkloadChoice | None,
) -> Study | str:
    if isinstance(server, str):
        return server
    try:
        study = build_study(server, tuning, read_gpu(), vllm_version=version, chosen=chosen)

    except (ValueError, OSError) as exc:  # StudyError is a ValueError
        return f"no tuning study: {exc}"
    if study.stable.name != name:
        return f"the tuned instance is {study.stable.name}, not {name}"
    return study
