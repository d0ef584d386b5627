"""The folders stay a map: the agent's root holds few modules and no module grows past
what one reader can hold."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCTION = ("agent", "collectors", "tuner", "dashboards", "rig")
MAX_ROOT_MODULES = 10
MAX_MODULE_LINES = 450


def test_the_agent_root_has_rooms_not_a_pile_of_modules() -> None:
    modules = sorted(
        p.name
        for p in (ROOT / "agent").glob("*.py")
        if p.name not in ("__init__.py", "__main__.py")
    )
    assert len(modules) <= MAX_ROOT_MODULES, modules


def test_no_production_module_is_over_450_lines() -> None:
    long = {
        str(path.relative_to(ROOT)): lines
        for folder in PRODUCTION
        for path in (ROOT / folder).rglob("*.py")
        if (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert long == {}
