"""Reads of part of an Orbax storage chunk (interop/_orbax_part.py): ``verify``'s 8 MiB
steps and a conversion's slabs read each part straight into their buffer, decode each
chunk once, and stay within the memory budget but for the one decoded chunk."""

from __future__ import annotations

import itertools
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

import statestream as ss

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _peak import peak_growth  # noqa: E402


def _save(path: Path, state: dict, save_args: dict | None = None) -> None:
    ocp = pytest.importorskip("orbax.checkpoint")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = ocp.args.PyTreeSave(state, save_args=save_args) if save_args else None
        if args is None:
            ocp.PyTreeCheckpointer().save(path, state)
        else:
            ocp.PyTreeCheckpointer().save(path, args=args)


@pytest.mark.parametrize("shape", [(), (7,), (3, 4), (2, 3, 5), (4, 1, 3, 2)])
def test_range_boxes_cover_a_range_in_c_order(shape: tuple[int, ...]) -> None:
    """Every element range of a C-order array is the boxes ``range_boxes`` gives, each
    contiguous at its offset, at most 2 * ndim - 1 of them."""
    from statestream.interop._orbax_part import range_boxes

    flat = np.arange(int(np.prod(shape))).reshape(shape)
    n = flat.size
    for e0, e1 in itertools.combinations(range(n + 1), 2):
        got = np.full(e1 - e0, -1)
        boxes = range_boxes(shape, e0, e1)
        assert len(boxes) <= max(1, 2 * len(shape) - 1)
        for at, box in boxes:
            part = flat[box].reshape(-1)
            assert (got[at:at + part.size] == -1).all()
            got[at:at + part.size] = part
        assert (got == np.arange(e0, e1)).all(), (shape, e0, e1, boxes)


def _orbax_reader(path: Path):  # type: ignore[no-untyped-def]
    from statestream.interop._orbax import open_orbax

    return open_orbax(str(path))


@pytest.mark.parametrize("part_min", [0, 1 << 40], ids=["own-store", "array-store"])
def test_any_byte_range_of_a_block_reads_its_bytes(tmp_path: Path, part_min: int,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Byte ranges of N-d blocks (element-aligned or not, in one view or several) read
    the block's C-order bytes, through a block's own store or the array's."""
    import statestream.interop._orbax_part as part

    ocp = pytest.importorskip("orbax.checkpoint")
    monkeypatch.setattr(part, "PART_MIN_BYTES", part_min)
    w = np.random.default_rng(1).standard_normal((24, 5, 7)).astype(np.float32)
    _save(tmp_path / "o", {"w": w}, {"w": ocp.SaveArgs(chunk_byte_size=5 * 7 * 4 * 8)})
    reader, m = _orbax_reader(tmp_path / "o")
    try:
        (entry,) = m.arrays
        assert len(entry.chunks) == 3
        rng = np.random.default_rng(2)
        for c in entry.chunks:
            name = m.files[c.file].name
            want = w[c.start[0]:c.start[0] + c.shape[0]].tobytes()
            for _ in range(20):
                a, b = sorted(int(x) for x in rng.integers(0, len(want) + 1, 2))
                cut = int(rng.integers(a, b + 1))
                views = [bytearray(cut - a), bytearray(b - cut)]
                reader.read_into(name, a, views)
                assert bytes(views[0]) + bytes(views[1]) == want[a:b]
    finally:
        reader.close()


def test_a_block_read_in_steps_is_decoded_once_and_let_go(tmp_path: Path) -> None:
    """``verify`` reads a 24 MiB chunk in 8 MiB steps: through one tensorstore of its own
    (its decoded chunk cached), opened once and dropped after the last step."""
    w = np.arange(6 << 20, dtype=np.float32)
    _save(tmp_path / "o", {"w": w})
    reader, m = _orbax_reader(tmp_path / "o")
    try:
        name = m.files[m.arrays[0].chunks[0].file].name
        assert reader.decode_bytes(name, 0, 8 << 20) == w.nbytes
        got = bytearray(w.nbytes)
        view = memoryview(got)
        for s in range(0, w.nbytes, 8 << 20):
            reader.read_into(name, s, [view[s:s + (8 << 20)]])
        assert bytes(got) == w.tobytes()
        assert reader._parts.opened == 1 and not reader._parts._open
    finally:
        reader.close()


def test_converting_a_large_orbax_chunk_reads_each_byte_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A conversion's slabs of one 32 MiB storage chunk ask the reader for their own rows
    (each slab read the whole chunk before: 16 MiB slabs read 64 MiB), and the result is
    bit-identical."""
    from statestream.interop._orbax import _OrbaxReader

    w = np.random.default_rng(3).standard_normal((4096, 2048)).astype(np.float32)
    _save(tmp_path / "o", {"w": w, "step": 3})
    asked = [0]
    orig = _OrbaxReader.read_into

    def counted(self, name, offset, buffers):  # type: ignore[no-untyped-def]
        if name in self._blocks:
            asked[0] += sum(memoryview(b).nbytes for b in buffers)
        return orig(self, name, offset, buffers)

    monkeypatch.setattr(_OrbaxReader, "read_into", counted)
    ss.convert(tmp_path / "o", tmp_path / "ck",
               memory=ss.MemoryOptions(memory_budget_bytes=16 << 20))
    assert asked[0] == w.nbytes
    out = ss.load(tmp_path / "ck")
    assert out["w"].tobytes() == w.tobytes() and out["step"] == 3
    assert ss.verify(tmp_path / "o", memory=ss.MemoryOptions(memory_budget_bytes=16 << 20)).ok


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_verifying_orbax_stays_within_one_decoded_chunk(tmp_path: Path) -> None:
    """``verify`` of 4 x 32 MiB Orbax arrays (one storage chunk each) under a 16 MiB budget
    holds one decoded chunk at a time: peak RSS grows by far less than the state
    (measured +48 MiB; +201 MiB when each 8 MiB step decoded the whole chunk and copied
    it again, on every reader thread)."""
    state = {f"w{i}": np.full(8 << 20, i, np.float32) for i in range(4)}
    _save(tmp_path / "o", state)
    _save(tmp_path / "small", {"w": np.arange(1024.0)})
    warm = "import statestream as ss; ss.verify(argv[1])"
    work = ("r = ss.verify(argv[0], memory=ss.MemoryOptions(memory_budget_bytes=16 << 20), "
            "io=ss.IOOptions(num_threads=2)); assert r.ok, r")
    growth = peak_growth(warm, work, str(tmp_path / "o"), str(tmp_path / "small"))
    assert growth < 80 << 20, f"peak RSS grew by {growth >> 20} MiB verifying 128 MiB"
