"""Golden files pin on-disk format v1 (tests/golden/v1/basic, made by make_golden_v1.py).

The expected state is rebuilt here on its own (not imported from the
generator), so a change to either side is caught.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import shutil

import ml_dtypes
import numpy as np
import pytest

import statestream as ss
from statestream.format import checksum, encode_commit
from statestream.testing import assert_tree_equal

GOLDEN = pathlib.Path(__file__).resolve().parents[1] / "golden" / "v1" / "basic"


def _expected():
    return {
        "params": {
            "w": np.arange(12, dtype=np.float32).reshape(3, 4) * np.float32(0.25)
            - np.float32(1.0),
            "b": np.array([-(2**62), -1, 0, 1, 2**62], dtype=np.int64),
            "bf": np.array([1.0, -2.5, math.inf, -math.inf, math.nan, 0.0, -0.0, 1 / 3],
                           dtype=ml_dtypes.bfloat16),
        },
        "zero_d": np.array(7.5, dtype=np.float64),
        "empty": np.zeros((0, 3), dtype=np.float32),
        "scalar": np.float32(1.5),
        "plain": {
            "none": None, "t": True, "f": False, "i": 42, "neg": -7, "big": 2**100,
            "x": 0.1, "nan": math.nan, "ninf": -math.inf, "nz": -0.0,
            "s": "h\u00e9llo \U0001f600", "bytes": b"\x00\x01\xff", "empty_bytes": b"",
        },
        "nested": {
            "list": [1, [2, (3, "x")], {"k": np.arange(3, dtype=np.uint8)}],
            "tuple": (np.ones(2, dtype=np.int16),),
            "empty": {"d": {}, "l": [], "t": ()},
        },
        "a/b": {"c.d": 1, "~": np.array([True, False])},
        "intkeys": {0: "zero", 1: "one"},
    }


@pytest.fixture
def golden(tmp_path):
    """A private copy, so no test can alter the checked-in files."""
    assert (GOLDEN / "COMMITTED").is_file(), "golden files missing; see make_golden_v1.py"
    dst = tmp_path / "basic"
    shutil.copytree(GOLDEN, dst)
    return dst


def test_golden_loads_expected_values(golden):
    out = ss.load(golden)
    assert_tree_equal(out, _expected())
    assert math.copysign(1.0, out["plain"]["nz"]) == -1.0
    assert out["params"]["bf"].dtype == np.dtype(ml_dtypes.bfloat16)
    assert type(out["scalar"]) is np.float32


def test_golden_verifies(golden):
    rep = ss.verify(golden)
    assert rep.ok, rep.problems
    assert rep.checked_chunks == 9


def test_golden_metadata(golden):
    md = ss.metadata(golden)
    assert md.format_version == 1
    assert md.num_arrays == 11 and md.total_bytes == 128
    w = md.tree["params"]["w"]
    assert (w.shape, w.dtype, w.nbytes, w.kind, w.num_chunks) == ((3, 4), "float32", 48,
                                                                  "numpy", 1)
    assert md.tree["a/b"]["~"].dtype == "bool"
    assert md.files == [("data/r0-0.bin", 514)]


def test_golden_header_and_marker(golden):
    raw = (golden / "manifest.json").read_bytes()
    doc = json.loads(raw)
    assert (doc["format"], doc["version"], doc["checksum"]) == ("statestream", 1, "crc32c")
    marker = json.loads((golden / "COMMITTED").read_bytes())
    assert marker == {"format": "statestream", "version": 1, "manifest_bytes": len(raw),
                      "manifest_crc32c": checksum(raw)}
    assert (golden / "COMMITTED").read_bytes() == encode_commit(raw)
    assert sorted(os.listdir(golden)) == ["COMMITTED", "data", "manifest.json"]


def test_saving_today_produces_identical_layout(golden, tmp_path):
    today = tmp_path / "today"
    ss.save(today, _expected())
    old = json.loads((golden / "manifest.json").read_bytes())
    new = json.loads((today / "manifest.json").read_bytes())
    for key in ("arrays", "tree", "files"):
        assert json.dumps(new[key], sort_keys=False) == json.dumps(old[key], sort_keys=False), key
    assert set(new) == set(old)
    assert set(new["meta"]) >= {"library", "created_unix"}
    assert sorted(os.listdir(today / "data")) == sorted(os.listdir(golden / "data"))
    for name in os.listdir(golden / "data"):
        assert (today / "data" / name).read_bytes() == (golden / "data" / name).read_bytes()
