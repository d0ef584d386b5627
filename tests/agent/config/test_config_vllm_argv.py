"""The configuration accepts every vLLM command line the runtime starts, and reads it the same
way: `kvpilot config check` against the local runtime, and both against the study fingerprint.
"""

from __future__ import annotations

from pathlib import Path

import pydantic
import pytest
import yaml
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from kvpilot.agent.cli.main import app
from kvpilot.agent.config import InstanceConfig
from kvpilot.agent.runtimes.local import LocalInstanceSpec, LocalRuntime
from kvpilot.collectors.vllm_argv import parse_server_argv
from kvpilot.tuner.problem.fingerprint import fingerprint
from kvpilot.tuner.problem.objective import Slo

NOWHERE = Path("/nonexistent/kvpilot-logs")  # a runtime that is never started writes nothing


def _check(tmp_path: Path, argv: list[str]) -> tuple[int, str]:
    """`kvpilot config check FILE` on a configuration with one instance running `argv`."""
    path = tmp_path / "kvpilot.yaml"
    data = {"runtime": {"kind": "local", "instances": [{"name": "a", "argv": argv}]}}
    path.write_text(yaml.safe_dump(data))
    result = CliRunner().invoke(app, ["config", "check", str(path), "--no-env"])
    return result.exit_code, result.output


def _runtime_url(argv: list[str]) -> str:
    (instance,) = LocalRuntime([LocalInstanceSpec("a", tuple(argv))], NOWHERE).instances()
    return instance.url


@pytest.mark.parametrize(
    "argv",
    [
        ["python3", "-m", "vllm.entrypoints.cli.main", "serve", "/models/m", "--port", "8123"],
        [
            "/opt/venv/bin/python3.11",
            "-u",
            "-m",
            "vllm.entrypoints.cli.main",
            "serve",
            "m",
            "--port=8123",
        ],
        ["python", "/opt/venv/bin/vllm", "serve", "m", "--port", "8123"],
    ],
)
def test_config_check_accepts_every_launch_form_the_runtime_starts(
    tmp_path: Path, argv: list[str]
) -> None:
    assert _runtime_url(argv) == "http://127.0.0.1:8123"
    code, output = _check(tmp_path, argv)
    assert code == 0, output
    assert "a (stable) http://127.0.0.1:8123" in output


def test_config_check_reads_the_port_the_server_binds(tmp_path: Path) -> None:
    # argparse keeps the last of a repeated option, and so does the runtime.
    argv = ["vllm", "serve", "m", "--port", "8001", "--port=8123"]
    assert _runtime_url(argv) == "http://127.0.0.1:8123"
    code, output = _check(tmp_path, argv)
    assert code == 0, output
    assert "a (stable) http://127.0.0.1:8123" in output


def test_config_check_refuses_a_port_the_runtime_refuses(tmp_path: Path) -> None:
    argv = ["vllm", "serve", "m", "--port", "http"]
    with pytest.raises(ValueError, match="--port must be an integer"):
        _runtime_url(argv)
    code, output = _check(tmp_path, argv)
    assert code == 2, output
    assert "runtime.instances.0.argv" in output and "--port must be an integer" in output


# --- every consumer reads a generated command line alike ------------------------------

MODEL = "/models/llama"
LAUNCHERS = (
    ["vllm", "serve", MODEL],
    ["/opt/venv/bin/vllm", "serve", MODEL],
    ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", MODEL],
    [
        "/usr/bin/python3.11",
        "-u",
        "-X",
        "dev",
        "-m",
        "vllm.entrypoints.openai.api_server",
        f"--model={MODEL}",
    ],
    ["python3", "-m", "vllm.entrypoints.cli.main", "serve", MODEL],
    ["python", "/opt/venv/bin/vllm", "serve", MODEL],
)
NOT_SERVERS = (
    ["vllm", "bench", "serve", MODEL],
    ["pythonic", "-m", "vllm.entrypoints.openai.api_server", "--model", MODEL],
    ["python", "-m", "vllm.other", "--model", MODEL],
    ["python", "-m", "vllm.entrypoints.cli.main", "bench", MODEL],
    ["bash", "-c", f"vllm serve {MODEL}"],
)
OPTIONS = {
    "port": st.sampled_from(["8000", "8123", "9001", "65535", "0", "70000", "http", "-1"]),
    "host": st.sampled_from(["0.0.0.0", "127.0.0.1", "10.1.2.3", "::", "::1", "localhost"]),
    "max_num_seqs": st.integers(1, 512).map(str),
    "dtype": st.sampled_from(["auto", "bfloat16", "float16"]),
    "enforce_eager": st.none(),
    "seed": st.integers(-5, 5).map(str),
}
Option = tuple[str, str | None]
options = st.lists(
    st.sampled_from(sorted(OPTIONS)).flatmap(
        lambda name: OPTIONS[name].map(lambda value: (name, value))
    ),
    max_size=6,
)


def _spelled(opts: list[Option], spelling: st.DrawFn) -> list[str]:
    """Each option as vLLM accepts it: dashes or underscores, `--x v` or `--x=v`."""
    out: list[str] = []
    for name, value in opts:
        flag = "--" + (name if spelling(st.booleans()) else name.replace("_", "-"))
        if value is None:
            out.append(flag)
        elif spelling(st.booleans()):
            out.append(f"{flag}={value}")
        else:
            out += [flag, value]
    return out


def _config(argv: list[str]) -> InstanceConfig | None:
    try:
        return InstanceConfig(name="a", argv=tuple(argv))
    except pydantic.ValidationError:
        return None


def _runtime(argv: list[str]) -> LocalRuntime | None:
    try:
        return LocalRuntime([LocalInstanceSpec("a", tuple(argv))], NOWHERE)
    except ValueError:
        return None


@settings(max_examples=300, deadline=None)
@given(launcher=st.sampled_from(LAUNCHERS + NOT_SERVERS), opts=options, spelling=st.data())
def test_config_and_runtime_agree_on_every_command_line(
    launcher: list[str], opts: list[Option], spelling: st.DataObject
) -> None:
    argv = [*launcher, *_spelled(opts, spelling.draw)]
    config, runtime = _config(argv), _runtime(argv)
    assert (config is None) == (runtime is None), argv
    if config is not None and runtime is not None:
        assert config.url == runtime.instances()[0].url, argv


@settings(max_examples=300, deadline=None)
@given(
    launchers=st.tuples(st.sampled_from(LAUNCHERS), st.sampled_from(LAUNCHERS)),
    opts=options,
    spelling=st.data(),
)
def test_one_server_written_two_ways_has_one_fingerprint(
    launchers: tuple[list[str], list[str]], opts: list[Option], spelling: st.DataObject
) -> None:
    first = [*launchers[0], *_spelled(opts, spelling.draw)]
    second = [*launchers[1], *_spelled(opts, spelling.draw)]
    assume(_config(first) is not None)  # a study is built from a valid configuration
    assert _study(first) == _study(second), (first, second)


def _study(argv: list[str]) -> str:
    """The study's fingerprint as `build_study` takes it: the model, and the argv as flags."""
    return fingerprint(parse_server_argv(argv).model or "", argv, "workload", Slo())
