"""Whatever the configuration input (bytes, YAML-ish text, nested data, environment
overrides), loading it either gives a configuration or raises ConfigError: nothing else."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpilot.agent.config import AgentConfig, ConfigError, load_config, validate_config

# Pinned: the same examples on every run, no deadline (a busy CI machine is slow, not wrong).
PINNED = settings(
    derandomize=True,
    deadline=None,
    max_examples=300,
    suppress_health_check=[HealthCheck.too_slow],
)

# Names the models know, so that generated input reaches past the top-level check.
FIELDS = [
    "listen",
    "host",
    "port",
    "api",
    "token",
    "token_file",
    "interval_s",
    "state_dir",
    "runtime",
    "kind",
    "local",
    "process",
    "attach",
    "instances",
    "servers",
    "name",
    "url",
    "argv",
    "rules",
    "fragmentation",
    "allocator",
    "kv_blocks",
    "threshold_ratio",
    "action",
    "restart",
    "labels",
    "notifiers",
    "webhook",
    "headers",
    "remediation",
    "budget",
    "tuning",
    "schedule",
    "retention",
    "0",
    "1",
]
YAML_BITS = [
    "\n",
    "  ",
    "- ",
    ": ",
    ", ",
    "[",
    "]",
    "{",
    "}",
    "&a ",
    "&b ",
    "*a",
    "*b",
    "<<: ",
    "? ",
    "!!int ",
    "!!str ",
    "!!binary ",
    "!!set ",
    "!!timestamp ",
    "!!python/name:os.system ",
    "|",
    ">",
    "'",
    '"',
    "#",
    "---\n",
    "...\n",
    "%YAML 1.1\n",
    "~",
    "null",
    "true",
    ".inf",
    "0x1F",
    "0o17",
    "1_000",
    "1e400",
    "2001-02-30",
    "12:30:45",
    "-1",
    "\t",
    "9" * 5000,
    "0x" + "f" * 5000,  # beyond what int() parses / str() prints in decimal
    "\x00",
    "\ufeff",
    "é",
    "💥",
]


def _outcome(load: Any) -> None:
    """Calls `load`; a configuration or a ConfigError with at least one problem is fine."""
    try:
        config = load()
    except ConfigError as exc:
        assert exc.problems and all(isinstance(p, str) and p for p in exc.problems)
    else:
        assert isinstance(config, AgentConfig)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("config-fuzz")


def _load_file(workdir: Path, content: bytes, environ: dict[str, str] | None = None) -> None:
    path = workdir / "kvpilot.yaml"
    path.write_bytes(content)
    _outcome(lambda: load_config(path, environ, warn=False))


@PINNED
@given(content=st.binary(max_size=2048))
def test_arbitrary_bytes(workdir: Path, content: bytes) -> None:
    _load_file(workdir, content, {})


yamlish = st.lists(
    st.sampled_from(YAML_BITS) | st.sampled_from(FIELDS) | st.text(max_size=4), max_size=60
).map("".join)


@PINNED
@given(text=yamlish)
def test_arbitrary_yamlish_text(workdir: Path, text: str) -> None:
    _load_file(workdir, text.encode(), {})


scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=2**60, max_value=2**1000)
    | st.floats()
    | st.text(max_size=8)
    | st.sampled_from(FIELDS)
    | st.binary(max_size=4)
)
keys = st.sampled_from(FIELDS) | st.text(max_size=6) | st.integers() | st.none()
nested = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.tuples(inner, inner)
        | st.dictionaries(keys, inner, max_size=4)
    ),
    max_leaves=40,
)


@PINNED
@given(data=st.dictionaries(keys, nested, max_size=6))
def test_arbitrary_nested_data(data: dict[Any, Any]) -> None:
    _outcome(lambda: validate_config(data, {}, warn=False))


env_names = st.lists(st.sampled_from(FIELDS) | st.text(max_size=4), min_size=1, max_size=6).map(
    lambda parts: "KVPILOT_" + "__".join(parts).upper()
)


@PINNED
@given(environ=st.dictionaries(env_names, yamlish, max_size=4), base=st.sampled_from([0, 1]))
def test_arbitrary_environment_overrides(environ: dict[str, str], base: int) -> None:
    data: dict[str, Any] = [
        {},
        {"runtime": {"kind": "process", "port": 8000}, "rules": {"fragmentation": {}}},
    ][base]
    environ = {k: v.replace("\x00", "") for k, v in environ.items()}
    _outcome(lambda: validate_config(data, environ, warn=False))


def test_a_deep_structure_from_code_is_a_config_error() -> None:
    data: dict[str, Any] = {"runtime": {}}
    node = data["runtime"]
    for _ in range(5000):
        node["x"] = {}
        node = node["x"]
    with pytest.raises(ConfigError, match="nested deeper than 32 levels"):
        validate_config(data, {}, warn=False)


def test_a_cyclic_structure_from_code_is_a_config_error() -> None:
    loop: list[Any] = []
    loop.append(loop)
    with pytest.raises(ConfigError, match="nested deeper than 32 levels"):
        validate_config({"notifiers": loop}, {}, warn=False)
