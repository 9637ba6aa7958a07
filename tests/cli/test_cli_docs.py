"""The command line and its documentation agree.

Every subcommand and option of ``statestream`` is in docs/cli.md's table (a new option
without docs fails here), every option the docs name exists, every command line shown
in a code block (README.md, docs/*.md) or in a ``--help`` epilog parses, and README's
command-line tour runs against a small checkpoint.
"""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import numpy as np
import pytest

import statestream as ss
from statestream.cli import main
from statestream.cli._main import build_parser

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CLI_DOC = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
HELP = {"-h", "--help"}


def _commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("statestream has no subcommands")


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings} - HELP


def _synopses() -> dict[str, str]:
    """docs/cli.md's table: command -> its synopsis (``PATH [--json] [--all]``)."""
    rows = re.findall(r"^\| `statestream (\w+)([^`]*)` \|", CLI_DOC, re.M)
    assert rows, "docs/cli.md has no command table"
    return dict(rows)


def _shown_lines() -> list[tuple[str, str]]:
    """(where, command line) for every ``statestream ...`` line of a fenced block."""
    out = []
    for page in PAGES:
        for block in re.findall(r"^```\w*\n(.*?)^```", page.read_text(encoding="utf-8"),
                                re.S | re.M):
            for line in block.splitlines():
                line = line.strip().removeprefix("$ ")
                if line.startswith("statestream "):
                    out.append((page.name, line))
    return out


def _spans() -> list[tuple[str, str]]:
    """(where, text) for every inline ``statestream ...`` code span (but the format names
    ``statestream v1`` and so on)."""
    return [(page.name, span) for page in PAGES
            for span in re.findall(r"`(statestream [a-z-][^`]*)`", page.read_text(encoding="utf-8"))
            if not re.fullmatch(r"statestream v\d", span)]


def _argv(line: str) -> list[str]:
    """The arguments of a shell line: its comment and any pipe cut off."""
    words = shlex.split(line, comments=True)
    if "|" in words:
        words = words[:words.index("|")]
    assert words[0] == "statestream", line
    return words[1:]


def test_every_command_and_option_is_documented() -> None:
    synopses = _synopses()
    commands = _commands()
    assert set(synopses) == set(commands), "docs/cli.md's table and the commands differ"
    for name, parser in commands.items():
        for opt in _options(parser):
            assert re.search(rf"(?<![\w-]){re.escape(opt)}(?![\w-])", synopses[name]), (
                f"statestream {name} {opt} is not in docs/cli.md's table")
    for opt in _options(build_parser()):
        assert f"`statestream {opt}`" in CLI_DOC, f"statestream {opt} is not in docs/cli.md"


def test_every_documented_option_exists() -> None:
    commands = _commands()
    mentioned = [("cli.md table", f"statestream {c}{s}") for c, s in _synopses().items()]
    for where, text in mentioned + _spans() + _shown_lines():
        words = text.split()
        name = words[1]
        if name.startswith("-"):
            assert name in _options(build_parser()), (where, text)
            continue
        assert name in commands, f"{where}: no command {name!r} ({text})"
        for word in words[2:]:
            opt = word.strip("[]").split("=")[0]
            if opt.startswith("--"):
                assert opt in _options(commands[name]), f"{where}: {text}: no option {opt}"


@pytest.mark.parametrize("where,line", _shown_lines() + [
    (f"statestream {name} --help", line.strip())
    for name, p in _commands().items() for line in (p.epilog or "").splitlines()
    if line.strip().startswith("statestream ")])
def test_shown_command_lines_parse(where: str, line: str) -> None:
    try:
        build_parser().parse_args(_argv(line))
    except SystemExit as exc:  # argparse's way of refusing
        raise AssertionError(f"{where}: {line!r} does not parse") from exc


def test_readme_tour_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    state = {"model": {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}, "step": 100}
    ss.save("ckpt/step-100", state)
    ss.save("a", state)
    ss.save("b", {**state, "model": {"w": state["model"]["w"] + 1e-7}})
    lines = [line for where, line in _shown_lines() if where == "README.md"]
    assert len(lines) >= 6
    for line in lines:
        rc = main(_argv(line))
        assert rc == 0, f"{line!r} exited {rc}: {capsys.readouterr()}"
    assert set(ss.load("model.safetensors")) == {"w"}


def test_memory_budget_help_gives_the_default_the_code_uses() -> None:
    """diff's --help said its --memory-budget defaults to 25% of RAM (the library's
    default, which verify and convert use); without the option diff reads batches of
    BATCH_BYTES (64 MiB) per side, as docs/cli.md says."""
    from statestream.cli._diff import BATCH_BYTES

    commands = _commands()
    per_side = f"{BATCH_BYTES >> 20} MiB per side"
    diff_help = " ".join(commands["diff"].format_help().split())
    assert f"(default: {per_side})" in diff_help and "25% of RAM" not in diff_help
    assert f"batches of {per_side}" in " ".join(CLI_DOC.split())
    for name in ("verify", "convert"):
        assert "(default: 25% of RAM, at most 4 GiB)" in " ".join(
            commands[name].format_help().split())
