"""scripts/house_figures.py counts what its docstring says it counts, on a tree small enough to
count by hand."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from textwrap import dedent
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "house_figures.py"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("house_figures", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def _write(tree: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = tree / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(dedent(text))


TREE = {
    "pyproject.toml": """
        [tool.mypy]
        strict = true

        [[tool.mypy.overrides]]
        module = "kvpilot.agent.*"
        disallow_untyped_defs = false
        implicit_reexport = true
        check_untyped_defs = true

        [[tool.mypy.overrides]]
        module = ["kubernetes.*"]
        ignore_missing_imports = true
    """,
    # Composition: its dispatch is not counted, its AgentConfig parameters on their own rows.
    "agent/app/parts.py": """
        def build(config: AgentConfig, load: Callable[[], AgentConfig]) -> None:
            if isinstance(config.runtime, LocalRuntimeConfig):
                pass
    """,
    "agent/tuning/dispatch.py": """
        from typing import Optional

        TUNABLE = 1
        tunable = LocalRuntimeConfig | PodRuntimeConfig

        def a(config: AgentConfig, runtime: Runtime) -> None:
            isinstance(runtime, LocalRuntime)
            isinstance(runtime, (Other, PodRuntimeConfig))
            isinstance(config.runtime, kinds.LocalInstanceSpec)
            isinstance(runtime, Runtime)  # the protocol, no kind
            isinstance(config.runtime, tunable)
            match config.runtime:
                case LocalRuntimeConfig():
                    pass
                case PodRuntimeConfig(namespace=n):
                    pass
                case _:
                    pass
            match config.runtime.kind:
                case "local":
                    pass
                case "pod" | "process":
                    pass
            if config.runtime.kind == "pod" or runtime.kind in ("a", "b"):
                pass
            if spec.kind == "info":  # a metric's kind, no runtime's
                pass

        class Holder:
            def b(self, config: AgentConfig | None = None) -> None: ...
            async def c(self, *, config: "Optional[AgentConfig]") -> None: ...
            def d(self, reload: Callable[[], AgentConfig], other: int) -> None: ...
    """,
    "agent/one.py": """
        from typing import TypeAlias

        class Step: ...
        class _Private: ...
        Labels = dict[str, str]
        Kind: TypeAlias = "str"
        Loud = "a constant, no type"
    """,
    "collectors/two.py": """
        class Step: ...
        class _Private: ...
        Labels = tuple[str, ...] | None
        Kind = NewType("Kind", str)
        class Once: ...
    """,
    "tuner/__init__.py": "",
    "tuner/judge.py": "",
    "tuner/report.py": "",
    "tuner/rooms/inside.py": "",
}


def test_each_figure_counts_what_the_rules_say(tmp_path: Path) -> None:
    _write(tmp_path, TREE)
    found = _script().figures(tmp_path)
    assert found.isinstance_direct == 3
    assert found.isinstance_alias == 1
    assert found.match_case == 4  # two class patterns, two cases of a match on .kind
    assert found.kind_compare == 2
    assert (found.agent_config_params, found.agent_config_callables) == (3, 1)
    assert (found.agent_config_params_composition, found.agent_config_callables_composition) == (
        1,
        1,
    )
    assert found.tuner_root_modules == 2
    assert found.mypy_relaxations == 2  # disallow_untyped_defs off, implicit_reexport on
    assert found.twice == ("Kind", "Labels", "Step")


def test_a_folder_without_pyproject_is_refused_with_a_reason(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert "holds no pyproject.toml" in result.stderr
    assert "Traceback" not in result.stderr
