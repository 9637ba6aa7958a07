"""In-place loads of large local arrays read and checksum each 1 MiB slice as it lands
(one pass over memory); every byte is still verified, damage is named, and the
bytes equal what was saved for every kind of chunk (with block checksums, one
checksum over many slices, a size that is not a whole number of slices)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import statestream as ss
import statestream.engine._read as read_mod
from statestream.errors import ChecksumMismatchError


def _state() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {
        "rows": rng.standard_normal((3000, 1024)).astype(np.float32),   # 12 MB, blocks
        "flat": rng.standard_normal(5_000_003).astype(np.float32),      # one CRC, odd size
        "small": np.arange(100, dtype=np.int32),                       # not streamed
    }


def _targets() -> dict[str, np.ndarray]:
    return {k: np.zeros_like(v) for k, v in _state().items()}


@pytest.fixture()
def ckpt(tmp_path: Path) -> Path:
    d = tmp_path / "ck"
    ss.save(d, _state(), io=ss.IOOptions(max_chunk_bytes=8 << 20))
    return d


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    seen: list[int] = []
    real = read_mod._read_checked

    def spy(reader: Any, name: str, p: Any, describe: Any, dropper: Any = None) -> Any:
        seen.append(p.nbytes)
        return real(reader, name, p, describe, dropper)

    monkeypatch.setattr(read_mod, "_read_checked", spy)
    return seen


def test_large_in_place_pieces_stream_and_equal_the_saved_bytes(
        ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _spy(monkeypatch)
    tgt = _targets()
    out = ss.load(ckpt, tgt, in_place=True)
    for k, v in _state().items():
        assert out[k] is tgt[k]
        np.testing.assert_array_equal(tgt[k], v)
    assert len(seen) >= 3 and min(seen) >= read_mod._STREAM_MIN  # both large arrays' chunks


def _flip(ckpt: Path, key: str, byte: int) -> None:
    doc = json.loads((ckpt / "manifest.json").read_bytes())
    a = doc["tree"]["c"][doc["tree"]["k"].index(key)]["a"]
    file, offset = doc["arrays"][a]["chunks"][-1][:2]
    f = ckpt / doc["files"][file][0]
    with open(f, "r+b") as fh:
        fh.seek(offset + byte)
        b = fh.read(1)
        fh.seek(offset + byte)
        fh.write(bytes([b[0] ^ 0x40]))


@pytest.mark.parametrize("key", ["rows", "flat"])
def test_damage_in_a_streamed_piece_is_named(ckpt: Path, key: str) -> None:
    _flip(ckpt, key, 3 * (1 << 20) + 5)  # inside the last chunk's fourth slice
    with pytest.raises(ChecksumMismatchError, match=f"'{key}'"):
        ss.load(ckpt, _targets(), in_place=True)
    rep = ss.verify(ckpt)
    assert not rep.ok and any(key in p for p in rep.problems)


def test_small_pieces_are_not_streamed(
        ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _spy(monkeypatch)
    ss.load(ckpt, io=ss.IOOptions(map_files=False))  # fresh destinations: large, in place
    assert seen  # they stream too
    seen.clear()
    small = {"small": np.zeros(100, dtype=np.int32)}
    ss.load(ckpt, small, items=["small"], in_place=True)
    np.testing.assert_array_equal(small["small"], _state()["small"])
    assert seen == []


def test_streamed_pieces_get_requests_of_their_own(ckpt: Path) -> None:
    from statestream.plan import ReadPiece, ReadRequest
    from statestream.storage import LocalStorage

    big = read_mod._STREAM_MIN
    dest = np.zeros(big, dtype=np.uint8)

    def piece(off: int, n: int) -> ReadPiece:
        return ReadPiece(0, off, 0, off, n, 0, (n,), np.dtype("uint8"), direct=dest[:n])

    sizes = [100, big, 50, 60, big]
    offs = [0, 4096, 4096 + big, 8192 + big, 12288 + big]
    pieces = [piece(o, n) for o, n in zip(offs, sizes)]
    req = ReadRequest(0, 0, offs[-1] + big, list(pieces))
    r = LocalStorage().open_read(str(ckpt))
    try:
        got = read_mod.split_streamed(r, [req])
    finally:
        r.close()
    assert [[p.offset for p in q.pieces] for q in got] == [[0], [4096], offs[2:4], [offs[4]]]
    assert [(q.offset, q.nbytes) for q in got][2] == (offs[2], offs[3] + 60 - offs[2])
    assert read_mod.split_streamed(object(), [req]) == [req]  # type: ignore[arg-type]
