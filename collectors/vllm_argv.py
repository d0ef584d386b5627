"""A vLLM server's command line: its launch form, its flags read, compared and edited.

The one reading of a vLLM argv: the configuration's validation, the runtimes, the tuner's
fingerprint and the tuning's argv edits all go through it. It follows vLLM's own parser
(`FlexibleArgumentParser`) where that matters to kvpilot:

- launch forms: `vllm serve MODEL ...` (the `vllm` script by any path, or run as
  `python .../vllm serve ...`), `python -m vllm.entrypoints.cli.main serve MODEL ...` (what the
  script runs) and `python -m vllm.entrypoints.openai.api_server --model MODEL ...`, with any
  `python`, `python3` or `python3.11` by any path and the interpreter's own options before `-m`;
- a flag is `--flag value` or `--flag=value`, its name with dashes or underscores
  (`--max_num_seqs` is `--max-num-seqs`, up to the first `.` of a JSON field like
  `--compilation-config.level`); a repeated flag's last occurrence wins, as in argparse;
- a flag's values are the arguments after it up to the next option (a negative number is a
  value, not an option): `--api-key a b` has two, a bare `--enforce-eager` none. `vllm serve`
  takes its model first (`vllm serve [model_tag] [options]`), which is where it is read.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

from kvpilot.collectors.addresses import WILDCARD_HOSTS

LaunchForm = Literal["vllm-serve", "module"]

# `python -m <one of these>` runs the OpenAI-compatible server directly.
SERVER_MODULES = frozenset(
    {"vllm.entrypoints.openai.api_server", "vllm.entrypoints.launchers.api_server.entry"}
)
# `python -m <this> serve ...` is what the `vllm` console script runs.
CLI_MODULE = "vllm.entrypoints.cli.main"
DEFAULT_PORT = 8000
MODEL_FLAG = "--model"
_PYTHON = re.compile(r"python[0-9.]*")
# Python options that consume the next argument (python -X dev -m ...).
_PYTHON_OPTS_WITH_VALUE = frozenset({"-X", "-W", "-Q"})

FlagValue = str | int | float | bool


class NotAVllmServer(ValueError):
    """The command line is not one of vLLM's server launch forms, or not one it can serve."""


# --- launch forms ---------------------------------------------------------------------


def _is_python(arg: str) -> bool:
    return _PYTHON.fullmatch(os.path.basename(arg)) is not None


def _is_vllm_script(arg: str) -> bool:
    return os.path.basename(arg) == "vllm"


def _launch(argv: Sequence[str]) -> tuple[LaunchForm, int] | None:
    """The launch form and where the server's own arguments begin, or None."""
    argv = list(argv)
    if not argv:
        return None
    if _is_vllm_script(argv[0]):
        return ("vllm-serve", 2) if argv[1:2] == ["serve"] else None
    if not _is_python(argv[0]):
        return None
    i = 1
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("-m"):
            if arg == "-m":
                module, rest = (argv[i + 1] if i + 1 < len(argv) else ""), i + 2
            else:
                module, rest = arg[2:], i + 1  # `-mvllm.entrypoints...`
            if module in SERVER_MODULES:
                return "module", rest
            if module == CLI_MODULE and argv[rest : rest + 1] == ["serve"]:
                return "vllm-serve", rest + 1
            return None
        if arg == "-" or arg.startswith("-c"):
            return None  # a program given inline or on stdin
        if not arg.startswith("-"):  # a script: `python .../bin/vllm serve ...`
            if _is_vllm_script(arg) and argv[i + 1 : i + 2] == ["serve"]:
                return "vllm-serve", i + 2
            return None
        i += 2 if arg in _PYTHON_OPTS_WITH_VALUE else 1
    return None


def launch_split(argv: Sequence[str]) -> tuple[LaunchForm, list[str]] | None:
    """The launch form and the server's own arguments, or None for any other command."""
    found = _launch(argv)
    return None if found is None else (found[0], list(argv[found[1] :]))


def launch_form(argv: Sequence[str]) -> LaunchForm | None:
    """`vllm-serve` (the script or the CLI module), `module` (the API server), or None."""
    found = _launch(argv)
    return None if found is None else found[0]


def is_vllm_server(argv: Sequence[str]) -> bool:
    return _launch(argv) is not None


# --- flags ------------------------------------------------------------------------------


def is_option(arg: str) -> bool:
    """An option (`--x`, `--x=v`, `-x`), not a value: `-` and negative numbers are values."""
    if not arg.startswith("-") or arg == "-":
        return False
    try:
        float(arg)
    except ValueError:
        return True
    return False


def flag_name(arg: str) -> str | None:
    """The option's name as vLLM reads it (`--max_num_seqs=4`: `--max-num-seqs`), else None."""
    if not is_option(arg):
        return None
    name = arg.split("=", 1)[0]
    if not name.startswith("--"):
        return name  # a short option (-tp) is kept as written
    head, dot, field = name[2:].partition(".")
    return "--" + head.replace("_", "-") + dot + field


def negated(flag: str) -> str:
    """The `--no-` form of a boolean flag (`--enable-prefix-caching`: `--no-enable-...`)."""
    return "--no-" + _canonical(flag)[2:]


def _canonical(flag: str) -> str:
    name = flag_name(flag if flag.startswith("-") else "--" + flag)
    if name is None:
        raise ValueError(f"not a flag: {flag!r}")
    return name


@dataclass(frozen=True, slots=True)
class FlagSpan:
    """One option in the arguments: its name, where it starts, one past its last value."""

    name: str
    start: int
    end: int
    values: tuple[str, ...]


def _spans(args: Sequence[str]) -> Iterator[FlagSpan]:
    i = 0
    while i < len(args):
        name = flag_name(args[i])
        if name is None:
            i += 1  # a positional argument
            continue
        if "=" in args[i]:
            yield FlagSpan(name, i, i + 1, (args[i].split("=", 1)[1],))
            i += 1
            continue
        j = i + 1
        while j < len(args) and not is_option(args[j]):
            j += 1
        yield FlagSpan(name, i, j, tuple(args[i + 1 : j]))
        i = j


def _args_start(argv: Sequence[str]) -> int:
    """Where the flags begin: after the launch prefix of a server argv, else at once."""
    found = _launch(argv)
    return 0 if found is None else found[1]


def flag_spans(argv: Sequence[str]) -> list[FlagSpan]:
    """Each flag after the launch prefix (at once for bare flags): its name, its values, and
    where it starts and ends, as positions in `argv` itself."""
    start = _args_start(argv)
    return [
        FlagSpan(span.name, start + span.start, start + span.end, span.values)
        for span in _spans(argv[start:])
    ]


def flag_values(argv: Sequence[str], flag: str) -> tuple[str, ...] | None:
    """The values of the last `flag` in either spelling; () for a bare flag, None if absent."""
    name = _canonical(flag)
    found = None
    for span in _spans(argv[_args_start(argv) :]):
        if span.name == name:
            found = span.values
    return found


def flag_value(argv: Sequence[str], flag: str) -> str | None:
    """The (first) value of the last `flag`, or None when it is absent or bare."""
    values = flag_values(argv, flag)
    return values[0] if values else None


def has_flag(argv: Sequence[str], flag: str) -> bool:
    """Whether `flag` is given, with or without a value."""
    return flag_values(argv, flag) is not None


def canonical_flags(argv: Sequence[str]) -> list[list[str]]:
    """The flags as sorted [flag, value] pairs, the same for every way of writing one server:
    its launch form, either spelling, any order; a repeated flag counts once (the last). A
    server's model is `--model`; other positional arguments are ["", text], a bare flag's
    value "", several values are joined by spaces."""
    start = _args_start(argv)
    args = list(argv[start:])
    if start and launch_form(argv) == "vllm-serve" and args and not is_option(args[0]):
        args = [MODEL_FLAG, args[0], *args[1:]]  # `serve MODEL` is `--model MODEL`
    last: dict[str, str] = {}
    taken: set[int] = set()
    for span in _spans(args):
        last[span.name] = " ".join(span.values)
        taken.update(range(span.start, span.end))
    positional = [["", arg] for i, arg in enumerate(args) if i not in taken]
    return sorted([[name, value] for name, value in last.items()] + positional)


# --- editing ------------------------------------------------------------------------------


def without_flags(
    argv: Sequence[str], valued: Iterable[str] = (), bare: Iterable[str] = ()
) -> tuple[str, ...]:
    """`argv` without the `valued` flags and their values, nor the `bare` (boolean) flags in
    either polarity (`--x`, `--no-x`), each in any spelling; the launch prefix is kept."""
    drop_valued = {_canonical(f) for f in valued}
    drop_bare = {_canonical(f) for f in bare}
    drop_bare |= {negated(f) for f in drop_bare}
    start = _args_start(argv)
    args = list(argv[start:])
    gone: set[int] = set()
    for span in _spans(args):
        if span.name in drop_valued:
            gone.update(range(span.start, span.end))
        elif span.name in drop_bare:
            gone.add(span.start)  # a boolean flag takes no value: what follows stays
    return (*argv[:start], *(arg for i, arg in enumerate(args) if i not in gone))


def flag_argv(flag: str, value: FlagValue) -> list[str]:
    """One flag as vLLM's command line writes it: `--x v`, or `--x` / `--no-x` for a bool."""
    name = _canonical(flag)
    if isinstance(value, bool):
        return [name if value else negated(name)]
    return [name, str(value)]


def set_flag(argv: Sequence[str], flag: str, value: FlagValue) -> tuple[str, ...]:
    """`argv` with `flag` set to `value`: every occurrence in any spelling removed, then
    `flag value` (a bool: `--flag` or `--no-flag`) appended."""
    if isinstance(value, bool):
        return (*without_flags(argv, bare=[flag]), *flag_argv(flag, value))
    return (*without_flags(argv, valued=[flag]), *flag_argv(flag, value))


# --- what the agent reads from a server's command line ----------------------------------


@dataclass(frozen=True, slots=True)
class ServerArgs:
    """What a vLLM server's argv says about where it listens and how it shuts down."""

    form: LaunchForm
    model: str | None
    host: str | None  # None: vLLM binds every interface
    port: int
    api_key: str | None  # the first of --api-key's values
    shutdown_timeout_s: int | None  # None: vLLM's default (0, abort in-flight requests)
    served_model_name: str | None

    @property
    def probe_host(self) -> str:
        """Where the agent reaches it: loopback when the server binds every interface."""
        if self.host is None or self.host in WILDCARD_HOSTS:
            return "127.0.0.1"
        return f"[{self.host}]" if ":" in self.host else self.host

    @property
    def url(self) -> str:
        return f"http://{self.probe_host}:{self.port}"


def _int_flag(argv: Sequence[str], flag: str) -> int | None:
    text = flag_value(argv, flag)
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        raise NotAVllmServer(f"{flag} must be an integer, got {text!r}") from None


def parse_server_argv(argv: Sequence[str]) -> ServerArgs:
    """Read a server's command line; raises NotAVllmServer for any other command, or for a
    port no server can listen on."""
    found = _launch(argv)
    if found is None:
        # The secrets module reads flags through this one: imported here, not at the top.
        from kvpilot.collectors.secrets import mask_argv

        raise NotAVllmServer(
            "not a vLLM server command line: expected `vllm serve MODEL ...`, "
            f"`python -m {CLI_MODULE} serve MODEL ...` or "
            "`python -m vllm.entrypoints.openai.api_server --model MODEL ...`, "
            f"got {mask_argv(argv)!r}"
        )
    form, start = found
    model = flag_value(argv, MODEL_FLAG)
    if form == "vllm-serve" and start < len(argv) and not is_option(argv[start]):
        model = argv[start]  # `vllm serve MODEL`: the positional comes first
    port = _int_flag(argv, "--port")
    if port is not None and not 0 < port < 65536:
        raise NotAVllmServer(f"--port must be a TCP port from 1 to 65535, got {port}")
    return ServerArgs(
        form=form,
        model=model,
        host=flag_value(argv, "--host"),
        port=DEFAULT_PORT if port is None else port,
        api_key=flag_value(argv, "--api-key"),
        shutdown_timeout_s=_int_flag(argv, "--shutdown-timeout"),
        served_model_name=flag_value(argv, "--served-model-name"),
    )


_HUMAN_INT = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT])")
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_human_int(text: str) -> int | None:
    """vLLM's `human_readable_int`: `1k` = 1000, `1K` = 1024, plain digits; None otherwise."""
    text = text.strip()
    match = _HUMAN_INT.fullmatch(text)
    if match:
        number, suffix = match.groups()
        if suffix in _DECIMAL:
            return int(float(number) * _DECIMAL[suffix])
        return int(number) * _BINARY[suffix] if number.isdigit() else None
    return int(text) if text.isdigit() else None
