"""``inspect --json`` and ``diff --json`` of foreign formats, as of statestream's own:
"path" is absolute whatever PATH was given (it was PATH as given for every foreign
format, contrary to docs/cli.md)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

import statestream as ss
from statestream.cli import main

pytest.importorskip("torch")

OUTPUTS = [("safetensors", "m.safetensors"), ("torch", "m.pt"), ("dcp", "d"),
           ("safetensors", "sh")]


@pytest.fixture
def made(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    ss.save(tmp_path / "ck", {"w": np.ones(2, np.float32), "s": b"xy"})
    for to, name in OUTPUTS:
        ss.convert(tmp_path / "ck", tmp_path / name, to=to)
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("given", ["m.safetensors", "m.pt", "d", "sh", "sh/", "./d/"])
def test_inspect_and_diff_json_paths_are_absolute(made: Path, given: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    want = os.path.abspath(given)
    assert ss.metadata(given).path == want
    assert main(["inspect", "--json", given]) == 0
    assert json.loads(capsys.readouterr().out)["path"] == want
    main(["diff", "--json", given, "ck"])
    doc = json.loads(capsys.readouterr().out)
    assert (doc["a"]["path"], doc["b"]["path"]) == (want, str(made / "ck"))
    assert main(["verify", "--json", given]) == 0  # verify's stays PATH as given
    assert json.loads(capsys.readouterr().out)["path"] == given
