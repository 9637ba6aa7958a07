"""An unsafe name in a manifest (a data file outside data/, a base that is no sibling)
is refused naming that manifest: an incremental save's base's hostile manifest was
reported as 'manifest names data file ...', naming neither the base nor the file."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import statestream as ss
from statestream.format import COMMIT_NAME, MANIFEST_NAME, encode_commit


def _edit(path: Path, edit) -> None:  # type: ignore[no-untyped-def]
    doc = json.loads((path / MANIFEST_NAME).read_bytes())
    edit(doc)
    raw = json.dumps(doc, separators=(",", ":")).encode()
    (path / MANIFEST_NAME).write_bytes(raw)
    (path / COMMIT_NAME).write_bytes(encode_commit(raw))


def _file(doc: dict) -> None:  # type: ignore[type-arg]
    doc["files"][0][0] = "data/../../../etc/passwd"


def _base(doc: dict) -> None:  # type: ignore[type-arg]
    doc["bases"] = ["/etc"]


@pytest.mark.parametrize("edit, said, which",
                         [(_file, "names data file 'data/../../../etc/passwd'", "s0"),
                          (_base, "names base checkpoint '/etc'", "s1")])
def test_an_unsafe_name_names_its_manifest(tmp_path: Path, edit, said, which) -> None:  # type: ignore[no-untyped-def]
    w = np.arange(1000.0)
    ss.save(tmp_path / "s0", {"w": w, "v": np.ones(4)}, hashes=True)
    ss.save(tmp_path / "s1", {"w": w, "v": np.zeros(4)}, base=tmp_path / "s0")
    assert ss.metadata(tmp_path / "s1").referenced_bytes
    _edit(tmp_path / which, edit)  # the base's data file, or the save's own base name
    where = str(tmp_path / which / MANIFEST_NAME)
    with pytest.raises(ss.UnsafeCheckpointError) as ei:
        ss.load(tmp_path / "s1")
    assert f"manifest {where} {said}" in str(ei.value)
    problems = ss.verify(tmp_path / "s1").problems
    assert any(where in p and said in p for p in problems), problems
