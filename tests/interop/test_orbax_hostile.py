"""Hostile or damaged Orbax checkpoints: caught, naming the file and key path, before
anything large is allocated or anything outside the checkpoint is read."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest

import statestream as ss


def _save(path: Path, state: dict, **handler: object) -> None:
    ocp = pytest.importorskip("orbax.checkpoint")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ocp.Checkpointer(ocp.PyTreeCheckpointHandler(**handler)).save(path, state)


def _edit_json(path: Path, **changes: object) -> None:
    doc = json.loads(path.read_text())
    doc.update(changes)
    path.write_text(json.dumps(doc))


def test_a_number_stored_as_a_large_array_is_refused_before_orbax_reads_it(
        tmp_path: Path) -> None:
    """Orbax's metadata of a number says shape () whatever is stored, and its restore
    read the whole stored array (missing chunks filled) before checking it is 0-d: a
    .zarray giving ``step`` 2**20 elements (2**40 as easily) with no chunk stored made
    the load allocate and fill them."""
    _save(tmp_path / "o", {"w": np.arange(4.0), "step": 3}, use_ocdbt=False)
    n = 1 << 20
    _edit_json(tmp_path / "o" / "step" / ".zarray", shape=[n], chunks=[n])
    (tmp_path / "o" / "step" / "0").unlink()
    _edit_json(tmp_path / "o" / "_METADATA", store_array_data_equal_to_fill_value=False)
    for call in (lambda: ss.load(tmp_path / "o"), lambda: ss.metadata(tmp_path / "o")):
        with pytest.raises(ss.CheckpointCorruptError,
                           match=r"'step' is a number in _METADATA, but its stored array is "
                                 r"int64 of shape \(1048576,\)"):
            call()
