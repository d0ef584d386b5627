"""Secrets masked before anything leaves the process: one way to mask, used by every writer.

What is a secret:
- the value of an argv flag or environment variable whose name says key, token, secret or
  password (`--api-key X`, `--api_key=X`, `--hf-token X`, `VLLM_API_KEY`); `--max-num-batched-
  tokens` is not one: a name's word must end in one of those, and "tokens" does not;
- a URL's user-info, its query and fragment values, and the path of a Slack webhook (there
  the path is the token);
- in free text, the same: `--api-key X`, `token=X`, `"password": "X"`, `Bearer X`, any URL;
- any value the caller knows to be secret (the configuration's), wherever it appears.

The mask is `***` in place of the value only: the flag, variable or parameter name stays,
so a reader sees that a key is set. Masking is idempotent. Known secrets shorter than
`MIN_KNOWN_CHARS` are masked where they stand as values, never searched in free text (a
two-letter secret would turn every log line into stars and protect nothing).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from kvpilot.collectors.vllm_argv import FlagSpan, flag_spans

MASK = "***"
MIN_KNOWN_CHARS = 6
_SECRET_WORD_ENDS = ("key", "token", "secret", "password", "passwd")
# Hosts whose webhook URLs carry the token in the path.
_PATH_IS_SECRET_HOSTS = frozenset({"hooks.slack.com", "hooks.slack-gov.com"})

_URL = re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]*://[^\s\"'<>\\`]+")
_AUTHORIZATION = re.compile(r"(?i)(\bauthorization[\"']?\s*[:=]\s*[\"']?)(\w+ )?([^\s\"',;]+)")
_BEARER = re.compile(r"\bBearer ([A-Za-z0-9._~+/-]{8,}=*)")
# `--name value`, `--name=value` and an argv's repr (`'--name', 'value'`) in text; the name
# is checked in code.
_FLAG = re.compile(
    r"(?<![\w-])(--?[A-Za-z][\w.-]*)(=|[ \t]+|[\"'],\s*[\"'])(?!-)(\"[^\"]*\"|'[^']*'|[^\s\"',;]+)"
)
# `name=value`, `name: value`, `"name": "value"`, `'name': ['value']`; only a name that ends
# in a secret word is matched, so that no other assignment swallows the text after it.
_ASSIGN = re.compile(
    r"(?i)(?<![a-z0-9])([a-z0-9_.-]*(?:key|token|secret|password|passwd))(?![a-z0-9])"
    r"([\"']?)(\s*[=:]\s*)(\[?[\"']?)([^\s\"',;&?#)\]}]+)"
)


def is_secret_name(name: str) -> bool:
    """Whether a flag, variable or parameter name says key, token, secret or password."""
    return any(word.endswith(_SECRET_WORD_ENDS) for word in re.findall(r"[a-z0-9]+", name.lower()))


def _value_like(value: str) -> bool:
    """Text after a spaced separator that reads as a value, not as the next word of prose
    (`--api-key in argv is visible`): long, or not all lower-case letters."""
    return len(value) >= 8 or not value.isalpha() or not value.islower()


# --- URLs -------------------------------------------------------------------------------


def _path_is_secret(host: str | None, path_is_secret: bool) -> bool:
    return path_is_secret or (host or "").lower() in _PATH_IS_SECRET_HOSTS


def _mask_pairs(text: str) -> str:
    """`a=1&b=2` as `a=***&b=***`; a bare item is masked whole."""
    pairs = []
    for pair in text.split("&"):
        name, eq, _ = pair.partition("=")
        pairs.append(f"{name}={MASK}" if eq else (MASK if pair else pair))
    return "&".join(pairs)


def mask_url(url: str, *, path_is_secret: bool = False) -> str:
    """The URL with its user-info, query and fragment values masked, and its path when it is
    the secret (a Slack webhook, or `path_is_secret`). Text that is no URL is masked as text."""
    try:
        parts = urlsplit(url)
        host = parts.hostname
    except ValueError:
        return MASK  # unparseable: nothing of it can be shown safely
    if not parts.scheme or "://" not in url:
        return _mask_patterns(url)  # not a URL: masked as text
    netloc = parts.netloc
    if "@" in netloc:
        netloc = f"{MASK}@{netloc.rpartition('@')[2]}"
    path = parts.path
    if _path_is_secret(host, path_is_secret) and path not in ("", "/"):
        path = "/" + MASK
    query = _mask_pairs(parts.query) if parts.query else ""
    fragment = _mask_pairs(parts.fragment) if parts.fragment else ""
    return urlunsplit((parts.scheme, netloc, path, query, fragment))


def url_secrets(url: str, *, path_is_secret: bool = False) -> tuple[str, ...]:
    """The secret parts of a URL, to search for in text: user-info (and its password), query
    and fragment values, the path where it is the secret."""
    try:
        parts = urlsplit(url)
        host = parts.hostname
    except ValueError:
        return (url,)
    found: list[str] = []
    if "@" in parts.netloc:
        userinfo = parts.netloc.rpartition("@")[0]
        found += [userinfo, userinfo.partition(":")[2]]
    for text in (parts.query, parts.fragment):
        found += [pair.partition("=")[2] or pair for pair in text.split("&") if text]
    if _path_is_secret(host, path_is_secret) and parts.path not in ("", "/"):
        found.append(parts.path)
    return tuple(s for s in found if s)


# --- argv and environment -------------------------------------------------------------


def mask_argv(argv: Sequence[str], secrets: Iterable[str] = ()) -> list[str]:
    """The argv with every secret flag's values masked, in either spelling (`--api-key X`,
    `--api_key=X`), and each argument masked as text (URLs, known secrets)."""
    out = list(argv)
    for span in flag_spans(argv):
        if not is_secret_name(span.name):
            continue
        if "=" in out[span.start]:
            out[span.start] = out[span.start].split("=", 1)[0] + "=" + MASK
        for i in range(span.start + 1, span.end):
            out[i] = MASK
    known = _known(secrets)
    return [_mask_text(arg, known) for arg in out]


def argv_secrets(argv: Sequence[str]) -> tuple[str, ...]:
    """The values of the argv's secret flags."""
    return tuple(
        value for span in flag_spans(argv) if is_secret_name(span.name) for value in span.values
    )


def has_masked(argv: Sequence[str]) -> bool:
    """Whether an argv holds masked values (it was read back from storage)."""
    return any(MASK in arg for arg in argv)


class SecretLost(ValueError):
    """A masked secret cannot be put back: the argv it came from does not hold it."""


def restore_secrets(masked: Sequence[str], source: Sequence[str]) -> tuple[str, ...]:
    """`masked` (an argv as stored) with each flag whose values were masked taken back, as
    written, from `source` (the argv it was derived from: the configured or running one).
    Raises SecretLost when `source` lacks such a flag."""
    if not has_masked(masked):
        return tuple(masked)
    # The n-th occurrence of a flag comes from the n-th in `source` (a flag may repeat).
    by_name: dict[str, list[FlagSpan]] = {}
    for span in flag_spans(source):
        by_name.setdefault(span.name, []).append(span)
    seen: dict[str, int] = {}
    out: list[str] = []
    at = 0
    for span in flag_spans(masked):
        nth = seen[span.name] = seen.get(span.name, -1) + 1
        if not any(MASK in arg for arg in masked[span.start : span.end]):
            continue
        found = by_name.get(span.name, [])
        if nth >= len(found):
            raise SecretLost(f"{span.name} was stored masked and the running argv lacks it")
        real = found[nth]
        out += [*masked[at : span.start], *source[real.start : real.end]]
        at = span.end
    out += masked[at:]
    if any(MASK in arg for arg in out):
        raise SecretLost("a masked value outside the flags cannot be taken back")
    return tuple(out)


def mask_env(env: Mapping[str, str], secrets: Iterable[str] = ()) -> dict[str, str]:
    """The variables with the values of secret-named ones masked, the others as text."""
    known = _known(secrets)
    return {
        name: MASK if is_secret_name(name) else _mask_text(value, known)
        for name, value in env.items()
    }


def env_secrets(env: Mapping[str, str]) -> tuple[str, ...]:
    return tuple(value for name, value in env.items() if is_secret_name(name) and value)


# --- text and values ----------------------------------------------------------------------


def _known(secrets: Iterable[str]) -> tuple[str, ...]:
    """Known secrets long enough to search for, longest first (a secret holding another)."""
    return tuple(sorted({s for s in secrets if len(s) >= MIN_KNOWN_CHARS}, key=len, reverse=True))


def _flag(match: re.Match[str]) -> str:
    name, separator, value = match.groups()
    spaced = separator.strip() == ""
    if not is_secret_name(name) or (spaced and not _value_like(value)):
        return match.group(0)
    return f"{name}{separator}{MASK}"


def _assign(match: re.Match[str]) -> str:
    name, quote, separator, opening, value = match.groups()
    if not is_secret_name(name) or (separator.strip() != separator and not _value_like(value)):
        return match.group(0)
    return f"{name}{quote}{separator}{opening}{MASK}"


def _mask_patterns(text: str) -> str:
    text = _URL.sub(lambda m: mask_url(m.group(0)), text)
    text = _AUTHORIZATION.sub(lambda m: f"{m.group(1)}{m.group(2) or ''}{MASK}", text)
    text = _BEARER.sub(f"Bearer {MASK}", text)
    text = _FLAG.sub(_flag, text)
    return _ASSIGN.sub(_assign, text)


def _mask_text(text: str, known: tuple[str, ...]) -> str:
    for secret in known:
        text = text.replace(secret, MASK)
    return _mask_patterns(text) if text else text


def mask_text(text: str, secrets: Iterable[str] = ()) -> str:
    """Free text with the known `secrets` and everything that reads as a secret masked."""
    return _mask_text(text, _known(secrets))


def mask(value: Any, secrets: Iterable[str] = ()) -> Any:
    """Any JSON-like value masked: text as text, a list of strings as an argv, containers
    item by item (keys kept); numbers, booleans and None as they are."""
    return _mask_value(value, _known(secrets))


def _mask_value(value: Any, known: tuple[str, ...]) -> Any:
    if isinstance(value, str):
        return _mask_text(value, known)
    if isinstance(value, Mapping):
        return {key: _mask_value(item, known) for key, item in value.items()}
    if isinstance(value, list | tuple):
        if value and all(isinstance(item, str) for item in value):
            masked = mask_argv(value, known)
        else:
            masked = [_mask_value(item, known) for item in value]
        return tuple(masked) if isinstance(value, tuple) else masked
    return value
