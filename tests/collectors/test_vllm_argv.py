"""vLLM's launch forms are recognised and read, other command lines are not; flags are read,
compared and edited in every spelling vLLM accepts."""

from __future__ import annotations

import pytest

from kvpilot.collectors.vllm_argv import (
    NotAVllmServer,
    canonical_flags,
    flag_value,
    flag_values,
    has_flag,
    is_vllm_server,
    launch_form,
    launch_split,
    parse_server_argv,
    set_flag,
    without_flags,
)

MODULE_FORM = [
    "/opt/venv/bin/python3",
    "-m",
    "vllm.entrypoints.openai.api_server",
    "--model",
    "/models/llama",
    "--host",
    "10.0.0.5",
    "--port",
    "9001",
    "--api-key",
    "k1",
    "k2",
    "--shutdown-timeout",
    "30",
    "--served-model-name",
    "llama",
    "--enforce-eager",
]
SERVE_FORM = [
    "/usr/local/bin/vllm",
    "serve",
    "meta-llama/Llama-3.1-8B",
    "--port=8100",
    "--api-key=sk-abc",
    "--enforce-eager",
    "--shutdown-timeout=10",
]


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
    with pytest.raises(NotAVllmServer, match="--port must be a TCP port"):
        parse_server_argv(["vllm", "serve", "m", "--port=70000"])


@pytest.mark.parametrize(
    ("argv", "form"),
    [
        (["vllm", "serve", "m"], "vllm-serve"),
        (["/opt/venv/bin/vllm", "serve", "m", "--port", "8001"], "vllm-serve"),
        (["python3", "-m", "vllm.entrypoints.cli.main", "serve", "m"], "vllm-serve"),
        (["python", "-mvllm.entrypoints.cli.main", "serve", "m"], "vllm-serve"),
        (["python", "-m", "vllm.entrypoints.openai.api_server"], "module"),
        (["/usr/bin/python3.11", "-u", "-m", "vllm.entrypoints.openai.api_server"], "module"),
        (["vllm", "bench", "m"], None),
        (["python", "-m", "vllm.other"], None),
        (["pythonic", "-m", "vllm.entrypoints.openai.api_server"], None),
        (["python", "-c", "x", "-m", "vllm.entrypoints.openai.api_server"], None),
    ],
)
def test_launch_forms(argv: list[str], form: str | None) -> None:
    assert launch_form(argv) == form
    assert launch_form(tuple(argv)) == form


def test_launch_split_keeps_the_prefix_apart() -> None:
    argv = ["python3", "-X", "dev", "-m", "vllm.entrypoints.cli.main", "serve", "m", "--port", "1"]
    assert launch_split(argv) == ("vllm-serve", ["m", "--port", "1"])


@pytest.mark.parametrize(
    "flags",
    [
        ["--max-num-seqs", "16"],
        ["--max-num-seqs=16"],
        ["--max_num_seqs", "16"],
        ["--max_num_seqs=16"],
        ["--max-num-seqs", "4", "--max_num_seqs=16"],  # the last wins, as in argparse
    ],
)
def test_a_flag_reads_the_same_in_every_spelling(flags: list[str]) -> None:
    argv = ["vllm", "serve", "m", *flags, "--enforce-eager"]
    assert flag_value(argv, "--max-num-seqs") == "16"
    assert flag_value(argv, "--max_num_seqs") == flag_value(argv, "max_num_seqs") == "16"


def test_values_bare_flags_and_negative_numbers() -> None:
    argv = ["vllm", "serve", "m", "--enforce-eager", "--seed", "-1", "--api-key", "a", "b"]
    assert has_flag(argv, "--enforce-eager") and flag_values(argv, "--enforce-eager") == ()
    assert flag_value(argv, "--enforce-eager") is None
    assert flag_value(argv, "--seed") == "-1"  # a negative number is a value
    assert flag_values(argv, "--api-key") == ("a", "b")
    assert not has_flag(argv, "--port") and flag_value(argv, "--port") is None
    # The launch prefix is no flag: `serve` and the model are not values of anything.
    assert (
        flag_value(["python", "-X", "dev", "-m", "vllm.entrypoints.openai.api_server"], "-X")
        is None
    )


def test_a_json_field_keeps_its_underscores() -> None:
    argv = ["vllm", "serve", "m", "--compilation_config.cudagraph_mode", "NONE"]
    assert flag_value(argv, "--compilation-config.cudagraph_mode") == "NONE"
    assert canonical_flags(argv) == [
        ["--compilation-config.cudagraph_mode", "NONE"],
        ["--model", "m"],
    ]


def test_canonical_flags_are_one_for_every_way_of_writing_a_server() -> None:
    ways = [
        ["vllm", "serve", "/m", "--dtype", "half", "--enforce-eager", "--port=1"],
        ["/opt/bin/vllm", "serve", "/m", "--port", "1", "--enforce-eager", "--dtype=half"],
        [
            "python3",
            "-m",
            "vllm.entrypoints.cli.main",
            "serve",
            "/m",
            "--port",
            "1",
            "--dtype",
            "float32",
            "--enforce_eager",
            "--dtype",
            "half",
        ],
        [
            "python",
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model=/m",
            "--port",
            "1",
            "--dtype",
            "half",
            "--enforce-eager",
        ],
    ]
    expected = [["--dtype", "half"], ["--enforce-eager", ""], ["--model", "/m"], ["--port", "1"]]
    assert [canonical_flags(w) for w in ways] == [expected] * len(ways)
    # Bare flags (no launch prefix) read as they are; positionals keep their text.
    assert canonical_flags(["--a_b=1", "x", "--c"]) == [["", "x"], ["--a-b", "1"], ["--c", ""]]


def test_set_flag_replaces_every_spelling_and_keeps_the_prefix() -> None:
    argv = ("vllm", "serve", "m", "--port=8000", "--dtype", "half", "--port", "8001")
    assert set_flag(argv, "--port", 9000) == (
        "vllm",
        "serve",
        "m",
        "--dtype",
        "half",
        "--port",
        "9000",
    )
    assert set_flag(("vllm", "serve", "m"), "--max_num_seqs", 4) == (
        "vllm",
        "serve",
        "m",
        "--max-num-seqs",
        "4",
    )


def test_booleans_are_set_and_removed_in_either_polarity() -> None:
    argv = ("vllm", "serve", "m", "--no-enable-prefix-caching", "--dtype", "half")
    assert set_flag(argv, "--enable-prefix-caching", True) == (
        "vllm",
        "serve",
        "m",
        "--dtype",
        "half",
        "--enable-prefix-caching",
    )
    assert set_flag(argv, "--enable_prefix_caching", False)[-1] == "--no-enable-prefix-caching"
    # A boolean flag takes no value: what follows it stays.
    assert without_flags(("--enforce-eager", "x", "--port", "1"), bare=["--enforce-eager"]) == (
        "x",
        "--port",
        "1",
    )


def test_without_flags_takes_a_flags_values_with_it() -> None:
    argv = (
        "python",
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        "m",
        "--api-key",
        "a",
        "b",
        "--kv_cache_memory_bytes=5",
        "--port",
        "1",
    )
    assert without_flags(argv, ["--api-key", "--kv-cache-memory-bytes"]) == (
        "python",
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        "m",
        "--port",
        "1",
    )
