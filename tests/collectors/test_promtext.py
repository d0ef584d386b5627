"""The Prometheus text parser: agreement with prometheus_client, tolerance, and its one error."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.collectors.promtext import (
    MetricSample,
    MetricsParseError,
    SampleLimitError,
    parse_samples,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm"
VALID = sorted(
    p
    for p in FIXTURES.glob("*.prom")
    if p.name != "truncated.prom"  # cut mid-line on purpose
)


def _key(name: str, labels: dict[str, str] | tuple[tuple[str, str], ...], value: float):
    pairs = tuple(sorted(dict(labels).items()))
    return (name, pairs, "nan" if math.isnan(value) else value)


@pytest.mark.parametrize("path", VALID, ids=lambda p: p.name)
def test_agrees_with_prometheus_client_on_every_fixture(path: Path) -> None:
    text = path.read_text()
    ours = Counter(_key(s.name, s.labels, s.value) for s in parse_samples(text))
    theirs = Counter(
        _key(s.name, s.labels, s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
    )
    assert ours == theirs
    assert ours  # the fixture is not empty


def test_prefixes_keep_only_matching_names() -> None:
    text = (FIXTURES / "v0_32_under_load.prom").read_text()
    everything = parse_samples(text)
    vllm_only = parse_samples(text, prefixes=("vllm:",))
    assert vllm_only == [s for s in everything if s.name.startswith("vllm:")]
    two = parse_samples(text, prefixes=("vllm:num_requests_running", "process_open_fds"))
    assert {s.name for s in two} == {"vllm:num_requests_running", "process_open_fds"}


def test_labels_are_sorted_and_values_unescaped() -> None:
    text = 'm{z="1",a="q\\"uote",b="back\\\\slash",c="new\\nline",d="a}b, c=\\"x\\""} 2\n'
    [sample] = parse_samples(text)
    assert sample == MetricSample(
        name="m",
        labels=(
            ("a", 'q"uote'),
            ("b", "back\\slash"),
            ("c", "new\nline"),
            ("d", 'a}b, c="x"'),
            ("z", "1"),
        ),
        value=2.0,
    )


def test_special_values_timestamps_and_openmetrics_bits() -> None:
    text = (
        "# TYPE a gauge\n"
        "a NaN\n"
        'b{x="1"} +Inf 1700000000000\n'
        "c -Inf\r\n"
        'd{x="1",} 1.5e3 1700000000.5\n'
        'e_bucket{le="0.5"} 3 # {trace_id="abc"} 0.4 1700000000\n'
        "\n"
        "  \n"
        "f_created 1.7e9\n"
        "# EOF\n"
        "this is after EOF and ignored\n"
    )
    samples = {s.name: s for s in parse_samples(text)}
    assert math.isnan(samples["a"].value)
    assert samples["b"].value == math.inf
    assert samples["c"].value == -math.inf
    assert samples["d"].value == 1500.0 and samples["d"].labels == (("x", "1"),)
    assert samples["e_bucket"].value == 3.0
    assert samples["f_created"].value == 1.7e9
    assert len(samples) == 6


@pytest.mark.parametrize(
    ("text", "line_no"),
    [
        ("ok 1\n<html>\n", 2),
        ("ok 1\nok2 one\n", 2),
        ("m{a=1} 2\n", 1),
        ('m{a="1" 2\n', 1),
        ('m{a="1",a="2"} 2\n', 1),
        ("m 1 2 3\n", 1),
        ("m\n", 1),
        ("m 1_000\n", 1),
        ("m{} 1 abc\n", 1),
        ("\n\n9lives 1\n", 3),
        ('m{a="1"}2\n', 1),
    ],
)
def test_invalid_lines_raise_with_line_number(text: str, line_no: int) -> None:
    with pytest.raises(MetricsParseError) as info:
        parse_samples(text)
    assert info.value.line_no == line_no
    assert f"line {line_no}" in str(info.value)


def test_error_excerpt_is_short() -> None:
    with pytest.raises(MetricsParseError) as info:
        parse_samples("x" * 500 + " y\n")
    assert len(info.value.excerpt) <= 83
    assert info.value.excerpt.startswith("xxx")


def test_skipped_lines_still_refuse_what_is_no_exposition() -> None:
    with pytest.raises(MetricsParseError):
        parse_samples("<html><body>oops</body></html>\n", prefixes=("vllm:",))


def test_truncated_last_line_is_parsed_even_when_skipped_by_prefix() -> None:
    text = (FIXTURES / "truncated.prom").read_text()
    with pytest.raises(MetricsParseError):
        parse_samples(text, prefixes=("vllm:",))
    with pytest.raises(MetricsParseError):
        parse_samples("vllm:a 1\nprocess_x{a=", prefixes=("vllm:",))
    # A complete last line without a newline is fine, and kept only if it matches.
    assert [s.name for s in parse_samples("vllm:a 1\nprocess_x 2", prefixes=("vllm:",))] == [
        "vllm:a"
    ]


def test_empty_and_comment_only_text_has_no_samples() -> None:
    assert parse_samples("") == []
    assert parse_samples("# HELP x y\n# TYPE x gauge\n") == []


@settings(max_examples=400, deadline=None, derandomize=True, database=None)
@given(st.text())
def test_arbitrary_text_raises_only_parse_errors(text: str) -> None:
    try:
        parse_samples(text)
        parse_samples(text, prefixes=("vllm:", "a"))
    except MetricsParseError:
        pass


_ALPHABET = st.sampled_from([*'ab_:{}"=, \t\n\r#\\0123456789.eE+-InfNaEOFle', "# EOF\n"])


@settings(max_examples=600, deadline=None, derandomize=True, database=None)
@given(st.lists(_ALPHABET, max_size=80).map("".join))
def test_exposition_like_text_raises_only_parse_errors(text: str) -> None:
    try:
        for sample in parse_samples(text):
            assert isinstance(sample.value, float)
            assert list(sample.labels) == sorted(sample.labels)
    except MetricsParseError:
        pass


def test_the_sample_limit_counts_every_sample_line_and_no_comment() -> None:
    text = '# HELP a A.\n# TYPE a gauge\na 1\nb 2\n\nc{x="y"} 3\n'
    assert len(parse_samples(text, sample_limit=3)) == 3
    # Lines skipped by the prefixes count too: the limit is on the body, not on what is kept.
    with pytest.raises(SampleLimitError) as caught:
        parse_samples(text, prefixes=("c",), sample_limit=2)
    assert isinstance(caught.value, MetricsParseError)
    assert caught.value.limit == 2 and caught.value.line_no == 6
    assert "more than 2 samples" in str(caught.value)
