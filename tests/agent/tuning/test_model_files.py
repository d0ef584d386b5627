"""Finding the model's config.json: configured, a mounted folder, or the Hugging Face cache
(a cache tree laid out as `huggingface_hub` writes it, built in tmp_path)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpilot.agent.model_files import ModelConfigNotFound, find_model_config, hub_cache

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cached_model(hub: Path, model: str, *, ref: str = "main", commit: str = COMMIT) -> Path:
    repo = hub / ("models--" + model.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / ref).write_text(commit)  # no newline, as huggingface_hub writes it
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    return snapshot / "config.json"


def test_the_configured_file_or_folder_wins(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    for configured in (tmp_path / "m", tmp_path / "m" / "config.json"):
        found = find_model_config("Org/Name", configured=configured, environ={}, home=tmp_path)
        assert found == tmp_path / "m" / "config.json"


def test_a_wrong_configured_path_is_an_error_not_a_fallback(tmp_path: Path) -> None:
    cached_model(tmp_path / "hf" / "hub", "Org/Name")
    with pytest.raises(ModelConfigNotFound, match=r"runtime\.model_config") as caught:
        find_model_config(
            "Org/Name",
            configured=tmp_path / "nope",
            environ={"HF_HOME": str(tmp_path / "hf")},
            home=tmp_path,
        )
    assert caught.value.looked == (f"{tmp_path / 'nope'} (runtime.model_config)",)


def test_a_mounted_model_folder(tmp_path: Path) -> None:
    (tmp_path / "models" / "qwen").mkdir(parents=True)
    (tmp_path / "models" / "qwen" / "config.json").write_text("{}")
    found = find_model_config(str(tmp_path / "models" / "qwen"), environ={}, home=tmp_path)
    assert found == tmp_path / "models" / "qwen" / "config.json"


def test_the_hf_home_snapshot_of_refs_main(tmp_path: Path) -> None:
    expected = cached_model(tmp_path / "hf" / "hub", "Qwen/Qwen2.5-1.5B-Instruct")
    # An older snapshot beside it is not the one refs/main names.
    (expected.parent.parent / "f00d").mkdir()
    (expected.parent.parent / "f00d" / "config.json").write_text("{}")
    found = find_model_config(
        "Qwen/Qwen2.5-1.5B-Instruct", environ={"HF_HOME": str(tmp_path / "hf")}, home=tmp_path
    )
    assert found == expected


def test_hf_hub_cache_wins_over_hf_home_and_a_revision_is_honoured(tmp_path: Path) -> None:
    cached_model(tmp_path / "hf" / "hub", "Org/Name")
    expected = cached_model(tmp_path / "hub2", "Org/Name", ref="v2", commit="beef")
    environ = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_CACHE": str(tmp_path / "hub2")}
    found = find_model_config("Org/Name", revision="v2", environ=environ, home=tmp_path)
    assert found == expected
    # A commit hash as the revision names the snapshot directly.
    direct = find_model_config("Org/Name", revision="beef", environ=environ, home=tmp_path)
    assert direct == expected


def test_the_default_cache_is_under_home(tmp_path: Path) -> None:
    assert hub_cache({}, tmp_path) == tmp_path / ".cache" / "huggingface" / "hub"
    assert hub_cache({"XDG_CACHE_HOME": "/x"}, tmp_path) == Path("/x/huggingface/hub")
    expected = cached_model(tmp_path / ".cache" / "huggingface" / "hub", "Org/Name")
    assert find_model_config("Org/Name", environ={}, home=tmp_path) == expected


def test_not_found_lists_every_place_looked(tmp_path: Path) -> None:
    hub = tmp_path / "hf" / "hub"
    repo = hub / "models--Org--Name"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT + "\n")  # the snapshot itself is missing
    with pytest.raises(ModelConfigNotFound) as caught:
        find_model_config("Org/Name", environ={"HF_HOME": str(tmp_path / "hf")}, home=tmp_path)
    message = str(caught.value)
    assert "Org/Name/config.json (--model as a folder)" in message
    assert str(repo / "snapshots" / COMMIT / "config.json") in message
    assert "runtime.model_config" in message and "HF_HOME" in message
    assert len(caught.value.looked) == 2


def test_a_revision_cannot_climb_out_of_the_cache(tmp_path: Path) -> None:
    with pytest.raises(ModelConfigNotFound, match="not a ref or commit"):
        find_model_config("Org/Name", revision="../../etc", environ={}, home=tmp_path)
