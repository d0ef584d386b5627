"""The bounded YAML reader: file size, depth and values with aliases expanded, at the edges."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvpilot.agent.config import ConfigError, load_config
from kvpilot.agent.config.bounded_yaml import (
    MAX_DEPTH,
    MAX_FILE_BYTES,
    MAX_VALUES,
    YamlInputError,
    check_shape,
    load_yaml,
    read_yaml_file,
)


def nested_flow(depth: int) -> str:
    """A document `depth` levels deep: depth - 1 sequences around a scalar."""
    return "[" * (depth - 1) + "x" + "]" * (depth - 1)


def test_the_bounds_are_the_documented_ones() -> None:
    assert (MAX_FILE_BYTES, MAX_DEPTH, MAX_VALUES) == (1024 * 1024, 32, 100_000)
    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    assert "1 MiB" in readme and "32 levels" in readme and "100000 values" in readme


def test_depth_up_to_the_bound_is_read_one_more_is_refused() -> None:
    assert load_yaml(nested_flow(MAX_DEPTH)) is not None
    with pytest.raises(YamlInputError, match=r"line 1, column 33: nested deeper than 32 levels"):
        load_yaml(nested_flow(MAX_DEPTH + 1))


def test_block_nesting_counts_like_flow_nesting() -> None:
    lines = [" " * i + f"k{i}:" for i in range(MAX_DEPTH)]
    with pytest.raises(YamlInputError, match="nested deeper than 32 levels"):
        load_yaml("\n".join(lines) + " x\n")


def test_an_alias_counts_at_the_depth_it_expands_to() -> None:
    # Each part is shallow; the alias puts one inside the other.
    half = MAX_DEPTH // 2 + 1
    text = f"a: &a {nested_flow(half)}\nb: {'[' * (half - 1)}*a{']' * (half - 1)}\n"
    with pytest.raises(YamlInputError, match="nested deeper than 32 levels"):
        load_yaml(text)


def test_values_are_counted_with_aliases_expanded() -> None:
    ten = "[" + ", ".join(["x"] * 9) + "]"  # 10 values
    within = f"a: &a {ten}\nb: [{', '.join(['*a'] * 900)}]\n"  # about 9,000 values
    assert len(load_yaml(within)["b"]) == 900
    beyond = f"a: &a {ten}\nb: &b [{', '.join(['*a'] * 1000)}]\nc: [{', '.join(['*b'] * 10)}]\n"
    with pytest.raises(YamlInputError, match="more than 100000 values once aliases are expanded"):
        load_yaml(beyond)


def test_a_billion_laughs_is_refused_before_it_expands() -> None:
    lines = ['l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 10)]
    started = time.monotonic()
    with pytest.raises(YamlInputError, match=r"line 6, column \d+: more than 100000 values"):
        load_yaml("\n".join(lines))
    assert time.monotonic() - started < 1.0


def test_merge_keys_of_merge_keys_are_refused_too() -> None:
    lines = ["m0: &m0 {a: 1, b: 2, c: 3, d: 4, e: 5, f: 6, g: 7, h: 8, i: 9}"]
    lines += [f"m{i}: &m{i} {{<<: [{', '.join([f'*m{i - 1}'] * 9)}]}}" for i in range(1, 10)]
    with pytest.raises(YamlInputError, match="more than 100000 values"):
        load_yaml("\n".join(lines))


def test_a_recursive_alias_is_refused() -> None:
    with pytest.raises(YamlInputError, match="the alias refers to a collection that contains it"):
        load_yaml("a: &a {b: *a}\n")


def test_ordinary_anchors_still_work() -> None:
    text = "base: &base {for_s: 10, severity: critical}\nrule: {<<: *base, for_s: 5}\n"
    assert load_yaml(text)["rule"] == {"for_s": 5, "severity": "critical"}


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("a: [1, 2", "not valid YAML: "),
        ("a: 1\n---\nb: 2\n", "not valid YAML: expected a single document"),
        ("a: \x00", "not valid YAML: unacceptable character #x0000"),
        ("a: !!python/name:os.system x", "not valid YAML: could not determine a constructor"),
        ("a: " + "9" * 5000, "not a value kvpilot can read: Exceeds the limit"),
        ("a: !!timestamp x", "not a value kvpilot can read"),
        ("a: 2001-02-30", "not a value kvpilot can read: day is out of range"),
    ],
)
def test_malformed_yaml_is_one_error(text: str, says: str) -> None:
    with pytest.raises(YamlInputError) as caught:
        load_yaml(text)
    assert str(caught.value).startswith(says)


def test_a_file_at_the_size_bound_is_read_one_byte_more_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_bytes(b"a: 1\n" + b"#" * (MAX_FILE_BYTES - 6) + b"\n")
    assert read_yaml_file(path) == {"a": 1}
    path.write_bytes(b"a: 1\n" + b"#" * (MAX_FILE_BYTES - 5) + b"\n")
    with pytest.raises(YamlInputError, match=r"larger than 1048576 bytes \(1 MiB\)"):
        read_yaml_file(path)


def test_the_encoding_error_names_the_offset_and_line(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_bytes(b"a: 1\nb: \xff\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert caught.value.problems == (
        f"{path}: not UTF-8 text: invalid start byte at byte offset 8 (line 2)",
    )


def test_a_utf8_byte_order_mark_is_fine(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_bytes("\ufeffa: é\n".encode())
    assert read_yaml_file(path) == {"a": "é"}


def _deep(levels: int) -> dict[str, Any]:
    data: dict[str, Any] = {}
    node = data
    for _ in range(levels - 2):
        node["k"] = {}
        node = node["k"]
    node["k"] = "leaf"
    return data


def test_check_shape_counts_as_the_loader_does() -> None:
    check_shape(_deep(MAX_DEPTH))
    assert yaml.safe_dump(_deep(MAX_DEPTH)) and load_yaml(yaml.safe_dump(_deep(MAX_DEPTH)))
    with pytest.raises(YamlInputError, match=re.escape("k.k.k...: nested deeper")):
        check_shape(_deep(MAX_DEPTH + 1))
    with pytest.raises(YamlInputError, match="nested deeper"):
        load_yaml(yaml.safe_dump(_deep(MAX_DEPTH + 1)))
    shared = ["x"] * 1000
    with pytest.raises(YamlInputError, match="more than 100000 values"):
        check_shape({"a": [shared] * 101})
