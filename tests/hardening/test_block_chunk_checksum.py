"""The checksum of a chunk with block checksums is checked when the whole chunk is read.

statestream records there the CRC-32C of the block CRCs (little-endian uint32s), so each
byte is hashed once; docs/format.md said it was the CRC-32C of the chunk's bytes "checked
when the whole chunk is read" (as the golden v2 checkpoint, written to that text,
records it). Until 2026-12-08 nothing checked it: a manifest whose chunk checksum
matched nothing, resealed, loaded, verified and converted. Now a read of the whole
chunk checks it over the bytes unless it is the CRC-32C of the block CRCs (both forms
load); a read of some of its rows (a resharding load) checks their blocks only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import statestream as ss
from statestream.format import checksum, checksum_of_blocks, decode_manifest

from .conftest import read_doc, write_doc

pytestmark = pytest.mark.timeout(300)

BIG = np.arange(300_000, dtype=np.float32).reshape(3000, 100)  # 1.2 MB: block checksums
GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "v2" / "compressed"


def _save(c: Path, table: bool) -> None:
    # ARRAY_TABLE_MIN arrays make a format v3 table; one array keeps the v1 list
    extra = {f"a{i}": np.array([i], np.int16) for i in range(1030)} if table else {}
    ss.save(c, {"params": {"big": BIG}, **extra})


def _set_crc(c: Path, table: bool, crc: Any) -> int:
    """Set the big array's chunk checksum (``crc(old, data)``); returns the old one."""
    doc = read_doc(c)
    if table:
        t = doc["arrays"]
        f, off, nb, old = t["chunks"][:4]
        assert t["blocks"][0][0] == 0
    else:
        ch = doc["arrays"][0]["chunks"][0]
        f, off, nb, old = ch[:4]
        assert ch[6] is not None
    data = (c / doc["files"][f][0]).read_bytes()[off:off + nb]
    new = crc(old, data)
    if table:
        t["chunks"][3] = new
    else:
        ch[3] = new
    write_doc(c, doc)
    return int(old)


@pytest.mark.parametrize("table", [False, True], ids=["v1-list", "v3-table"])
def test_a_chunk_checksum_matching_nothing_is_refused(tmp_path: Path, table: bool) -> None:
    c = tmp_path / "c"
    _save(c, table)
    _set_crc(c, table, lambda old, data: (old + 12345) & 0xFFFFFFFF)
    with pytest.raises(ss.ChecksumMismatchError, match="key path 'params/big': chunk 0"):
        ss.load(c, items=["params"])
    rep = ss.verify(c)
    assert not rep.ok and any("params/big" in p for p in rep.problems), rep.problems
    with pytest.raises(ss.ChecksumMismatchError):
        ss.convert(c, tmp_path / "out")


@pytest.mark.parametrize("table", [False, True], ids=["v1-list", "v3-table"])
def test_both_forms_of_the_checksum_load_and_verify(tmp_path: Path, table: bool) -> None:
    c = tmp_path / "c"
    _save(c, table)
    m = decode_manifest((c / "manifest.json").read_text(), "m")
    (chunk,) = m.arrays[0].chunks
    assert chunk.block_rows and chunk.checksum == checksum_of_blocks(chunk.block_checksums)
    np.testing.assert_array_equal(ss.load(c, items=["params"])["params"]["big"], BIG)
    # another writer's: the CRC-32C of the chunk's bytes, as docs/format.md allows
    old = _set_crc(c, table, lambda old, data: checksum(data))
    assert old == chunk.checksum and ss.verify(c).ok
    np.testing.assert_array_equal(ss.load(c, items=["params"])["params"]["big"], BIG)
    ss.convert(c, tmp_path / "out")
    assert ss.verify(tmp_path / "out").ok


def test_the_golden_v2_rows_chunk_records_the_crc_of_its_bytes() -> None:
    m = decode_manifest((GOLDEN / "manifest.json").read_text(), "golden")
    blocked = [c for a in m.arrays for c in a.chunks if c.block_rows]
    assert blocked and all(c.checksum != checksum_of_blocks(c.block_checksums)
                           for c in blocked)
    assert ss.verify(GOLDEN).ok


def test_copying_a_chunk_checks_its_checksum_too() -> None:
    from statestream.engine._copy import _ChunkCheck
    from statestream.format import ChunkEntry

    data = np.arange(64, dtype=np.uint8)
    blocks = (checksum(data[:32]), checksum(data[32:]))
    for crc, ok in ((checksum_of_blocks(blocks), True), (checksum(data), True),
                    (checksum(data) ^ 1, False)):
        check = _ChunkCheck(ChunkEntry(0, 0, 64, crc, (0,), (4,), 2, blocks))
        check.add(memoryview(data))
        if ok:
            check.check("f")
        else:
            with pytest.raises(ss.ChecksumMismatchError):
                check.check("f")
