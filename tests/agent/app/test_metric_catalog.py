"""The metric catalog is the single source of names: the README and promtool agree with it."""

from __future__ import annotations

import re
from pathlib import Path

from kvpilot.agent.app.metric_catalog import CATALOG, markdown_table

README = Path(__file__).resolve().parents[3] / "README.md"


def test_readme_table_is_generated_from_the_catalog() -> None:
    text = README.read_text()
    match = re.search(r"<!-- metric-table:start -->\n(.*?)\n<!-- metric-table:end -->", text, re.S)
    assert match, "README lacks the metric-table markers"
    assert match.group(1) == markdown_table(), "run `kvpilot metrics-table` and paste it"


def test_names_follow_prometheus_conventions() -> None:
    for name, spec in CATALOG.items():
        assert name.startswith("kvpilot_"), name
        assert re.fullmatch(r"[a-z_][a-z0-9_]*", name), name
        if spec.kind == "counter":
            assert name.endswith("_total"), name
        else:
            assert not name.endswith("_total"), name
        if spec.kind == "info":
            assert name.endswith("_info"), name
        assert spec.help.endswith("."), name
        assert len(set(spec.labels)) == len(spec.labels), name
