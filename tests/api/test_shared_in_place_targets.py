"""In-place targets that share memory: one target under two keys (an untied checkpoint
loaded into a tied model) or overlapping views of one buffer. Each array is read and
checked apart, then copied in in the target's order, so the later key's bytes win (as
``load_state_dict`` and a load without ``in_place`` give them) and a good checkpoint
is never reported corrupt. A tied checkpoint loaded into a tied target reads the one
array into the one memory, as before."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import statestream as ss
from statestream.api._overlap import InPlaceMemory
from statestream.errors import ChecksumMismatchError
from statestream.plan import ReadPiece, Wanted

torch = pytest.importorskip("torch")


class _LM(torch.nn.Module):
    def __init__(self, tie: bool) -> None:
        super().__init__()
        self.wte = torch.nn.Embedding(50, 16)
        self.lm_head = torch.nn.Linear(16, 50, bias=False)
        if tie:
            self.lm_head.weight = self.wte.weight


def test_an_untied_checkpoint_loads_in_place_into_a_tied_model(tmp_path: Path) -> None:
    torch.manual_seed(0)
    src = _LM(tie=False)
    ss.save(tmp_path / "c", {"model": src})
    copied, filled = _LM(tie=True), _LM(tie=True)
    ss.load(tmp_path / "c", {"model": copied})
    w = filled.wte.weight
    ss.load(tmp_path / "c", {"model": filled}, in_place=True)
    assert filled.wte.weight is w and filled.lm_head.weight is w  # same memory, still tied
    # the later key (lm_head.weight) wins, as load_state_dict gives it without in_place
    assert torch.equal(w, src.lm_head.weight) and torch.equal(w, copied.wte.weight)


@pytest.mark.parametrize("chunk", [None, 2000])  # one chunk (one-step restore) or several
def test_one_array_under_two_keys_gets_the_later_keys_bytes(tmp_path: Path,
                                                          chunk: int | None) -> None:
    io = ss.IOOptions(max_chunk_bytes=chunk) if chunk else None
    ss.save(tmp_path / "c", {"a": np.ones(1000), "b": np.zeros(1000)}, io=io)
    t = np.full(1000, 7.0)
    out = ss.load(tmp_path / "c", {"a": t, "b": t}, in_place=True)
    assert out["a"] is t and out["b"] is t and not t.any()
    out = ss.load(tmp_path / "c", {"b": t, "a": t}, in_place=True)  # the target's order
    assert (t == 1).all()


def test_overlapping_views_get_each_keys_bytes_in_order(tmp_path: Path) -> None:
    ss.save(tmp_path / "c", {"a": torch.ones(100), "b": torch.full((100,), 2.0)})
    buf = torch.zeros(150)
    other = torch.zeros(100)  # memory of its own: read straight into it
    out = ss.load(tmp_path / "c", {"a": buf[:100], "b": buf[50:]}, in_place=True)
    assert torch.equal(buf[:50], torch.ones(50)) and torch.equal(buf[50:], torch.full((100,), 2.0))
    assert out["a"].data_ptr() == buf.data_ptr()
    ss.load(tmp_path / "c", {"a": other, "b": buf[50:]}, in_place=True)
    assert torch.equal(other, torch.ones(100))


def test_a_corrupt_chunk_is_still_named_and_the_shared_target_left_as_it_was(
        tmp_path: Path) -> None:
    ss.save(tmp_path / "c", {"a": np.ones(1000), "b": np.zeros(1000)})
    data = next((tmp_path / "c" / "data").iterdir())
    raw = bytearray(data.read_bytes())
    raw[raw.index(bytes(8000)) + 7999] ^= 0xFF  # inside b (a's bytes are not all zeros)
    data.write_bytes(bytes(raw))
    t = np.full(1000, 7.0)
    with pytest.raises(ChecksumMismatchError, match="key path 'b'"):
        ss.load(tmp_path / "c", {"a": t, "b": t}, in_place=True)
    assert (t == 7).all()  # read apart: nothing copied in before every read was checked


def _piece(array: int, flat: np.ndarray) -> ReadPiece:
    return ReadPiece(array, 0, 0, 0, flat.nbytes, 0, (flat.nbytes,), np.dtype(np.uint8),
                     direct=flat)


def test_only_overlaps_of_different_arrays_or_bytes_are_read_apart() -> None:
    buf = np.zeros(96, dtype=np.uint8)
    own = InPlaceMemory()
    own.add_flat(_piece(0, buf))
    own.add_boxes(0, [((0,), buf.view(np.float64))])  # a tied array into its own memory
    own.add_flat(_piece(1, np.zeros(10, dtype=np.uint8)))
    assert own._clashing() == []
    own.add_boxes(2, [((0,), buf[40:60]), ((0,), buf[90:])])  # inside the first
    assert own._clashing() == [0, 2, 3, 4]  # flat 0, then boxes 0, 1, 2 (1 is apart)


def test_what_is_read_apart_is_copied_back_in_walk_order() -> None:
    buf = np.zeros(96, dtype=np.uint8)
    head, tail = buf[:8], buf[::-1][:5]  # tail: bytes 91-95, backwards
    own = InPlaceMemory()
    own.add_boxes(5, [((0,), head)])
    own.add_flat(_piece(6, buf))
    own.add_boxes(7, [((0,), tail)])
    assert own._clashing() == [1, 0, 2]  # box 0, flat 0, box 1 (flats come first)
    wanted = own.untangle([Wanted(5, (0,), head), Wanted(7, (0,), tail)])
    assert own.flats[0].direct is not buf and wanted[0].dest is not head
    own.flats[0].direct[:] = 1  # type: ignore[index]
    wanted[0].dest[:] = 2
    wanted[1].dest[:] = 3
    own.copy_back()
    assert buf[:8].tolist() == [1] * 8 and buf[8:91].tolist() == [1] * 83
    assert buf[91:].tolist() == [3] * 5
