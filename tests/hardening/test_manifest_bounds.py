"""Items 3 and 4: nothing allocated on the manifest's word alone; checks in near-linear time."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import statestream as ss
from statestream.format import checksum, decode_manifest, encode_commit

from .conftest import read_doc, write_doc

_TERA = 10**12  # float32 values claimed: 3.6 TiB


def _claim_huge(c: Path, kind: str = "array") -> None:
    """Re-sealed manifest: one float32 array of 10^12 values in a 4 KB file that the
    manifest says is 4 * 10^12 bytes long."""
    data = c / "data" / "big.bin"
    data.write_bytes(b"\0" * 4096)
    doc = read_doc(c)
    doc["files"].append(["data/big.bin", 4 * _TERA])
    fi = len(doc["files"]) - 1
    if kind == "array":
        entry = {"dtype": "float32", "shape": [_TERA], "chunks": [[fi, 0, 4 * _TERA, 0, [0],
                                                                   [_TERA]]]}
        leaf: dict[str, Any] = {"t": "array", "a": len(doc["arrays"]), "x": {"kind": "numpy"}}
    else:  # a bytes blob of 4 TB
        entry = {"dtype": "uint8", "shape": [4 * _TERA],
                 "chunks": [[fi, 0, 4 * _TERA, 0, [0], [4 * _TERA]]]}
        leaf = {"t": "bytes", "a": len(doc["arrays"])}
    doc["arrays"].append(entry)
    doc["tree"]["k"].append("huge")
    doc["tree"]["c"].append(leaf)
    write_doc(c, doc)


_CHILD = textwrap.dedent("""
    import json, resource, sys
    limit = 3 << 30  # no numpy allocation of terabytes can succeed, whatever overcommit says
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    import statestream as ss
    out = {}
    def run(name, fn):
        try:
            r = fn()
            out[name] = ["ok", repr(r)[:3000]]
        except ss.CheckpointError as exc:
            out[name] = [type(exc).__name__, str(exc)]
        except BaseException as exc:
            out[name] = ["ESCAPED " + type(exc).__name__, str(exc)[:300]]
    p = sys.argv[1]
    run("load", lambda: ss.load(p))
    run("verify", lambda: ss.verify(p).problems)
    run("metadata", lambda: ss.metadata(p).total_bytes)
    run("load_items", lambda: ss.load(p, items=["step"]))
    print(json.dumps(out))
""")


def _in_capped_child(c: Path) -> dict[str, list[str]]:
    r = subprocess.run([sys.executable, "-c", _CHILD, str(c)], capture_output=True, text=True,
                       timeout=240, check=False)
    assert r.returncode == 0, r.stderr
    out: dict[str, list[str]] = json.loads(r.stdout.splitlines()[-1])
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["array", "bytes"])
def test_claimed_terabytes_are_not_allocated(ckpt: Path, kind: str) -> None:
    _claim_huge(ckpt, kind)
    out = _in_capped_child(ckpt)
    kind_, msg = out["load"]
    assert kind_ == "TruncatedFileError", out["load"]
    assert "data/big.bin" in msg and "'huge'" in msg
    kind_, msg = out["verify"]
    assert kind_ == "ok" and "data/big.bin" in msg and "huge" in msg, out["verify"]
    assert out["metadata"][0] == "ok"  # metadata reads no data, allocates nothing
    assert out["load_items"] == ["ok", "{'step': 7}"]


@pytest.mark.timeout(120)
def test_chunks_sharing_file_bytes_are_refused(ckpt: Path) -> None:
    """Two arrays backed by the same bytes would let a small file fill a large load."""
    doc = read_doc(ckpt)
    a = doc["arrays"][0]
    doc["arrays"].append(json.loads(json.dumps(a)))
    doc["tree"]["k"].append("alias")
    doc["tree"]["c"].append({"t": "array", "a": len(doc["arrays"]) - 1})
    write_doc(ckpt, doc)
    with pytest.raises(ss.CheckpointCorruptError, match="share bytes"):
        ss.load(ckpt)
    assert not ss.verify(ckpt).ok


def _grid_checkpoint(c: Path, rows: int, cols: int) -> np.ndarray:
    """A checkpoint of one uint8 (rows, cols) array stored as one chunk per element."""
    ss.save(c, {"x": np.zeros(1, np.uint8)})
    value = (np.arange(rows * cols) % 251).astype(np.uint8).reshape(rows, cols)
    raw = value.tobytes()
    (c / "data" / "grid.bin").write_bytes(raw)
    crcs = [checksum(raw[i:i + 1]) for i in range(len(raw))]
    chunks = [[1, r * cols + k, 1, crcs[r * cols + k], [r, k], [1, 1]]
              for r in range(rows) for k in range(cols)]
    doc = read_doc(c)
    doc["files"].append(["data/grid.bin", len(raw)])
    doc["arrays"].append({"dtype": "uint8", "shape": [rows, cols], "chunks": chunks})
    doc["tree"]["k"].append("grid")
    doc["tree"]["c"].append({"t": "array", "a": 1, "x": {"kind": "numpy"}})
    write_doc(c, doc)
    return value


# The quadratic check took 10 s for 10,000 chunks; 60,000 would take minutes. The timeout
# is the bound (no timing is asserted): the near-linear check takes seconds.
@pytest.mark.timeout(240)
@pytest.mark.parametrize("rows,cols", [(1, 60_000), (250, 240)])
def test_many_chunks_check_in_near_linear_time(tmp_path: Path, rows: int, cols: int) -> None:
    c = tmp_path / "grid"
    value = _grid_checkpoint(c, rows, cols)
    assert ss.metadata(c).tree["grid"].num_chunks == rows * cols
    np.testing.assert_array_equal(ss.load(c)["grid"], value)
    # one overlapping pair among them is still found
    doc = read_doc(c)
    ch = doc["arrays"][1]["chunks"]
    ch[-1][4] = list(ch[-2][4])
    data = json.dumps(doc, separators=(",", ":")).encode()
    with pytest.raises(ss.CheckpointCorruptError, match="overlapping"):
        decode_manifest(data, "m")
    (c / "manifest.json").write_bytes(data)
    (c / "COMMITTED").write_bytes(encode_commit(data))
    assert not ss.verify(c).ok


@pytest.mark.parametrize("bad", [[], {}, 1, None, ["array"], True])
def test_unhashable_or_odd_node_types_are_corrupt(ckpt: Path, bad: Any) -> None:
    """Found by the fuzzer: a node type that is a list escaped as a TypeError."""
    doc = read_doc(ckpt)
    doc["tree"]["c"][0]["t"] = bad
    write_doc(ckpt, doc)
    with pytest.raises(ss.CheckpointCorruptError, match="unknown tree node type"):
        ss.metadata(ckpt)
