"""The format-v3 golden checkpoint (tests/golden/v3/table, made by make_golden_v3.py):
an array table, compact array leaves, multi-chunk and compressed arrays.

The expected state is rebuilt here on its own (the v1 golden's state comes from
tests/api/test_api_golden.py's own copy), so a change to either side is caught.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import shutil
from typing import Any

import numpy as np
import pytest

import statestream as ss
from statestream.format import decode_manifest, encode_manifest
from statestream.testing import assert_tree_equal

GOLDEN = pathlib.Path(__file__).resolve().parents[1] / "golden" / "v3" / "table"


def v1_expected() -> Any:
    """The v1 golden's state, as tests/api/test_api_golden.py rebuilds it."""
    spec = importlib.util.spec_from_file_location(
        "_golden_v1_expected", GOLDEN.parents[2] / "api" / "test_api_golden.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod._expected()


def _expected() -> dict[str, object]:
    tied = np.arange(6, dtype=np.float64).reshape(2, 3)
    return {
        "many": {f"layer{i:04d}": np.arange(i % 7 + 1, dtype=np.float32) + np.float32(i)
                 for i in range(1100)},
        "ints": {f"i{i}": np.full((2, i % 3), i, dtype=np.int64) for i in range(8)},
        "v1": v1_expected(),
        "rows": np.arange(512, dtype=np.float32).reshape(64, 8),
        "zeros": np.zeros(4096, dtype=np.float32),
        "tied": {"a": tied, "b": tied},
    }


@pytest.fixture
def golden(tmp_path: pathlib.Path) -> pathlib.Path:
    """A private copy, so no test can alter the checked-in files."""
    assert (GOLDEN / "COMMITTED").is_file(), "golden files missing; see make_golden_v3.py"
    dst = tmp_path / "table"
    shutil.copytree(GOLDEN, dst)
    return dst


def test_golden_v3_is_a_table_with_compact_leaves(golden: pathlib.Path) -> None:
    doc = json.loads((golden / "manifest.json").read_text())
    assert doc["version"] == 3 and json.loads((golden / "COMMITTED").read_text())["version"] == 3
    table = doc["arrays"]
    assert set(table) == {"dtypes", "dtype", "ndim", "shape", "nchunks", "chunks", "boxes", "ext"}
    assert max(table["nchunks"]) > 1 and all(e[1]["codec"] == "zstd" for e in table["ext"])
    many = doc["tree"]["c"][doc["tree"]["k"].index("many")]
    assert many["ak"] == "numpy" and all(type(c) is int for c in many["c"])


def test_golden_v3_loads_exactly(golden: pathlib.Path) -> None:
    out = ss.load(golden)
    assert_tree_equal(out, _expected())
    # written before NumPy arrays were tied on save: two copies, loaded as two arrays
    # (files made again by make_golden_v3.py would hold an alias leaf instead)
    assert out["tied"]["a"] is not out["tied"]["b"]
    assert ss.verify(golden).ok


def test_golden_v3_decodes_and_reencodes_byte_for_byte(golden: pathlib.Path) -> None:
    data = (golden / "manifest.json").read_bytes()
    m = decode_manifest(data, "golden")
    assert m.version == 3 and len(m.arrays) > 1100
    assert encode_manifest(m) == data
