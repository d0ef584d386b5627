"""The request-length histograms and the finished-request counter, read from recorded vLLM
`/metrics` bodies; absent or malformed values are None (with the refusal), never a raise."""

from __future__ import annotations

from pathlib import Path

from kvpilot.collectors.vllm_parse import kept_for_counters, parse_vllm_metrics

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm"


def _parse(text: str):  # type: ignore[no-untyped-def]
    return parse_vllm_metrics(text, taken_at_s=1.0, wall_time_s=1.0)


def test_a_real_server_s_request_histograms_and_finished_requests() -> None:
    (sample,) = _parse((FIXTURES / "v0_32_under_load.prom").read_text())
    prompt, output = sample.request_prompt_tokens, sample.request_generation_tokens
    assert prompt is not None and output is not None
    assert (prompt.count, prompt.sum) == (81.0, 23932.0)
    assert (output.count, output.sum) == (81.0, 48805.0)
    assert prompt.buckets[-1] == (float("inf"), 81.0)
    assert dict(prompt.buckets)[500.0] == 81.0 and dict(prompt.buckets)[200.0] == 1.0
    # vllm:request_success_total, summed over its finished_reason series (81 "length").
    assert sample.requests_success_total == 81.0
    assert sample.refused == ()


def test_every_engine_of_a_data_parallel_server_has_its_own() -> None:
    samples = _parse((FIXTURES / "v0_32_dp2_under_load.prom").read_text())
    assert len(samples) == 2
    assert all(s.request_prompt_tokens is not None for s in samples)
    assert all(s.requests_success_total is not None for s in samples)


def test_the_idle_server_has_zeros_and_an_old_one_none() -> None:
    (idle,) = _parse((FIXTURES / "v0_32_idle.prom").read_text())
    assert idle.requests_success_total == 0.0
    assert idle.request_prompt_tokens is not None and idle.request_prompt_tokens.count == 0
    (old,) = _parse((FIXTURES / "v0_older_engine.prom").read_text())
    assert old.requests_success_total is None
    assert old.request_prompt_tokens is None and old.request_generation_tokens is None


_SUCCESS = 'vllm:request_success_total{{engine="0",finished_reason="{r}",model_name="m"}} {v}\n'
_GAUGE = 'vllm:num_requests_running{engine="0",model_name="m"} 1\n'


def test_a_malformed_counter_is_none_with_its_reason() -> None:
    text = _GAUGE + _SUCCESS.format(r="stop", v="5") + _SUCCESS.format(r="length", v="NaN")
    (sample,) = _parse(text)
    assert sample.requests_success_total is None
    assert [r.field for r in sample.refused] == ["requests_success_total"]
    negative = _GAUGE + _SUCCESS.format(r="stop", v="-3")
    assert _parse(negative)[0].requests_success_total is None


def test_a_series_twice_with_different_values_is_refused() -> None:
    text = _GAUGE + _SUCCESS.format(r="stop", v="5") + _SUCCESS.format(r="stop", v="6")
    (sample,) = _parse(text)
    assert sample.requests_success_total is None
    assert sample.refused[0].reason == "duplicate_series"
    same_twice = _GAUGE + _SUCCESS.format(r="stop", v="5") * 2 + _SUCCESS.format(r="abort", v="2")
    assert _parse(same_twice)[0].requests_success_total == 7.0


def test_a_histogram_without_its_inf_bucket_is_none() -> None:
    text = _GAUGE + (
        'vllm:request_prompt_tokens_bucket{engine="0",le="10.0",model_name="m"} 3\n'
        'vllm:request_prompt_tokens_sum{engine="0",model_name="m"} 12\n'
        'vllm:request_prompt_tokens_count{engine="0",model_name="m"} 3\n'
    )
    (sample,) = _parse(text)
    assert sample.request_prompt_tokens is None


def test_kept_for_counters_drops_the_histograms_keeps_the_counter() -> None:
    (sample,) = _parse((FIXTURES / "v0_32_under_load.prom").read_text())
    kept = kept_for_counters(sample)
    assert kept.request_prompt_tokens is None and kept.request_generation_tokens is None
    assert kept.requests_success_total == 81.0
