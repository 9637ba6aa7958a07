"""In-place destinations that share memory: one target under two keys (a tied model
loading an untied checkpoint, ``{"a": t, "b": t}``) or views of one buffer that overlap.

Read straight into the shared memory, one array's read could overwrite the other's
bytes before their checksum pass, and a good checkpoint was reported corrupt. The
walk records where each in-place destination lies (:meth:`InPlaceMemory.add_flat`,
:meth:`InPlaceMemory.add_boxes`); before the reads are planned, the destinations
that overlap another (unless both receive the same array into the same bytes: a tied
checkpoint loaded into a tied target) are read into fresh memory instead
(:meth:`InPlaceMemory.untangle`), and copied into the target once every read was
checked (:meth:`InPlaceMemory.copy_back`), in the walk's order: the later key's bytes
win, as ``load_state_dict`` (and a load without ``in_place``) gives them.
"""

from __future__ import annotations

import ctypes
import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from statestream._memory import fresh_bytes
from statestream.plan import ReadPiece, Wanted

__all__ = ["InPlaceMemory"]

#: typed for any buffer exporter (numpy's stubs declare no ``__buffer__`` before 3.12)
_byte_at: Callable[[Any], ctypes.c_byte] = ctypes.c_byte.from_buffer
_addressof = ctypes.addressof


def _address(flat: np.ndarray) -> int:
    """The address of a 1-D uint8 array's first byte."""
    try:  # ctypes reads it in a fraction of __array_interface__'s time (a writable buffer)
        return _addressof(_byte_at(flat))
    except (TypeError, ValueError, BufferError):  # read-only after all
        address: int = flat.__array_interface__["data"][0]
        return address


def _bounds(buf: np.ndarray) -> tuple[int, int]:
    """The first byte of ``buf`` (any strides) and the end of its last."""
    lo: int = buf.__array_interface__["data"][0]
    hi = lo + buf.itemsize
    for n, s in zip(buf.shape, buf.strides):
        if s < 0:
            lo += (n - 1) * s
        else:
            hi += (n - 1) * s
    return lo, hi


@dataclasses.dataclass(slots=True)
class InPlaceMemory:
    """The in-place destinations of one load, and what to copy after its reads."""

    #: the one-step restores' planned pieces, in walk order (each one's ``direct`` is
    #: the target's memory; where it lies is looked up once the walk is over)
    flats: list[ReadPiece] = dataclasses.field(default_factory=list)
    #: the other destinations, in walk order: (array, a box's buffer, first byte, end,
    #: how many ``flats`` the walk found before it)
    boxes: list[tuple[int, np.ndarray, int, int, int]] = dataclasses.field(
        default_factory=list)
    #: (target buffer, fresh buffer read in its place), in walk order
    copies: list[tuple[np.ndarray, np.ndarray]] = dataclasses.field(default_factory=list)

    def add_flat(self, piece: ReadPiece) -> None:
        """``piece`` (``LoadPlan.whole``) reads its array straight into its ``direct``,
        the target's own memory (a 1-D uint8 array)."""
        self.flats.append(piece)

    def add_boxes(self, array: int, boxes: list[tuple[tuple[int, ...], np.ndarray]]) -> None:
        """Array ``array``'s boxes go to these views of the target's own memory (each
        a ``Wanted`` of the load)."""
        for _, buf in boxes:
            if buf.size:
                self.boxes.append((array, buf, *_bounds(buf), len(self.flats)))

    def untangle(self, wanted: list[Wanted]) -> list[Wanted]:
        """Read the destinations that overlap another into fresh memory: their planned
        pieces get it (one-step restores), and the returned ``wanted`` (the others)."""
        #: (array, id of its box's buffer) -> the fresh buffer read in its place (one
        #: buffer may be the box of two arrays: a NumPy target under two keys)
        fresh_for: dict[tuple[int, int], np.ndarray] = {}
        for i in self._clashing():
            if i < len(self.flats):
                p = self.flats[i]
                assert p.direct is not None
                buf, p.direct = p.direct, fresh_bytes(p.direct.nbytes)
                self.copies.append((buf, p.direct))
                continue
            array, buf, _, _, _ = self.boxes[i - len(self.flats)]
            fresh = fresh_for.get((array, id(buf)))
            if fresh is None:
                fresh = fresh_for[(array, id(buf))] = (
                    fresh_bytes(buf.nbytes).view(buf.dtype).reshape(buf.shape))
            self.copies.append((buf, fresh))
        if not fresh_for:
            return wanted
        return [w if (w.array, id(w.dest)) not in fresh_for
                else dataclasses.replace(w, dest=fresh_for[(w.array, id(w.dest))])
                for w in wanted]

    def _clashing(self) -> list[int]:
        """The destinations whose bytes overlap another's, other than the same array
        into the same bytes (which the plan reads once), in walk order: an index into
        ``flats``, or ``len(flats)`` + an index into ``boxes``."""
        nf = len(self.flats)
        n = nf + len(self.boxes)
        if n < 2:
            return []
        lo = np.array([_address(p.direct) for p in self.flats]  # type: ignore[arg-type]
                      + [b[2] for b in self.boxes], dtype=np.int64)
        hi = lo[:nf] + np.array([p.nbytes for p in self.flats], dtype=np.int64)
        hi = np.concatenate([hi, np.array([b[3] for b in self.boxes], dtype=np.int64)])
        order = np.argsort(lo, kind="stable")
        reach = np.maximum.accumulate(hi[order])
        cuts = np.flatnonzero(lo[order][1:] >= reach[:-1]) + 1  # where a run of overlaps ends
        if len(cuts) == n - 1:  # no two overlap: the common case
            return []
        arrays = [p.array for p in self.flats] + [b[0] for b in self.boxes]
        clash: list[int] = []
        for run in np.split(order, cuts):
            ids = run.tolist()
            if len(ids) > 1 and len({(arrays[i], int(lo[i]), int(hi[i])) for i in ids}) > 1:
                clash += ids
        # walk order: a box came after the flats found before it, before the next
        return sorted(clash, key=lambda i: (i, 1, 0) if i < nf else (self.boxes[i - nf][4], 0, i))

    def copy_back(self) -> None:
        """Copy what was read in the targets' place into them, in walk order."""
        for dst, src in self.copies:
            np.copyto(dst, src)
        self.copies = []
