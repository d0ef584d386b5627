"""The planner against the live server: predicted KV blocks vs what `cache_config_info` says."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from kvpilot.collectors.promtext import Labels
from kvpilot.collectors.vllm_metrics import VllmScrape
from kvpilot.tuner.planner import Calibration, predict_from_cache_config
from kvpilot.tuner.planner.model_shape import ModelShapeError
from kvpilot.tuner.planner.plan import PlanError

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineCalibration:
    """One engine's comparison, or why there is none."""

    model_name: str
    engine: str
    calibration: Calibration | None
    error: str | None = None


def model_config_of(argv: tuple[str, ...] | None) -> Path | None:
    """The served model's config.json when the server's `--model` (or `serve MODEL`) is a folder."""
    if not argv:
        return None
    from kvpilot.collectors.vllm_argv import NotAVllmServer, parse_server_argv

    try:
        model = parse_server_argv(argv).model
    except NotAVllmServer:
        return None
    config = Path(model) / "config.json" if model else None
    return config if config is not None and config.is_file() else None


class PlannerCheck:
    """Compares each engine's live cache settings with the plan; recomputed only on change.

    One comparison is kept per engine present in the latest scrape: a server whose labels
    change on every scrape costs a recomputation each time, never a growing cache.
    """

    def __init__(self, model_config: Path) -> None:
        self.model_config = model_config
        self._cache: dict[tuple[str, str], tuple[Labels, EngineCalibration]] = {}

    def check(self, scrape: VllmScrape) -> tuple[EngineCalibration, ...]:
        engines = [e for e in scrape.engines if e.cache_config]
        kept: dict[tuple[str, str], tuple[Labels, EngineCalibration]] = {}
        for engine in engines:
            key = (engine.engine, engine.model_name)
            cached = self._cache.get(key)
            if cached is None or cached[0] != engine.cache_config:
                found = self._compare(
                    engine.model_name, engine.engine, engine.cache_config, len(engines)
                )
                if found.calibration is not None and found.calibration.warning:
                    log.warning("planner: %s", found.calibration.summary)
                cached = (engine.cache_config, found)
            kept[key] = cached
        self._cache = kept
        return tuple(found for _, found in kept.values())

    def _compare(
        self, model_name: str, engine: str, labels: tuple[tuple[str, str], ...], engines: int
    ) -> EngineCalibration:
        try:
            calibration = predict_from_cache_config(
                self.model_config, labels, data_parallel_size=max(1, engines)
            )
        except (ModelShapeError, PlanError, OSError, ValueError, ArithmeticError) as exc:
            return EngineCalibration(model_name, engine, None, f"{type(exc).__name__}: {exc}")
        return EngineCalibration(model_name, engine, calibration)
