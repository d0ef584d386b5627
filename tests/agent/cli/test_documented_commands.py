"""Every `kvpilot ...` command the runbooks and the docs tell someone to run exists: its
`--help` answers. A runbook that names a command the CLI lacks fails here, not at 3 a.m."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from kvpilot.agent.cli.main import app

ROOT = Path(__file__).resolve().parents[3]
DOCS = sorted([*ROOT.glob("docs/runbooks/*.md"), *ROOT.glob("docs/*.md")])
# `kvpilot word ...` inside a code span, or at the start of a line in a fenced block.
IN_SPAN = re.compile(r"`(?:\$ )?kvpilot ((?:[a-z][a-z-]*)(?: [a-z][a-z-]*)*)")
IN_BLOCK = re.compile(r"^\s*(?:\$ )?kvpilot ((?:[a-z][a-z-]*)(?: [a-z][a-z-]*)*)", re.M)
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def documented_commands() -> dict[str, set[str]]:
    """Each command's words as the docs write them, with the files that name it."""
    found: dict[str, set[str]] = {}
    for path in DOCS:
        text = path.read_text()
        blocks = "\n".join(m.group(0) for m in FENCE.finditer(text))
        for words in [*IN_SPAN.findall(text), *IN_BLOCK.findall(blocks)]:
            found.setdefault(words, set()).add(str(path.relative_to(ROOT)))
    return found


def command_path(words: str) -> list[str]:
    """The leading words that name commands (a group's subcommand after it); what follows
    is an argument. Empty when even the first word is no command."""
    command: object = typer.main.get_command(app)
    path: list[str] = []
    for word in words.split():
        # A group's `commands` by name (typer ships its own click: duck-typed, not isinstance).
        commands = getattr(command, "commands", None)
        if not isinstance(commands, dict) or word not in commands:
            break
        path.append(word)
        command = commands[word]
    return path


DOCUMENTED = documented_commands()


def test_the_docs_name_the_operator_commands() -> None:
    # The scan itself is honest: it finds the commands the runbooks are known to name.
    assert "status" in DOCUMENTED and any(w.startswith("state check") for w in DOCUMENTED)


@pytest.mark.parametrize("words", sorted(DOCUMENTED))
def test_each_documented_command_answers_help(words: str) -> None:
    path = command_path(words)
    assert path, f"`kvpilot {words}` ({', '.join(sorted(DOCUMENTED[words]))}): no such command"
    result = CliRunner().invoke(app, [*path, "--help"])
    assert result.exit_code == 0, f"kvpilot {' '.join(path)} --help: {result.output[-500:]}"
