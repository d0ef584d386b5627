"""Layers of settings: the YAML over the product's defaults, `KVPILOT_*` over the YAML. Mappings
merge field by field, lists are replaced whole; overrides are read within the same bounds."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvpilot.agent.config import AgentConfig, ConfigError, load_config, validate_config
from kvpilot.agent.rules.config import (
    FragmentationConfig,
    FragmentationSourceConfig,
    RulesConfig,
)

BASE: dict[str, Any] = {"runtime": {"kind": "process", "port": 8000}}


def load(tmp_path: Path, data: dict[str, Any], environ: dict[str, str] | None = None) -> Any:
    path = tmp_path / "kvpilot.yaml"
    path.write_text(yaml.safe_dump({**BASE, **data}))
    return load_config(path, environ or {}, warn=False)


def test_a_partial_rule_keeps_the_rest_of_its_default(tmp_path: Path) -> None:
    rules = {"fragmentation": {"allocator": {"threshold_ratio": 0.4}}}
    fragmentation = load(tmp_path, {"rules": rules}).rules.fragmentation
    assert fragmentation.allocator == FragmentationSourceConfig(
        threshold_ratio=0.4, action="restart"
    )
    assert fragmentation.kv_blocks == FragmentationConfig().kv_blocks


def test_a_partial_rule_from_the_environment_keeps_its_default(tmp_path: Path) -> None:
    env = {"KVPILOT_RULES__FRAGMENTATION__ALLOCATOR__THRESHOLD_RATIO": "0.4"}
    allocator = load(tmp_path, {}, env).rules.fragmentation.allocator
    assert (allocator.threshold_ratio, allocator.action) == (0.4, "restart")


def test_the_user_can_still_change_the_default_action(tmp_path: Path) -> None:
    rules = {"fragmentation": {"allocator": {"action": "alert"}}}
    assert load(tmp_path, {"rules": rules}).rules.fragmentation.allocator.action == "alert"


def test_every_rule_default_survives_a_partial_override() -> None:
    # Whatever one field a user sets, every other field keeps the product's default.
    defaults = RulesConfig()
    for group, value in defaults.model_dump().items():
        if group == "external_labels":
            continue  # labels for every alert, not a rule
        sources = value.items() if group == "fragmentation" else [(None, value)]
        for source, fields in sources:
            given = {"enabled": not fields["enabled"]}
            data = {group: {source: given} if source else given}
            rule = getattr(RulesConfig.model_validate(data), group)
            rule = getattr(rule, source) if source else rule
            expected = {**fields, **given}
            assert rule.model_dump() == expected, (group, source)


def test_models_built_in_code_are_taken_as_given() -> None:
    allocator = FragmentationSourceConfig(threshold_ratio=0.5)  # the class's own default: alert
    assert FragmentationConfig(allocator=allocator).allocator.action == "alert"


def test_an_environment_mapping_merges_into_the_yamls(tmp_path: Path) -> None:
    rules = {"fragmentation": {"allocator": {"threshold_ratio": 0.4}}}
    env = {"KVPILOT_RULES__FRAGMENTATION__ALLOCATOR": "{for_s: 5}"}
    allocator = load(tmp_path, {"rules": rules}, env).rules.fragmentation.allocator
    assert (allocator.threshold_ratio, allocator.for_s, allocator.action) == (0.4, 5, "restart")


def test_an_environment_list_replaces_the_yamls_whole(tmp_path: Path) -> None:
    hooks = [
        {"kind": "webhook", "name": "a", "url": "http://a.example/"},
        {"kind": "webhook", "name": "b", "url": "http://b.example/"},
    ]
    env = {"KVPILOT_NOTIFIERS": "[{kind: webhook, name: c, url: 'http://c.example/'}]"}
    config = load(tmp_path, {"notifiers": hooks}, env)
    assert [n.name for n in config.notifiers] == ["c"]


def test_an_indexed_override_edits_one_list_item(tmp_path: Path) -> None:
    hooks = [{"kind": "webhook", "name": "a", "url": "http://a.example/"}]
    env = {"KVPILOT_NOTIFIERS__0": "{url: 'http://z.example/'}"}
    (notifier,) = load(tmp_path, {"notifiers": hooks}, env).notifiers
    assert (notifier.name, notifier.url) == ("a", "http://z.example/")


def test_an_alias_bomb_in_a_variable_is_refused(tmp_path: Path) -> None:
    levels = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    levels += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 10)]
    env = {"KVPILOT_RULES__ENGINE_STALL__LABELS": "{" + ", ".join(levels) + "}"}
    with pytest.raises(ConfigError) as caught:
        load(tmp_path, {}, env)
    (problem,) = caught.value.problems
    assert problem.startswith("KVPILOT_RULES__ENGINE_STALL__LABELS: line 1, column ")
    assert problem.endswith("more than 100000 values once aliases are expanded")


def test_overrides_cannot_nest_past_the_bound(tmp_path: Path) -> None:
    name = "KVPILOT_RULES" + "__X" * 40
    with pytest.raises(ConfigError, match="nested deeper than 32 levels"):
        load(tmp_path, {}, {name: "1"})
    deep_value = "[" * 31 + "1" + "]" * 31  # 32 levels: fine alone, one too deep where it lands
    with pytest.raises(ConfigError, match=re.escape("notifiers.0.0...: nested deeper")):
        load(tmp_path, {}, {"KVPILOT_NOTIFIERS": deep_value})


def test_a_unicode_digit_is_no_list_index(tmp_path: Path) -> None:
    hooks = [{"kind": "webhook", "name": "a", "url": "http://a.example/"}]
    with pytest.raises(ConfigError, match="no list item ³ to override"):
        load(tmp_path, {"notifiers": hooks}, {"KVPILOT_NOTIFIERS__³__URL": "http://b/"})


def test_data_from_options_is_held_to_the_same_bounds() -> None:
    with pytest.raises(ConfigError, match="more than 100000 values"):
        validate_config({**BASE, "notifiers": [["x"] * 1000] * 101}, {})
    assert isinstance(validate_config(BASE, {}), AgentConfig)
