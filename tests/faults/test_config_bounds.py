"""Settings that no operator means are refused by the configuration check, each with the
field it is about: an interval of 1e9 s (/healthz would never go stale), limits that are no
limit, and two servers that cannot both bind one port however their --host is spelt."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvpilot.agent.config import ConfigError
from kvpilot.agent.config.load import validate_config

TINY = str(Path(__file__).resolve().parents[2] / "rig" / "models" / "tiny-llama")


def _instance(name: str, *flags: str) -> dict[str, Any]:
    argv = ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", TINY, *flags]
    return {"name": name, "argv": argv}


def _local(*instances: dict[str, Any], **runtime: Any) -> dict[str, Any]:
    return {"runtime": {"kind": "local", "instances": list(instances), **runtime}}


def _problems(data: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as caught:
        validate_config(data, warn=False)
    return "\n".join(caught.value.problems)


ONE = _local(_instance("a", "--port", "8100"))


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"interval_s": 1e9}, "interval_s"),
        ({"interval_s": 0.001}, "interval_s"),
        ({"scrape": {"timeout_s": 1e9}}, "scrape.timeout_s"),
        ({"scrape": {"body_size_limit_bytes": 10**15}}, "scrape.body_size_limit_bytes"),
        ({"scrape": {"sample_limit": 10**12}}, "scrape.sample_limit"),
        ({"runtime": {**ONE["runtime"], "drain_timeout_s": 1e9}}, "runtime.local.drain_timeout_s"),
        ({"runtime": {**ONE["runtime"], "ready_timeout_s": 1e9}}, "runtime.local.ready_timeout_s"),
    ],
)
def test_an_absurd_setting_is_refused_with_its_field(extra: dict[str, Any], field: str) -> None:
    problems = _problems({**ONE, **extra})
    assert field.rsplit(".", 1)[-1] in problems, problems


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (["--host", "localhost"], ["--host", "127.0.0.1"]),
        (["--host", "LOCALHOST"], ["--host", "::1"]),
        ([], ["--host", "127.0.0.1"]),  # no --host: every address
        (["--host", "0.0.0.0"], ["--host", "10.1.2.3"]),
        (["--host", "[::1]"], ["--host", "::1"]),
        (["--host", "127.000.000.001"], ["--host", "127.0.0.1"]),
        (["--host", "127.1"], ["--host", "localhost"]),
    ],
)
def test_two_instances_on_one_port_are_refused_however_the_host_is_spelt(
    a: list[str], b: list[str]
) -> None:
    data = _local(_instance("a", "--port", "8100", *a), _instance("b", "--port", "8100", *b))
    problems = _problems(data)
    assert "8100" in problems, problems


def test_two_instances_on_distinct_addresses_may_share_a_port() -> None:
    data = _local(
        _instance("a", "--port", "8100", "--host", "127.0.0.1"),
        _instance("b", "--port", "8100", "--host", "127.0.0.2"),
    )
    assert len(validate_config(data, warn=False).runtime.instances) == 2  # type: ignore[union-attr]


def test_config_check_says_so_and_exits_2(tmp_path: Path) -> None:
    path = tmp_path / "kvpilot.yaml"
    path.write_text(yaml.safe_dump({**ONE, "interval_s": 1e9}))
    done = subprocess.run(
        [sys.executable, "-m", "kvpilot.agent", "config", "check", str(path)],
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert b"interval_s" in done.stdout + done.stderr
