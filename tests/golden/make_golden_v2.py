"""Write the format-v2 golden checkpoints into tests/golden/v2/.

Run from the repository root only when the golden files are meant to change
(they pin format v2; a change of format needs a new version, not new files):

    .venv/bin/python tests/golden/make_golden_v2.py

Three checkpoints, siblings of each other:

- ``compressed``: zstd chunks with and without byte shuffling, an
  incompressible chunk stored raw with a hash, a raw chunk with both block
  checksums and a hash (the eight-field form ``[..., blocks, ext]``), plain
  v1-form chunks beside them.
- ``base`` and ``incremental``: ``incremental`` lists ``bases: ["base"]`` and
  refers to two of base's chunks (one of them compressed); its third array is
  its own.

The statestream writer is used only for the tree (``ss.save`` of the same
state, then each chunk is re-encoded here with numpy and ``zstandard``
directly, so the codec's byte layout is written independently of the
library's own codec code). tests/format/test_golden_v2.py rebuilds the
states on its own and compares.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from typing import Any

#: chunk treatment per top-level key: ("zstd", shuffle), "hash", "blocks", "ref", or None
COMPRESSED_PLAN: dict[str, Any] = {
    "w": ("zstd", True), "i": ("zstd", False), "bf": ("zstd", True), "noise": "hash",
    "rows": "blocks", "zero_d": None, "empty": None,
}
BASE_PLAN: dict[str, Any] = {"a": "hash", "c": ("zstd", True, "hash"), "b": "hash"}
INCR_PLAN: dict[str, Any] = {"a": "ref", "c": "ref", "b": "hash"}


def compressed_state() -> dict[str, Any]:
    """The state stored in tests/golden/v2/compressed."""
    import ml_dtypes
    import numpy as np

    x = np.arange(2048, dtype=np.float32)
    return {
        "w": (np.round(x / 64.0) * 0.125).reshape(64, 32).astype(np.float32),
        "i": np.arange(1000, dtype=np.int64) * 3 - 7,
        "bf": (np.arange(256) % 17 - 8).astype(ml_dtypes.bfloat16),
        "noise": np.random.default_rng(2026).integers(0, 256, 300, dtype=np.uint8),
        "rows": np.arange(32, dtype=np.float32).reshape(8, 4) / 4,
        "zero_d": np.array(2.5, dtype=np.float64),
        "empty": np.zeros((0, 3), dtype=np.float32),
        "plain": {"s": "v2", "n": 3},
    }


def base_state() -> dict[str, Any]:
    import numpy as np

    return {"a": np.arange(16, dtype=np.float32), "c": np.zeros((64, 8), dtype=np.float32) + 1.5,
            "b": np.arange(8, dtype=np.int32)}


def incremental_state() -> dict[str, Any]:
    import numpy as np

    s = base_state()
    s["b"] = np.arange(8, dtype=np.int32) * -2
    return s


def _xxh(raw: bytes) -> str:
    import xxhash

    return str(xxhash.xxh3_128(raw).hexdigest())


def _crc(data: bytes) -> int:
    from statestream.format import checksum

    return int(checksum(data))


def _encode(raw: bytes, itemsize: int, shuffle: bool) -> bytes:
    import numpy as np
    import zstandard

    if shuffle:
        raw = np.frombuffer(raw, np.uint8).reshape(-1, itemsize).T.tobytes()
    return bytes(zstandard.ZstdCompressor(level=3).compress(raw))


def _rewrite(out: str, state: dict[str, Any], plan: dict[str, Any],
             base: tuple[str, dict[str, Any]] | None) -> None:
    """Save ``state`` with statestream (v1), then re-encode its chunks per ``plan``."""

    import statestream as ss
    from statestream.format import checksum, encode_commit, itemsize_of

    if os.path.exists(out):
        shutil.rmtree(out)
    ss.save(out, state)
    doc = json.loads(open(os.path.join(out, "manifest.json"), "rb").read())
    old = open(os.path.join(out, "data", "r0-0.bin"), "rb").read()
    keys = doc["tree"]["k"]
    data = bytearray()
    for key, node in zip(keys, doc["tree"]["c"]):
        if "a" not in node:
            continue
        arr = doc["arrays"][node["a"]]
        how = plan[key]
        for c in arr["chunks"]:
            raw = old[c[1]:c[1] + c[2]]
            isz = itemsize_of(arr["dtype"])
            ext: dict[str, Any] = {}
            blocks = None
            if how == "ref":
                assert base is not None
                c[:4] = base[1][key][:4]
                c.extend([None, {**base[1][key][7]}, ])
                assert c[7]["hash"] == _xxh(raw)
                c[7]["ref"] = 0
                continue
            if isinstance(how, tuple):
                stored = _encode(raw, isz, how[1])
                assert len(stored) < len(raw)
                ext = {"codec": "zstd", **({"shuffle": True} if how[1] else {})}
                if "hash" in how:
                    ext["hash"] = _xxh(raw)
            else:
                stored = raw
                if how in ("hash", "blocks"):
                    ext = {"hash": _xxh(raw)}
                if how == "blocks":
                    step = len(raw) // c[5][0] * 2
                    blocks = [2, [checksum(raw[k:k + step]) for k in range(0, len(raw), step)]]
            data.extend(b"\0" * (-len(data) % 64))
            c[1], c[2], c[3] = len(data), len(stored), checksum(stored)
            data.extend(stored)
            if ext:
                c.extend([blocks, ext])
    doc["files"] = [["data/r0-0.bin", len(data)]]
    doc["meta"] = {"library": "statestream golden v2", "created_unix": 0.0, "world_size": 1,
                   "total_bytes": doc["meta"]["total_bytes"]}
    doc["version"] = 2
    if base is not None:
        doc = {**{k: doc[k] for k in ("format", "version", "checksum", "meta", "files")},
               "bases": [base[0]], "arrays": doc["arrays"], "tree": doc["tree"]}
    mbytes = json.dumps(doc, ensure_ascii=True, separators=(",", ":"),
                        allow_nan=False).encode()
    open(os.path.join(out, "data", "r0-0.bin"), "wb").write(bytes(data))
    open(os.path.join(out, "manifest.json"), "wb").write(mbytes)
    open(os.path.join(out, "COMMITTED"), "wb").write(encode_commit(mbytes, version=2))


def _chunks_by_key(path: str) -> dict[str, Any]:
    doc = json.loads(open(os.path.join(path, "manifest.json"), "rb").read())
    return {k: doc["arrays"][n["a"]]["chunks"][0]
            for k, n in zip(doc["tree"]["k"], doc["tree"]["c"]) if "a" in n}


def main() -> int:
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "v2")
    os.makedirs(here, exist_ok=True)
    _rewrite(os.path.join(here, "compressed"), compressed_state(), COMPRESSED_PLAN, None)
    _rewrite(os.path.join(here, "base"), base_state(), BASE_PLAN, None)
    base = ("base", _chunks_by_key(os.path.join(here, "base")))
    _rewrite(os.path.join(here, "incremental"), incremental_state(), INCR_PLAN, base)
    print(f"wrote {here}/compressed, base, incremental")
    return 0


if __name__ == "__main__":
    sys.exit(main())
