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


# Modules the formatter writes past the limit, each weighed rather than packed by hand: a
# module leaves this table when it is split, and none may grow past the hard ceiling.
WEIGHED_LONG_MODULES = {
    "agent/cli/demo/run.py": "the demo's scenes in the order they play",
    "agent/runtimes/kubernetes/runtime.py": "the pod runtime, to split from its API reads",
}
HARD_CEILING_LINES = 500


def test_no_production_module_is_over_450_lines_unless_weighed() -> None:
    long = {
        str(path.relative_to(ROOT)): lines
        for folder in PRODUCTION
        for path in (ROOT / folder).rglob("*.py")
        if (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert sorted(long) == sorted(WEIGHED_LONG_MODULES), long
    assert all(lines <= HARD_CEILING_LINES for lines in long.values()), long


def test_the_formatter_is_skipped_only_for_tables() -> None:
    skipped = [
        str(path.relative_to(ROOT))
        for folder in (*PRODUCTION, "tests", "benchmarks")
        for path in (ROOT / folder).rglob("*.py")
        if "# fmt: skip" in path.read_text() and path.name != "test_house.py"
    ]
    assert skipped == ["tests/pods/manifests.py"]
