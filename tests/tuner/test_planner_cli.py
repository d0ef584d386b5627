"""`kvpilot plan` through typer: tables by default, JSON on request, clear failures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from kvpilot.agent.cli.plan_cmd import parse_size, register

CONFIGS = Path(__file__).parent / "configs"
LLAMA8B = str(CONFIGS / "meta-llama_Meta-Llama-3-8B.json")


@pytest.fixture
def app() -> typer.Typer:
    app = typer.Typer()
    register(app)

    @app.command("version")
    def version() -> None:  # a second command keeps typer from collapsing to one
        typer.echo("0")

    return app


def test_sizes_parse() -> None:
    assert parse_size("80GiB") == 80 * 1024**3
    assert parse_size("80GB") == 80 * 10**9
    assert parse_size("1.5 GiB") == 3 * 1024**3 // 2
    assert parse_size("123") == 123
    with pytest.raises(typer.BadParameter):
        parse_size("eighty")


def test_table_shows_the_plan(app: typer.Typer) -> None:
    result = CliRunner().invoke(
        app, ["plan", LLAMA8B, "--gpu-memory", "80GiB", "--gpu-free", "70GiB"]
    )
    assert result.exit_code == 0, result.output
    for text in (
        "grouped-query",
        "bytes per token",
        "131,072",
        "num_gpu_blocks",
        "activation peak (estimate)",
        "Context length against concurrency",
        "0.875",
    ):
        assert text in result.output


def test_json_carries_the_same_figures(app: typer.Typer) -> None:
    result = CliRunner().invoke(
        app,
        [
            "plan",
            LLAMA8B,
            "--gpu-memory",
            "80GiB",
            "--gpu-free",
            "80GiB",
            "--json",
            "--block-size",
            "32",
            "--kv-cache-dtype",
            "fp8",
            "--max-model-len",
            "4096",
            "--concurrency",
            "3",
            "--concurrency",
            "300",
        ],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["geometry"]["bytes_per_token"] == 32 * 8 * 256
    assert data["geometry"]["bytes_per_block"] == 32 * 8 * 256 * 32
    blocks = data["capacity"]["num_blocks"]
    assert blocks == data["budget"]["kv_cache_memory_bytes"] // (32 * 8 * 256 * 32)
    assert data["capacity"]["kv_cache_size_tokens"] == int(blocks / 128 * 4096)
    assert [row["concurrency"] for row in data["lengths_at_concurrency"]] == [3, 300]
    assert data["shape"]["attention_kind"] == "grouped-query"
    assert data["budget"]["estimates"] == [
        "non_torch_bytes",
        "activation_peak_bytes",
        "cuda_graph_bytes",
    ]


def test_weights_that_do_not_fit_exit_2(app: typer.Typer) -> None:
    result = CliRunner().invoke(
        app,
        [
            "plan",
            str(CONFIGS / "meta-llama_Meta-Llama-3-70B.json"),
            "--gpu-memory",
            "24GiB",
            "--gpu-free",
            "24GiB",
        ],
    )
    assert result.exit_code == 2
    assert "weights do not fit" in result.output and "short by" in result.output


def test_no_room_for_one_request_exits_1(app: typer.Typer) -> None:
    result = CliRunner().invoke(
        app,
        [
            "plan",
            LLAMA8B,
            "--kv-cache-memory-bytes",
            "100MiB",
            "--gpu-free",
            "1GiB",
            "--gpu-memory",
            "80GiB",
        ],
    )
    assert result.exit_code == 1
    assert "will not start" in result.output


def test_not_a_decoder_exits_2(app: typer.Typer, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertModel"]}))
    result = CliRunner().invoke(
        app, ["plan", str(tmp_path), "--gpu-memory", "80GiB", "--gpu-free", "80GiB"]
    )
    assert result.exit_code == 2
    assert "not a decoder model" in result.output
