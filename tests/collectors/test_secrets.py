"""The one masking module: argv flags, environment variables, URLs, free text and values."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpilot.collectors.secrets import (
    MASK,
    SecretLost,
    argv_secrets,
    env_secrets,
    has_masked,
    is_secret_name,
    mask,
    mask_argv,
    mask_env,
    mask_text,
    mask_url,
    restore_secrets,
    url_secrets,
)

PINNED = settings(derandomize=True, deadline=None, max_examples=300)
MODULE_FORM = [
    "/opt/venv/bin/python3",
    "-m",
    "vllm.entrypoints.openai.api_server",
    "--model",
    "/models/llama",
    "--port",
    "9001",
    "--api-key",
    "k1",
    "k2",
    "--max-num-batched-tokens",
    "2048",
    "--hf_token=hf_abc",
    "--enforce-eager",
]


@pytest.mark.parametrize(
    "name",
    [
        "--api-key",
        "--api_key",
        "--hf-token",
        "VLLM_API_KEY",
        "HF_TOKEN",
        "hmac_secret",
        "DB_PASSWORD",
        "X-Api-Key",
        "apiKey",
        "passwd",
    ],
)
def test_names_that_say_key_token_secret_or_password_are_secret(name: str) -> None:
    assert is_secret_name(name)


@pytest.mark.parametrize(
    "name",
    [
        "--max-num-batched-tokens",
        "--skip-tokenizer-init",
        "--tokenizer",
        "--port",
        "--ssl-keyfile",
        "--kv-cache-memory-bytes",
        "HF_HUB_OFFLINE",
    ],
)
def test_other_names_are_not(name: str) -> None:
    assert not is_secret_name(name)


def test_mask_argv_hides_every_value_of_secret_flags_in_either_spelling() -> None:
    masked = mask_argv(MODULE_FORM)
    assert masked == [
        "/opt/venv/bin/python3",
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        "/models/llama",
        "--port",
        "9001",
        "--api-key",
        MASK,
        MASK,
        "--max-num-batched-tokens",
        "2048",
        "--hf_token=***",
        "--enforce-eager",
    ]
    assert argv_secrets(MODULE_FORM) == ("k1", "k2", "hf_abc")
    serve = ["vllm", "serve", "m", "--api_key", "k1", "--api-key=k2", "--port", "1"]
    assert mask_argv(serve) == [
        "vllm",
        "serve",
        "m",
        "--api_key",
        MASK,
        "--api-key=***",
        "--port",
        "1",
    ]
    assert mask_argv(["vllm", "serve", "m"]) == ["vllm", "serve", "m"]


def test_mask_argv_reads_bare_flag_lists_and_known_secrets() -> None:
    args = ["--model", "m", "--api-key", "sk-1", "--served-model-name", "sk-known-1"]
    assert mask_argv(args, ["sk-known-1"]) == [
        "--model",
        "m",
        "--api-key",
        MASK,
        "--served-model-name",
        MASK,
    ]


def test_restore_takes_the_masked_secrets_back_from_the_argv_they_came_from() -> None:
    source = ["vllm", "serve", "m", "--api-key", "k1", "--api_key=k2", "--max-num-seqs", "8"]
    changed = [*source[:-1], "16"]
    stored = mask_argv(changed)
    assert has_masked(stored)
    assert restore_secrets(stored, source) == tuple(changed)
    assert restore_secrets(changed, ["vllm", "serve", "m"]) == tuple(changed)  # nothing masked
    with pytest.raises(SecretLost):
        restore_secrets(stored, ["vllm", "serve", "m"])


def test_env_values_of_secret_names_are_masked() -> None:
    env = {"VLLM_API_KEY": "sk-env", "HF_HUB_OFFLINE": "1"}
    assert mask_env(env) == {"VLLM_API_KEY": MASK, "HF_HUB_OFFLINE": "1"}
    assert env_secrets(env) == ("sk-env",)


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("http://127.0.0.1:9/alerts?token=abc&v=1", "http://127.0.0.1:9/alerts?token=***&v=***"),
        ("https://user:pw@am.example:9093", "https://***@am.example:9093"),
        ("https://hooks.slack.com/services/T0/B0/XYZ", "https://hooks.slack.com/***"),
        ("http://x/cb#access_token=abc", "http://x/cb#access_token=***"),
        ("http://127.0.0.1:8000", "http://127.0.0.1:8000"),
    ],
)
def test_mask_url_keeps_where_it_points_and_hides_its_secrets(url: str, shown: str) -> None:
    assert mask_url(url) == shown


def test_url_secrets_name_the_parts_to_search_for() -> None:
    assert url_secrets("https://u:pw@h/p?token=abc") == ("u:pw", "pw", "abc")
    assert url_secrets("http://h/services/T/B/X", path_is_secret=True) == ("/services/T/B/X",)
    assert mask_url("http://h/services/T/B/X", path_is_secret=True) == "http://h/***"


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("HTTP 404: Cannot POST /hook?token=abc123", "HTTP 404: Cannot POST /hook?token=***"),
        ("args: {'model': 'm', 'api_key': ['sk-1']}", "args: {'model': 'm', 'api_key': ['***']}"),
        ('{"password": "hunter22", "api_key": null}', '{"password": "***", "api_key": null}'),
        ("Authorization: Bearer abcdefghij", "Authorization: Bearer ***"),
        ("VLLM_API_KEY=sk-1 HF_HUB_OFFLINE=1", "VLLM_API_KEY=*** HF_HUB_OFFLINE=1"),
        ("vllm serve m --api-key sk-1 --port 1", "vllm serve m --api-key *** --port 1"),
        ("see https://u:p@h/x?a=b", "see https://***@h/x?a=***"),
        # prose keeps its words; numbers that are not secrets stay
        (
            "--api-key in argv is visible to every user",
            "--api-key in argv is visible to every user",
        ),
        ("max_num_batched_tokens=2048", "max_num_batched_tokens=2048"),
    ],
)
def test_mask_text_finds_what_reads_as_a_secret(text: str, shown: str) -> None:
    assert mask_text(text) == shown


def test_known_secrets_are_masked_anywhere_and_short_ones_only_as_values() -> None:
    assert mask_text("got sk-known-value back", ["sk-known-value"]) == "got *** back"
    assert mask_text("a b c", ["a"]) == "a b c"  # too short to search for in prose


def test_mask_walks_json_like_values() -> None:
    value = {"argv": ["--api-key", "x"], "n": 1, "reason": "token=abcd", "t": ("a", "b")}
    assert mask(value) == {
        "argv": ["--api-key", MASK],
        "n": 1,
        "reason": "token=***",
        "t": ("a", "b"),
    }


# A secret as keys are written: starts with a letter or digit, holds a digit somewhere.
_SECRET = st.from_regex(r"[a-z0-9][a-zA-Z0-9_-]{4,18}[0-9]", fullmatch=True)
_WORDS = st.lists(
    st.sampled_from(["--port", "8000", "--model", "m", "alerts", "failed:", "=", "&", " ", "/"]),
    max_size=6,
)


@PINNED
@given(secret=_SECRET, before=_WORDS, after=_WORDS)
def test_a_known_secret_never_survives_and_masking_is_idempotent(
    secret: str, before: list[str], after: list[str]
) -> None:
    text = " ".join([*before, secret, *after])
    once = mask_text(text, [secret])
    assert secret not in once
    assert mask_text(once, [secret]) == once


@PINNED
@given(
    secret=_SECRET,
    spelling=st.sampled_from(["--api-key", "--api_key", "--hf-token"]),
    joined=st.booleans(),
)
def test_a_secret_flag_never_survives_in_argv_or_text(
    secret: str, spelling: str, joined: bool
) -> None:
    argv = ["vllm", "serve", "m", *([f"{spelling}={secret}"] if joined else [spelling, secret])]
    masked = mask_argv(argv)
    assert secret not in " ".join(masked)
    assert secret not in mask_text(" ".join(argv))
