"""The process runtime's `host` and `cmdline_regex`: what is accepted, and clear errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from kvpilot.agent.app.parts import build_runtime
from kvpilot.agent.config import ConfigError, ProcessRuntimeConfig, load_config


def _load(tmp_path: Path, **runtime: Any) -> ProcessRuntimeConfig:
    path = tmp_path / "kvpilot.yaml"
    path.write_text(yaml.safe_dump({"runtime": {"kind": "process", "port": 8000, **runtime}}))
    config = load_config(path)
    assert isinstance(config.runtime, ProcessRuntimeConfig)
    return config.runtime


def _problem(tmp_path: Path, **runtime: Any) -> str:
    with pytest.raises(ConfigError) as caught:
        _load(tmp_path, **runtime)
    (problem,) = caught.value.problems
    return problem


def test_without_host_any_server_address_is_reached_on_loopback(tmp_path: Path) -> None:
    runtime = _load(tmp_path)
    assert runtime.host is None and runtime.url == "http://127.0.0.1:8000"


def test_an_ipv6_host_is_kept_bare_and_bracketed_in_urls(tmp_path: Path) -> None:
    path = tmp_path / "kvpilot.yaml"
    runtime = {"kind": "process", "port": 8000, "host": "[::1]", "kvpool_port": 9500}
    path.write_text(yaml.safe_dump({"runtime": runtime}))
    config = load_config(path)
    assert config.runtime.host == "::1"  # type: ignore[union-attr]
    assert config.runtime.url == "http://[::1]:8000"  # type: ignore[union-attr]
    (instance,) = build_runtime(config).instances()
    assert instance.kvpool_url == "http://[::1]:9500"


@pytest.mark.parametrize(
    ("host", "says"),
    [
        ("0.0.0.0", "runtime.host: host is where the agent reaches the server, not a wildcard"),
        ("::", "not a wildcard"),
        ("http://10.0.0.5", "runtime.host: must be a host name or an IP address"),
        ("10.0.0.5:8000", "must be a host name or an IP address"),
        ("a host", "must be a host name or an IP address"),
        (["10.0.0.5"], "runtime.host: Input should be a valid string"),
        (8000, "runtime.host: Input should be a valid string"),
    ],
)
def test_a_host_that_is_no_address_is_a_clear_error(tmp_path: Path, host: Any, says: str) -> None:
    assert says in _problem(tmp_path, host=host)


@pytest.mark.parametrize(
    ("pattern", "says"),
    [
        ("(", "runtime.cmdline_regex: not a regular expression"),
        (5, "runtime.cmdline_regex: Input should be a valid string"),
        (["tiny"], "runtime.cmdline_regex: Input should be a valid string"),
    ],
)
def test_a_cmdline_regex_that_is_no_expression_is_a_clear_error(
    tmp_path: Path, pattern: Any, says: str
) -> None:
    assert says in _problem(tmp_path, cmdline_regex=pattern)
