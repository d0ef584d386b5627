"""The live switch: whether kvpilot acts (`armed`), only decides (`dry-run`) or does nothing
(`paused`), set in layers that an operator can change while kvpilot runs.

Layers, the first one set wins: the Deployment's annotation, the namespace's ConfigMap (the
Kubernetes runtime reads both), the control API's switch, the configuration file
(`remediation.dry_run`, applied by a reload). Paused: no remediation and no tuning; dry-run:
remediation decides and records, and tuning plans, but neither acts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

log = logging.getLogger(__name__)

MODE_ANNOTATION = "kvpilot.dev/mode"  # on the Deployment
MODE_CONFIGMAP = "kvpilot-mode"  # in the namespace; its key `mode`
MODE_KEY = "mode"


class Mode(StrEnum):
    PAUSED = "paused"
    DRY_RUN = "dry-run"
    ARMED = "armed"


class ModeSource(StrEnum):
    """Where a mode was set; the members in order of precedence, highest first."""

    DEPLOYMENT = "deployment"
    NAMESPACE = "namespace"
    API = "api"
    CONFIG = "config"


PRECEDENCE = tuple(ModeSource)


def parse_mode(text: str) -> Mode:
    """`text` as a mode (case and surrounding blanks ignored); ValueError naming the choices."""
    cleaned = text.strip().lower()
    try:
        return Mode(cleaned)
    except ValueError:
        shown = text if len(text) <= 40 else text[:39] + "…"
        choices = ", ".join(m.value for m in Mode)
        raise ValueError(f"unknown mode {shown!r}: use one of {choices}") from None


def configured_mode(dry_run: bool) -> Mode:
    """The configuration file's mode: `remediation.dry_run` or armed."""
    return Mode.DRY_RUN if dry_run else Mode.ARMED


@dataclass(frozen=True, slots=True)
class ModeSetting:
    """The mode in force and the layer it comes from (`detail`: which object, for people)."""

    mode: Mode
    source: ModeSource
    detail: str = ""

    def describe(self) -> str:
        where = f"{self.source.value}: {self.detail}" if self.detail else self.source.value
        return f"{self.mode.value} (set by {where})"


class LiveMode:
    """The layers of the switch and the mode in force. Used on the event loop only."""

    def __init__(
        self,
        configured: Mode,
        *,
        on_change: Callable[[ModeSetting, ModeSetting], None] | None = None,
    ) -> None:
        self._layers: dict[ModeSource, ModeSetting] = {
            ModeSource.CONFIG: ModeSetting(configured, ModeSource.CONFIG, "remediation.dry_run")
        }
        self._on_change = on_change

    def current(self) -> ModeSetting:
        return next(self._layers[s] for s in PRECEDENCE if s in self._layers)

    def layers(self) -> tuple[ModeSetting, ...]:
        """Every layer set, highest first."""
        return tuple(self._layers[s] for s in PRECEDENCE if s in self._layers)

    def set(self, source: ModeSource, mode: Mode | None, detail: str = "") -> ModeSetting:
        """Set (None: clear) one layer; the mode in force after it. The configuration's layer
        cannot be cleared."""
        if mode is None and source is ModeSource.CONFIG:
            raise ValueError("the configuration file always sets a mode")
        before = self.current()
        if mode is None:
            self._layers.pop(source, None)
        else:
            self._layers[source] = ModeSetting(mode, source, detail)
        after = self.current()
        if after.mode is not before.mode:
            log.warning("mode: now %s, was %s", after.describe(), before.describe())
            if self._on_change is not None:
                self._on_change(before, after)
        return after
