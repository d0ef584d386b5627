"""The PromQL label checker itself: each kind of clause found, each misuse reported."""

from __future__ import annotations

import pytest
from promql_labels import PromQLSyntaxError, check, result_labels, tokens

KNOWN = {
    "mem": frozenset({"instance", "job", "gpu", "owner"}),
    "reqs": frozenset({"instance", "job", "engine"}),
    "waiting": frozenset({"instance", "job", "engine"}),
    "info": frozenset({"instance", "job", "engine", "version"}),
    "hist_bucket": frozenset({"instance", "le", "model_name"}),
    "ALERTS": None,
}


def _problems(expr: str) -> list[tuple[str, str, str]]:
    return [(p.label, p.use, p.where) for p in check(expr, KNOWN)]


def test_tokens_keep_strings_ranges_and_names_with_colons() -> None:
    assert tokens('rate(a:b_c{x=~"y,}"}[5m] offset 1m) > 0.5') == [
        ("ident", "rate"),
        ("op", "("),
        ("ident", "a:b_c"),
        ("op", "{"),
        ("ident", "x"),
        ("op", "=~"),
        ("string", '"y,}"'),
        ("op", "}"),
        ("range", "[5m]"),
        ("ident", "offset"),
        ("number", "1m"),
        ("op", ")"),
        ("op", ">"),
        ("number", "0.5"),
    ]


@pytest.mark.parametrize(
    ("expr", "expected"),
    [
        ('mem{role="server"}', [("role", "selects", "mem")]),
        ('mem{owner="server", gpu=~"$gpu"}', []),
        ("sum by (instance, role) (mem)", [("role", "groups by", "mem")]),
        ("sum(mem) by (gpu, pid)", [("pid", "groups by", "mem")]),
        ("max without (owner, pid) (mem)", [("pid", "drops", "mem")]),
        ("reqs > 0 and on (instance, gpu) mem > 1", [("gpu", "joins on", "reqs")]),
        ("reqs * on (engine) group_left (version) info", []),
        ("reqs * on (engine) group_left (model) info", [("model", "copies", "info")]),
        ("reqs + waiting", []),
        (
            "reqs + mem",
            [
                ("gpu", "matches on", "reqs"),
                ("owner", "matches on", "reqs"),
                ("engine", "matches on", "mem"),
            ],
        ),
        ("histogram_quantile(0.99, sum by (le) (rate(hist_bucket[5m])))", []),
        (
            "histogram_quantile(0.99, sum by (model_name) (rate(hist_bucket[5m])))",
            [("le", "reads buckets by", "sum by (model_name)")],
        ),
        ("absent(nowhere)", [("__name__", "reads", "nowhere")]),
        ('ALERTS{anything="goes"}', []),
        ("deriv(rec:mem[30m]) > 1", [("__name__", "reads", "rec:mem")]),
        ('label_replace(reqs, "e", "$1", "engines", "(.*)")', [("engines", "copies", "reqs")]),
        ("-sum by (job) (rate(reqs[1m:10s] offset 5m)) ^ 2 ^ 2 or vector(0)", []),
    ],
)
def test_each_use_of_a_label_is_checked(expr: str, expected: list) -> None:
    assert sorted(_problems(expr)) == sorted(expected)


def test_result_labels_follow_aggregations_joins_and_functions() -> None:
    assert result_labels("sum by (instance, gpu) (mem)", KNOWN) == {"instance", "gpu"}
    assert result_labels("max without (owner) (mem)", KNOWN) == {"instance", "job", "gpu"}
    assert result_labels("reqs * on (engine) group_left (version) info", KNOWN) == (
        KNOWN["reqs"] | {"version"}
    )
    assert result_labels("rate(hist_bucket[1m])", KNOWN) == KNOWN["hist_bucket"]
    assert result_labels("count(reqs)", KNOWN) == frozenset()


@pytest.mark.parametrize("expr", ["sum by (a (mem)", "mem{a=}", "rate(mem[5m]", "mem ! 1"])
def test_what_is_not_promql_is_refused(expr: str) -> None:
    with pytest.raises(PromQLSyntaxError):
        check(expr, KNOWN)
