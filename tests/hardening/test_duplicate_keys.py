"""A dict whose keys repeat is malformed: a load kept one child and silently dropped the
other's array, and verify said the checkpoint was fine."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import statestream as ss

from .conftest import read_doc, write_doc


def test_a_repeated_key_is_refused_by_every_reader(tmp_path: Path) -> None:
    c = tmp_path / "c"
    ss.save(c, {"params": {"w": np.arange(8.0), "b": np.ones((2, 3), np.float32)}, "step": 3})
    doc = read_doc(c)
    params = doc["tree"]["c"][doc["tree"]["k"].index("params")]
    params["k"] = ["w", "w"]
    write_doc(c, doc)
    match = "malformed: key 'w' appears twice in one dict"
    for read in (ss.load, ss.metadata, lambda p: ss.load(p, items=["params/w"]),
                 lambda p: ss.load(p, target={"params": {"w": np.zeros(8), "b": None},
                                              "step": 0})):
        with pytest.raises(ss.CheckpointCorruptError, match=match):
            read(c)
    problems = ss.verify(c).problems
    assert len(problems) == 1 and match in problems[0]
