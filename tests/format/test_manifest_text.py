"""encode_manifest writes the arrays' JSON directly: exactly the bytes json.dumps gives.

The reference below is the plain encoder (every field a JSON value, one
json.dumps); the fast one must match it byte for byte on every form a chunk
can take, and on every golden checkpoint, so that a v1 save stays exactly what
a v1 writer wrote.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import numpy as np
import pytest

from statestream.format import (
    ArrayEntry,
    ChunkEntry,
    ChunkRef,
    FileEntry,
    Manifest,
    decode_manifest,
    encode_manifest,
)
from statestream.format._manifest import _bases_of, _encode_chunk, _encode_node, manifest_version
from statestream.tree import Node

GOLDEN = pathlib.Path(__file__).resolve().parents[1] / "golden"


def reference_encode(m: Manifest) -> bytes:
    version = manifest_version(m)
    bases = _bases_of(m) if version == 2 else []
    index = {b: i for i, b in enumerate(bases)}
    doc: dict[str, Any] = {
        "format": "statestream", "version": version, "checksum": "crc32c", "meta": m.meta,
        "files": [[f.name, f.size] for f in m.files],
    }
    if bases:
        doc["bases"] = bases
    doc["arrays"] = [{"dtype": a.dtype, "shape": list(a.shape),
                      "chunks": [_encode_chunk(c, index) for c in a.chunks]} for a in m.arrays]
    doc["tree"] = _encode_node(m.tree)
    return json.dumps(doc, ensure_ascii=True, separators=(",", ":"), allow_nan=False).encode()


@pytest.mark.parametrize("path", [p for p in sorted(GOLDEN.glob("v*/*/manifest.json"))
                                  if p.parent.parent.name in ("v1", "v2")],  # (v3: a table,
                         # re-encoded in tests/format/test_golden_v3.py)
                         ids=lambda p: f"{p.parent.parent.name}/{p.parent.name}")
def test_golden_manifests_encode_to_their_own_bytes(path: pathlib.Path) -> None:
    raw = path.read_bytes()
    m = decode_manifest(raw, str(path))
    assert encode_manifest(m) == reference_encode(m) == raw


def _manifest(seed: int) -> Manifest:
    rng = np.random.default_rng(seed)
    digest = bytes(range(16))
    arrays, leaves = [], []
    for i in range(40):
        ndim = int(rng.integers(0, 4))
        shape = tuple(int(x) for x in rng.integers(1, 9, size=ndim))
        kind = int(rng.integers(0, 5))
        start = (0,) * ndim
        big = int(rng.integers(0, 2**63))  # offsets and checksums of any size
        if kind == 0:
            c = ChunkEntry(0, big, 8, 2**32 - 1, start, shape)
        elif kind == 1 and ndim:
            c = ChunkEntry(1, 4096 * i, 64, 7, start, shape, block_rows=1,
                           block_checksums=tuple(range(shape[0])))
        elif kind == 2:
            c = ChunkEntry(0, 4096 * i, 5, 9, start, shape, codec="zstd", shuffle=bool(i % 2))
        elif kind == 3:
            c = ChunkEntry(1, 64 * i, 8, 1, start, shape, digest=digest,
                           ref=ChunkRef("step-1", 1))
        else:
            c = ChunkEntry(0, 8 * i, 8, 3, start, shape, digest=digest)
        arrays.append(ArrayEntry("bfloat16" if i % 3 else "float32", shape, (c,)))
        leaves.append(Node("array", array=i))
    tree = Node("dict", keys=[f"k\u00e9y{i}" for i in range(40)], children=leaves)
    return Manifest(tree, arrays, [FileEntry("r0-0.bin", 10), FileEntry("r0-1.bin", 20)],
                    meta={"user": {"note": "caf\u00e9 \u2603", "n": 1.5}})


@pytest.mark.parametrize("seed", range(8))
def test_every_chunk_form_encodes_as_json_dumps_would(seed: int) -> None:
    m = _manifest(seed)
    got = encode_manifest(m)
    assert got == reference_encode(m)


def test_v1_manifest_has_no_v2_fields() -> None:
    m = _manifest(0)
    m.arrays = [a for a in m.arrays if all(c.codec is None and c.digest is None
                                           for c in a.chunks)]
    m.tree = Node("list", children=[Node("array", array=i) for i in range(len(m.arrays))])
    got = encode_manifest(m)
    assert got == reference_encode(m)
    assert json.loads(got)["version"] == 1
