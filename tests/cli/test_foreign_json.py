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


def test_files_are_the_files_on_disk(made: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """DCP and torch.save listed a made-up '<bytes values>' entry (the bytes values held in
    memory), Orbax one '<array N block M>' per storage block: names of no file."""
    for given in ("m.safetensors", "m.pt", "d", "sh"):
        assert main(["inspect", "--json", given]) == 0
        files = json.loads(capsys.readouterr().out)["files"]
        base = given if os.path.isdir(given) else os.path.dirname(os.path.abspath(given))
        assert files and all(os.path.getsize(os.path.join(base, n)) == s for n, s in files)
    assert [n for n, _ in ss.metadata("d").files] == ["__0_0.distcp"]
    assert [n for n, _ in ss.metadata("m.pt").files] == ["m.pt"]
    pytest.importorskip("orbax.checkpoint")
    ss.save(made / "ck2", {"w": np.ones(2, np.float32)})
    ss.convert(made / "ck2", made / "o", to="orbax")
    files = dict(ss.metadata("o").files)
    assert "_METADATA" in files and any(n.startswith("ocdbt.process_0/d/") for n in files)
    for name, size in files.items():
        assert os.path.getsize(made / "o" / name) == size
