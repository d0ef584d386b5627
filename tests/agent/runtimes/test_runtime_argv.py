"""Both vLLM launch forms are recognised and read; other command lines are not."""

from __future__ import annotations

import pytest

from kvpilot.agent.runtimes.vllm_argv import (
    NotAVllmServer,
    is_vllm_server,
    parse_server_argv,
    redacted,
)

MODULE_FORM = [
    "/opt/venv/bin/python3", "-m", "vllm.entrypoints.openai.api_server",
    "--model", "/models/llama", "--host", "10.0.0.5", "--port", "9001",
    "--api-key", "k1", "k2", "--shutdown-timeout", "30", "--served-model-name", "llama",
    "--enforce-eager",
]  # fmt: skip
SERVE_FORM = [
    "/usr/local/bin/vllm", "serve", "meta-llama/Llama-3.1-8B", "--port=8100",
    "--api-key=sk-abc", "--enforce-eager", "--shutdown-timeout=10",
]  # fmt: skip


def test_module_form() -> None:
    args = parse_server_argv(MODULE_FORM)
    assert args.form == "module"
    assert args.model == "/models/llama"
    assert (args.host, args.port) == ("10.0.0.5", 9001)
    assert args.url == "http://10.0.0.5:9001"
    assert args.api_key == "k1"  # --api-key takes several keys; any of them is accepted
    assert args.shutdown_timeout_s == 30
    assert args.served_model_name == "llama"


def test_serve_form_with_equals_options_and_defaults() -> None:
    args = parse_server_argv(SERVE_FORM)
    assert args.form == "vllm-serve"
    assert args.model == "meta-llama/Llama-3.1-8B"
    assert args.host is None
    assert args.port == 8100
    assert args.url == "http://127.0.0.1:8100"  # bound everywhere: reached on loopback
    assert args.api_key == "sk-abc"
    assert args.shutdown_timeout_s == 10
    assert args.served_model_name is None


@pytest.mark.parametrize(
    "argv",
    [
        ["vllm", "serve", "m"],
        ["python", "/usr/bin/vllm", "serve", "m"],
        ["python3.11", "-u", "-X", "dev", "-m", "vllm.entrypoints.cli.main", "serve", "m"],
        ["python", "-B", "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", "m"],
        ("python", "-m", "vllm.entrypoints.openai.api_server", "--model", "m"),
    ],
)
def test_launch_variants_are_servers(argv: list[str]) -> None:
    assert is_vllm_server(argv)
    args = parse_server_argv(argv)
    assert args.model == "m"
    assert args.port == 8000
    assert args.api_key is None and args.shutdown_timeout_s is None


def test_serve_form_model_from_the_option_when_no_positional() -> None:
    assert parse_server_argv(["vllm", "serve", "--model", "m2", "--port", "1"]).model == "m2"


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["vllm", "bench", "serve"],
        ["python", "-m", "vllm.entrypoints.cli.main", "bench"],
        ["python", "supervisor.py", "--", "python", "-m", "vllm.entrypoints.openai.api_server"],
        ["sh", "-c", "python -m vllm.entrypoints.openai.api_server --model m"],
        ["VLLM::EngineCore"],
        ["python", "-c", "import vllm"],
    ],
)
def test_other_command_lines_are_not_servers(argv: list[str]) -> None:
    assert not is_vllm_server(argv)
    with pytest.raises(NotAVllmServer, match="not a vLLM server"):
        parse_server_argv(argv)


def test_wildcard_and_ipv6_hosts() -> None:
    base = ["vllm", "serve", "m", "--host"]
    assert parse_server_argv([*base, "0.0.0.0"]).url == "http://127.0.0.1:8000"
    assert parse_server_argv([*base, "::"]).url == "http://127.0.0.1:8000"
    assert parse_server_argv([*base, "::1"]).url == "http://[::1]:8000"


def test_a_bad_port_is_named() -> None:
    with pytest.raises(NotAVllmServer, match="--port must be an integer"):
        parse_server_argv(["vllm", "serve", "m", "--port", "http"])


def test_redacted_hides_every_api_key_value() -> None:
    assert redacted(MODULE_FORM).count("***") == 2
    assert "k1" not in redacted(MODULE_FORM) and "k2" not in redacted(MODULE_FORM)
    assert redacted(SERVE_FORM)[4] == "--api-key=***"
    assert redacted(["vllm", "serve", "m"]) == ["vllm", "serve", "m"]
