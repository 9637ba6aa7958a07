"""Tests for ``statestream ls``: which entries it lists, in which state, and its output
on odd metadata (more in test_commands.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import statestream as ss
from statestream.cli import main


def out_json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, Any]:
    rc = main(argv)
    return rc, json.loads(capsys.readouterr().out)


def test_a_committed_staging_directory_is_a_leftover_only(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A save killed after writing its commit marker, before the rename, leaves a committed
    staging directory: ls listed it twice, as a leftover and as a committed checkpoint
    named ``.ck.tmp-...`` (which ``gc`` removes)."""
    ss.save(tmp_path / "ck", {"w": np.ones(4)})
    ss.save(tmp_path / "next", {"w": np.zeros(4)})
    (tmp_path / "next").rename(tmp_path / ".next.tmp-0123456789ab")  # as a kill leaves it
    rc, out = out_json(capsys, ["ls", str(tmp_path), "--json"])
    assert rc == 0 and out["kind"] == "directory"
    assert [(e["name"], e["state"]) for e in out["entries"]] == [
        ("ck", "committed"), ("next", "leftover")]
    assert main(["ls", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert ".tmp-" not in text and "1 committed checkpoint, 1 other" in text
