"""Manifest checks of chunk geometry: chunks that tile an array exactly, and data file
bytes that no two chunks share (used by the list and the table decoders alike)."""

from __future__ import annotations

import math

import numpy as np

from statestream.errors import CheckpointCorruptError
from statestream.format._decode_tree import _Bad
from statestream.format._manifest import FileEntry

__all__ = ["_check_file_ranges", "_tiles_exactly", "tiles_exactly"]

#: How many corner points (below) one array's chunks may have: enough for chunks
#: split along four axes at once; beyond it a manifest is refused as too costly.
_CORNERS_PER_CHUNK = 16
_CORNERS_FREE = 1 << 16


def _pairwise_disjoint(starts: np.ndarray, ends: np.ndarray) -> bool:
    """No two boxes overlap (for a few boxes: Python ints, not one NumPy call per
    pair, which cost ~0.2 ms per array of 8 chunks in every load's manifest check)."""
    s, e = starts.tolist(), ends.tolist()
    n = len(s)
    for i in range(n):
        si, ei = s[i], e[i]
        for j in range(i + 1, n):
            if (all(a < b for a, b in zip(si, e[j]))
                    and all(a < b for a, b in zip(s[j], ei))):
                return False
    return True


def _tiles_exactly(starts: np.ndarray, ends: np.ndarray, shape: tuple[int, ...]) -> bool:
    """True if the boxes ``[starts, ends)`` (non-empty, inside ``shape``, with volumes
    summing to the array's) cover every element exactly once, i.e. do not overlap.

    Linear-time apart from one sort, whatever the layout: the indicator function
    of a box is a signed sum of the "orthant" indicators ``x >= c`` of its
    corners (``+`` at its start, ``-`` per axis where it ends early), orthants of
    distinct corners are linearly independent, so the boxes tile the array
    exactly iff all corner charges cancel except ``+1`` at the origin. Costs
    ``2^k`` points for a chunk that ends early on ``k`` axes (bounded, see
    ``_CORNERS_PER_CHUNK``).

    Raises:
        _Bad: the layout has more corner points than the limit allows.
    """
    n = len(starts)
    shp = np.asarray(shape, dtype=np.int64)
    # axes on which every chunk spans the whole array play no part
    keep = ~np.all((starts == 0) & (ends == shp), axis=0)
    starts, ends, shp = starts[:, keep], ends[:, keep], shp[keep]
    d = starts.shape[1]
    if d == 0:
        return n == 1
    if d == 1:  # row blocks: intervals, disjoint iff each ends before the next starts
        if n <= 64:
            spans = sorted(zip(starts[:, 0].tolist(), ends[:, 0].tolist()))
            return all(b[0] >= a[1] for a, b in zip(spans, spans[1:]))
        order = np.argsort(starts[:, 0], kind="stable")
        s0, e0 = starts[order, 0], ends[order, 0]
        return bool(np.all(s0[1:] >= e0[:-1]))
    if n <= 8:
        return _pairwise_disjoint(starts, ends)
    early = ends < shp
    total = int(np.sum(np.left_shift(np.int64(1), early.sum(axis=1, dtype=np.int64))))
    if total > _CORNERS_PER_CHUNK * n + _CORNERS_FREE:
        raise _Bad(f"chunks split along too many axes at once ({total} corner points for "
                   f"{n} chunks; the limit is {_CORNERS_PER_CHUNK} per chunk)")
    # coordinates as ranks per axis (small ints), then corners as mixed-radix keys
    rs, re_, radix = np.empty((n, d), np.int64), np.empty((n, d), np.int64), []
    for ax in range(d):
        u, inv = np.unique(np.concatenate([starts[:, ax], ends[:, ax]]), return_inverse=True)
        rs[:, ax], re_[:, ax] = inv[:n], inv[n:]
        radix.append(len(u) + 1)
    pts, box = rs, np.arange(n, dtype=np.int64)
    sign = np.ones(n, dtype=np.int64)
    for ax in range(d):
        sel = np.nonzero(early[box, ax])[0]
        new = pts[sel]
        new[:, ax] = re_[box[sel], ax]
        pts = np.concatenate([pts, new])
        sign = np.concatenate([sign, -sign[sel]])
        box = np.concatenate([box, box[sel]])
    del box
    if math.prod(radix) < 1 << 62:
        key = np.zeros(len(pts), dtype=np.int64)
        for ax in range(d):
            key = key * radix[ax] + pts[:, ax]
        order = np.argsort(key, kind="stable")
        key = key[order]
        first = np.concatenate([[True], key[1:] != key[:-1]])
    else:  # too many distinct coordinates for one integer key: sort the rows
        order = np.lexsort(pts.T[::-1])
        sp = pts[order]
        first = np.concatenate([[True], np.any(sp[1:] != sp[:-1], axis=1)])
    charge = np.add.reduceat(sign[order], np.nonzero(first)[0])
    nz = np.nonzero(charge)[0]
    if len(nz) != 1 or charge[nz[0]] != 1:
        return False
    origin_group = np.nonzero(first)[0][nz[0]]
    return bool(not pts[order[origin_group]].any())


def tiles_exactly(starts: np.ndarray, ends: np.ndarray, shape: tuple[int, ...],
                  what: str) -> bool:
    """:func:`_tiles_exactly` for readers of other formats, whose chunk layouts get the
    checks (and the cost bound) a manifest's do: the same preconditions, and too many
    corner points raise :class:`CheckpointCorruptError` naming ``what``."""
    try:
        return _tiles_exactly(starts, ends, shape)
    except _Bad as e:
        raise CheckpointCorruptError(f"{what}: {e}") from None


def _check_file_ranges(files: list[FileEntry], r: np.ndarray) -> None:
    """No two chunks share a byte of a file (rows of ``[file, offset, nbytes]``).

    With this, the chunks a load allocates for are all backed by distinct file
    bytes, so a load never allocates more than the data files hold.
    """
    r = r[r[:, 2] > 0]
    order = np.lexsort((r[:, 1], r[:, 0]))
    r = r[order]
    same = r[1:, 0] == r[:-1, 0]
    bad = np.nonzero(same & (r[1:, 1] < r[:-1, 1] + r[:-1, 2]))[0]
    if len(bad):
        f, off, nb = (int(x) for x in r[bad[0]])
        raise _Bad(f"two chunks share bytes of {files[f].name} (one spans [{off}, "
                   f"{off + nb}), the next starts at {int(r[bad[0] + 1, 1])})")
