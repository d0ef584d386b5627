"""vLLM /metrics payloads to EngineSamples, checked against prometheus_client's own reading."""

from __future__ import annotations

import contextlib
import math
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.collectors.histogram import Histogram
from kvpilot.collectors.promtext import MetricsParseError, SampleLimitError
from kvpilot.collectors.vllm_metrics import EngineSample, parse_vllm_metrics

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm"


def load(name: str) -> str:
    return (FIXTURES / name).read_text()


def parse(text: str) -> tuple[EngineSample, ...]:
    return parse_vllm_metrics(text, taken_at_s=100.0, wall_time_s=1.7e9)


def reference(text: str, name: str, **labels: str) -> float | None:
    """The value prometheus_client reads for one sample (the test's independent oracle)."""
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return None


def reference_histogram(text: str, base: str, **labels: str) -> Histogram:
    buckets = []
    total = count = None
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if not all(s.labels.get(k) == v for k, v in labels.items()):
                continue
            if s.name == base + "_bucket":
                buckets.append((float(s.labels["le"]), s.value))
            elif s.name == base + "_sum":
                total = s.value
            elif s.name == base + "_count":
                count = s.value
    assert buckets and total is not None and count is not None
    return Histogram(buckets=tuple(sorted(buckets)), sum=total, count=count)


def cache_label(text: str, label: str, engine: str | None = None) -> str:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "vllm:cache_config_info" and (
                engine is None or s.labels.get("engine") == engine
            ):
                return s.labels[label]
    raise AssertionError(f"no cache_config_info label {label}")


@pytest.mark.parametrize(
    "fixture",
    ["v0_32_under_load.prom", "v0_32_multiprocess_under_load.prom", "v0_32_idle.prom"],
)
def test_single_engine_payloads_match_the_reference_reading(fixture: str) -> None:
    text = load(fixture)
    [e] = parse(text)
    model = reference_model(text)
    sel = {"model_name": model, "engine": "0"}
    assert e.key == (model, "0")
    assert (e.taken_at_s, e.wall_time_s) == (100.0, 1.7e9)
    assert e.kv_usage_ratio == reference(text, "vllm:kv_cache_usage_perc", **sel)
    assert e.requests_running == reference(text, "vllm:num_requests_running", **sel)
    assert e.requests_waiting == reference(text, "vllm:num_requests_waiting", **sel)
    assert e.preemptions_total == reference(text, "vllm:num_preemptions_total", **sel)
    assert e.prompt_tokens_total == reference(text, "vllm:prompt_tokens_total", **sel)
    assert e.generation_tokens_total == reference(text, "vllm:generation_tokens_total", **sel)
    assert e.prefix_cache_queries_total == reference(text, "vllm:prefix_cache_queries_total", **sel)
    assert e.prefix_cache_hits_total == reference(text, "vllm:prefix_cache_hits_total", **sel)
    assert e.iterations_total == reference(text, "vllm:iteration_tokens_total_count", **sel)
    for field, base in [
        ("ttft", "vllm:time_to_first_token_seconds"),
        ("inter_token_latency", "vllm:inter_token_latency_seconds"),
        ("e2e_latency", "vllm:e2e_request_latency_seconds"),
        ("queue_time", "vllm:request_queue_time_seconds"),
        ("prefill_time", "vllm:request_prefill_time_seconds"),
        ("decode_time", "vllm:request_decode_time_seconds"),
        ("iteration_tokens", "vllm:iteration_tokens_total"),
    ]:
        assert getattr(e, field) == reference_histogram(text, base, **sel), field
    num_gpu_blocks = int(cache_label(text, "num_gpu_blocks"))
    assert e.num_gpu_blocks == num_gpu_blocks
    assert e.blocks_total == num_gpu_blocks - 1  # one engine, one null block
    assert e.block_size == int(cache_label(text, "block_size"))
    assert e.blocks_free == round(e.blocks_total * (1 - e.kv_usage_ratio))
    assert dict(e.cache_config)["kv_cache_memory_bytes"] == cache_label(
        text, "kv_cache_memory_bytes"
    )


def reference_model(text: str) -> str:
    value = None
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "vllm:num_requests_running":
                value = s.labels["model_name"]
    assert value is not None
    return value


def test_under_load_capture_shows_pressure() -> None:
    # The main capture was taken under load: what the rest of the tests rely on is there.
    [e] = parse(load("v0_32_under_load.prom"))
    assert e.kv_usage_ratio is not None and e.kv_usage_ratio > 0.5
    assert e.requests_waiting and e.requests_waiting > 0
    assert e.preemptions_total and e.preemptions_total > 0
    assert e.ttft is not None and e.ttft.count > 0
    assert e.blocks_free is not None and 0 <= e.blocks_free < e.blocks_total


def test_two_data_parallel_engines() -> None:
    text = load("v0_32_dp2_under_load.prom")
    engines = parse(text)
    assert [e.engine for e in engines] == ["0", "1"]
    num_gpu_blocks = int(cache_label(text, "num_gpu_blocks", engine="0"))
    for e in engines:
        sel = {"model_name": e.model_name, "engine": e.engine}
        assert e.kv_usage_ratio == reference(text, "vllm:kv_cache_usage_perc", **sel)
        assert e.requests_waiting == reference(text, "vllm:num_requests_waiting", **sel)
        assert e.generation_tokens_total == reference(text, "vllm:generation_tokens_total", **sel)
        assert e.ttft == reference_histogram(text, "vllm:time_to_first_token_seconds", **sel)
        # num_gpu_blocks is the sum over the engines; each has its own null block.
        assert e.num_gpu_blocks == num_gpu_blocks
        assert e.blocks_total == num_gpu_blocks // 2 - 1
        assert e.blocks_free == round(e.blocks_total * (1 - e.kv_usage_ratio))
        assert dict(e.cache_config)["engine"] == e.engine
    assert engines[0].generation_tokens_total != engines[1].generation_tokens_total


def test_older_engine_names_and_no_engine_label() -> None:
    text = load("v0_older_engine.prom")
    [e] = parse(text)
    assert e.key == ("tiny-llama", "0")
    assert e.kv_usage_ratio == reference(text, "vllm:gpu_cache_usage_perc")
    assert e.inter_token_latency == reference_histogram(text, "vllm:time_per_output_token_seconds")
    assert e.ttft == reference_histogram(text, "vllm:time_to_first_token_seconds")
    assert e.preemptions_total == reference(text, "vllm:num_preemptions_total")
    assert e.num_gpu_blocks == int(cache_label(text, "num_gpu_blocks"))
    assert e.blocks_total == e.num_gpu_blocks - 1
    # What the older server does not export stays unknown.
    assert e.iterations_total is None and e.queue_time is None
    assert e.prefix_cache_queries_total is None


def test_new_names_win_when_both_are_exported() -> None:
    text = (
        'vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.9\n'
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
        'vllm:time_per_output_token_seconds_bucket{engine="0",le="1.0",model_name="m"} 9\n'
        'vllm:time_per_output_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 9\n'
        'vllm:time_per_output_token_seconds_sum{engine="0",model_name="m"} 3\n'
        'vllm:inter_token_latency_seconds_bucket{engine="0",le="1.0",model_name="m"} 2\n'
        'vllm:inter_token_latency_seconds_bucket{engine="0",le="+Inf",model_name="m"} 2\n'
        'vllm:inter_token_latency_seconds_sum{engine="0",model_name="m"} 1\n'
        'vllm:inter_token_latency_seconds_count{engine="0",model_name="m"} 2\n'
    )
    [e] = parse(text)
    assert e.kv_usage_ratio == 0.25
    assert e.inter_token_latency == Histogram(buckets=((1.0, 2), (math.inf, 2)), sum=1, count=2)
    # Reversed order of appearance: still the new name.
    lines = text.splitlines(keepends=True)
    [e2] = parse("".join(reversed(lines)))
    assert e2.kv_usage_ratio == 0.25 and e2.inter_token_latency == e.inter_token_latency


def test_missing_families_are_none_and_unknown_ones_ignored() -> None:
    text = (
        'vllm:num_requests_running{engine="3",model_name="m"} 2\n'
        'vllm:some_future_metric{engine="3",model_name="m"} 7\n'
        'vllm:time_to_first_token_seconds_bucket{engine="3",le="1.0",model_name="m"} 1\n'
    )
    [e] = parse(text)
    assert e.key == ("m", "3")
    assert e.requests_running == 2
    assert e.kv_usage_ratio is None and e.blocks_total is None and e.blocks_free is None
    assert e.cache_config == () and e.num_gpu_blocks is None
    assert e.ttft is None  # no +Inf bucket and no sum: incomplete, so unknown


def test_unknown_block_count_gives_no_block_figures() -> None:
    text = (
        'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="None"} 1\n'
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5\n'
    )
    [e] = parse(text)
    assert e.block_size == 16 and e.num_gpu_blocks is None
    assert e.blocks_total is None and e.blocks_free is None
    assert e.kv_usage_ratio == 0.5


def test_only_unknown_vllm_families_still_name_the_engines() -> None:
    [e] = parse('vllm:some_future_metric{engine="1",model_name="m"} 7\n')
    assert e.key == ("m", "1") and e.kv_usage_ratio is None


def test_stats_disabled_payload_has_no_engines() -> None:
    text = load("v0_32_disable_log_stats.prom")
    assert reference(text, "process_open_fds") is not None  # a real exposition...
    assert parse(text) == ()  # ...with no engine in it


@pytest.mark.parametrize("fixture", ["truncated.prom", "garbage.txt", "error_502.html"])
def test_broken_payloads_raise_parse_errors(fixture: str) -> None:
    with pytest.raises(MetricsParseError):
        parse(load(fixture))


def test_every_truncation_of_the_real_payload_parses_or_raises_cleanly() -> None:
    text = load("v0_32_under_load.prom")
    for cut in range(0, len(text), 97):
        with contextlib.suppress(MetricsParseError):
            parse(text[:cut])


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(st.text())
def test_arbitrary_text_raises_only_parse_errors(text: str) -> None:
    with contextlib.suppress(MetricsParseError):
        parse(text)


_REAL_LINES = load("v0_32_under_load.prom").splitlines(keepends=True)


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(st.lists(st.sampled_from(_REAL_LINES), max_size=60), st.text(max_size=20))
def test_shuffled_real_lines_with_noise_raise_only_parse_errors(
    lines: list[str], noise: str
) -> None:
    try:
        for e in parse("".join(lines) + noise):
            assert e.engine == "0"
    except MetricsParseError:
        pass


# -- values checked at the edge -------------------------------------------------------

ENGINE0 = '{engine="0",model_name="rig/models/tiny-llama"}'


def with_series(name: str, *values: str) -> str:
    """The under-load payload with engine 0's series `name` given `values` (two: a duplicate)."""
    out = []
    for line in load("v0_32_under_load.prom").splitlines():
        if line.startswith(name + ENGINE0 + " "):
            out.extend(f"{name}{ENGINE0} {v}" for v in values)
        else:
            out.append(line)
    return "\n".join(out) + "\n"


def refused(engine: EngineSample) -> set[tuple[str, str]]:
    return {(r.field, r.reason) for r in engine.refused}


@pytest.mark.parametrize("path", sorted(FIXTURES.glob("v0*.prom")), ids=lambda p: p.name)
def test_real_payloads_refuse_nothing(path: Path) -> None:
    for engine in parse(path.read_text()):
        assert engine.refused == ()


@pytest.mark.parametrize(
    ("name", "values", "field", "reason"),
    [
        ("vllm:kv_cache_usage_perc", ("+Inf",), "kv_usage_ratio", "non_finite"),
        ("vllm:kv_cache_usage_perc", ("NaN",), "kv_usage_ratio", "non_finite"),
        ("vllm:kv_cache_usage_perc", ("1.5",), "kv_usage_ratio", "out_of_range"),
        ("vllm:kv_cache_usage_perc", ("-0.5",), "kv_usage_ratio", "out_of_range"),
        ("vllm:kv_cache_usage_perc", ("0.2", "0.9"), "kv_usage_ratio", "duplicate_series"),
        ("vllm:num_requests_running", ("-3",), "requests_running", "negative"),
        ("vllm:num_requests_waiting", ("2.5",), "requests_waiting", "not_integer"),
        ("vllm:num_preemptions_total", ("-35",), "preemptions_total", "negative"),
        ("vllm:generation_tokens_total", ("-Inf",), "generation_tokens_total", "non_finite"),
    ],
)
def test_impossible_values_are_none_with_their_reason(
    name: str, values: tuple[str, ...], field: str, reason: str
) -> None:
    (engine,) = parse(with_series(name, *values))
    assert getattr(engine, field) is None
    assert refused(engine) == {(field, reason)}
    assert engine.requests_running == 33 or field == "requests_running"  # the rest is kept


def test_an_impossible_usage_gives_no_free_blocks() -> None:
    (engine,) = parse(with_series("vllm:kv_cache_usage_perc", "1.5"))
    assert engine.blocks_total is not None and engine.blocks_free is None


def test_a_series_repeated_with_the_same_value_is_one_series() -> None:
    (engine,) = parse(with_series("vllm:kv_cache_usage_perc", "0.5", "0.5"))
    assert engine.kv_usage_ratio == 0.5 and engine.refused == ()
    bucket = "vllm:time_to_first_token_seconds_bucket"
    text = load("v0_32_under_load.prom")
    line = next(ln for ln in text.splitlines() if ln.startswith(bucket))
    (engine,) = parse(text.replace(line, f"{line}\n{line}"))
    assert engine.ttft == parse(text)[0].ttft  # the bucket is not counted twice


def test_a_histogram_with_a_conflicting_bucket_is_none() -> None:
    text = load("v0_32_under_load.prom")
    line = next(
        ln for ln in text.splitlines() if ln.startswith("vllm:time_to_first_token_seconds_bucket")
    )
    head, value = line.rsplit(" ", 1)
    (engine,) = parse(text.replace(line, f"{line}\n{head} {float(value) + 1}"))
    assert engine.ttft is None and refused(engine) == {("ttft", "duplicate_series")}
    assert engine.e2e_latency is not None


def test_a_histogram_whose_buckets_go_down_is_none() -> None:
    text = load("v0_32_under_load.prom")
    name = "vllm:e2e_request_latency_seconds_bucket"
    lines = [ln for ln in text.splitlines() if ln.startswith(name)]
    head = lines[-2].rsplit(" ", 1)[0]  # the bucket below +Inf, above every other
    (engine,) = parse(text.replace(lines[-2], f"{head} 1e9"))
    assert engine.e2e_latency is None and refused(engine) == {("e2e_latency", "contradictory")}


@pytest.mark.parametrize(("label", "value"), [("num_gpu_blocks", "-5"), ("block_size", "0")])
def test_impossible_cache_config_labels_are_refused(label: str, value: str) -> None:
    text = load("v0_32_under_load.prom")
    text = re.sub(rf'{label}="\d+"', f'{label}="{value}"', text)
    (engine,) = parse(text)
    assert (label, "out_of_range") in refused(engine)
    field = "block_size" if label == "block_size" else "num_gpu_blocks"
    assert getattr(engine, field) is None


def test_the_sample_limit_applies_to_the_whole_body() -> None:
    text = load("v0_32_under_load.prom")
    samples = sum(1 for ln in text.splitlines() if ln and not ln.startswith("#"))
    assert parse_vllm_metrics(text, taken_at_s=0, wall_time_s=0, sample_limit=samples)
    with pytest.raises(SampleLimitError):
        parse_vllm_metrics(text, taken_at_s=0, wall_time_s=0, sample_limit=samples - 1)
