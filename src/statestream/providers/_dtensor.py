"""Which parts of a DTensor's global array this rank holds, and where they sit locally.

A ``Shard``/``Replicate`` layout gives each rank one box of the global array
(torch's ``compute_local_shape_and_global_offset``). FSDP2 on top of tensor
parallelism (``fully_shard`` over a module ``parallelize_module`` sharded on the
same dim) marks the FSDP dim ``_StridedShard(dim, split_factor=k)``: the dim is
first cut into ``k`` pieces, each piece into one chunk per rank of that mesh
dim, and a rank holds its chunk of every piece, one after another. Its local
tensor is then several boxes of the global array (for the usual FSDP2 + TP
layout the chunks happen to touch and form one box). :func:`dtensor_layout`
gives each held box with its place in the local tensor.

Only placements that select data are understood here; the callers refuse
``Partial`` (and any other kind) first.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import sys
from typing import Any

from statestream.errors import UnsupportedTypeError

Box = tuple[tuple[int, ...], tuple[int, ...]]
Runs = list[tuple[int, int]]  # [start, stop) ranges of global indices, in local order


@dataclasses.dataclass(frozen=True)
class DTensorLayout:
    """This rank's part of a DTensor: the local tensor's (unpadded) shape, and each
    held box of the global array as (global start, shape, start in the local tensor)."""

    local_shape: tuple[int, ...]
    boxes: list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]

    def held(self) -> list[Box]:
        """The non-empty boxes, as a ``PreparedArray`` lists them."""
        return [(g, s) for g, s, _ in self.boxes if math.prod(s)]

    def local_start(self, start: tuple[int, ...], shape: tuple[int, ...]) -> tuple[int, ...]:
        """Where the global box ``(start, shape)`` (inside one held box) starts locally."""
        for g, s, loc in self.boxes:
            if all(a <= b and b + n <= a + m for a, m, b, n in zip(g, s, start, shape)):
                return tuple(x + b - a for x, a, b in zip(loc, g, start))
        # Engine bug, not bad input: the engine asks only for boxes this process holds.
        raise ValueError(f"box {start}+{shape} is not held by this process")


def refuse_local_mismatch(local: Any, layout: DTensorLayout, obj: Any, where: str) -> None:
    """Refuse a DTensor whose local tensor does not hold the shard its placements give
    this rank (``DTensor.from_local(..., run_check=False)`` with a wrong ``shape``):
    smaller, its chunks would be short and the manifest would claim bytes no file
    holds; larger along a dim no placement shards, part of it would be dropped
    unseen. Larger along a sharded dim is a padded shard (its real part is saved)."""
    if not layout.held():
        return
    have = tuple(int(n) for n in local.shape)
    want = layout.local_shape
    sharded = {pl.dim % len(want) for pl in obj.placements if getattr(pl, "dim", None) is not None}
    if len(have) == len(want) and all(
            a == b or (a > b and d in sharded) for d, (a, b) in enumerate(zip(have, want))):
        return
    raise UnsupportedTypeError(
        f"DTensor at key path '{where}' (global shape {list(obj.shape)}, placements "
        f"{tuple(obj.placements)}) has a local tensor of shape {list(have)} on this rank, "
        f"but its placements give this rank a shard of shape {list(want)}: the local "
        "tensors do not match the global shape (from_local with run_check=False and a "
        "wrong shape?)")


def strided_split(placement: Any) -> int | None:
    """The split factor of a ``_StridedShard`` placement, None for any other kind."""
    if type(placement).__name__ != "_StridedShard":
        return None
    return int(placement.split_factor)


def dtensor_layout(global_shape: Any, mesh: Any, placements: Any) -> DTensorLayout:
    """This rank's boxes of a DTensor layout (Shard, _StridedShard, Replicate only)."""
    shape = tuple(int(n) for n in global_shape)
    if not any(strided_split(p) is not None for p in placements):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        lshape, offset = compute_local_shape_and_global_offset(shape, mesh, placements)
        lshape = tuple(int(x) for x in lshape)
        if len(offset) != len(shape):  # a rank outside the mesh: torch says ((0,), ())
            return DTensorLayout((0,), [])
        box = (tuple(int(x) for x in offset), lshape, (0,) * len(shape))
        return DTensorLayout(lshape, [box])
    coord = mesh.get_coordinate()
    if coord is None:  # a rank outside the mesh holds an empty tensor
        return DTensorLayout((0,), [])
    runs = held_runs(shape, [int(n) for n in mesh.shape], [int(c) for c in coord],
                     placements)
    return _layout_of_runs(runs)


def held_runs(shape: tuple[int, ...], mesh_shape: list[int], coord: list[int],
              placements: Any) -> list[Runs]:
    """Per dim of the global array, the index ranges this mesh coordinate holds, in
    the order its local tensor has them (placements applied left to right, as torch
    does; a chunk is ``torch.chunk``'s: ceil(size / parts) elements, the last
    ones shorter or empty)."""
    runs: list[Runs] = [[(0, n)] for n in shape]
    for mesh_dim, pl in enumerate(placements):
        pieces = strided_split(pl)
        if pieces is None and not pl.is_shard():
            continue  # Replicate
        dim = pl.dim % len(shape)
        runs[dim] = _take_chunk(runs[dim], pieces or 1, mesh_shape[mesh_dim], coord[mesh_dim])
    return runs


def _take_chunk(runs: Runs, pieces: int, parts: int, index: int) -> Runs:
    """Chunk ``index`` of ``parts`` of each of ``pieces`` consecutive pieces of ``runs``."""
    total = sum(b - a for a, b in runs)
    out: Runs = []
    psize = -(-total // pieces)
    for j in range(pieces):
        lo, hi = min(j * psize, total), min((j + 1) * psize, total)
        csize = -(-(hi - lo) // parts)
        out.extend(_slice_runs(runs, min(lo + index * csize, hi),
                               min(lo + (index + 1) * csize, hi)))
    return _merged(out)


def _slice_runs(runs: Runs, lo: int, hi: int) -> Runs:
    """The index ranges at local positions ``[lo, hi)`` of ``runs``."""
    out: Runs = []
    pos = 0
    for a, b in runs:
        n = b - a
        s, e = max(lo, pos), min(hi, pos + n)
        if s < e:
            out.append((a + s - pos, a + e - pos))
        pos += n
    return out


def _merged(runs: Runs) -> Runs:
    out: Runs = []
    for a, b in runs:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        elif b > a:
            out.append((a, b))
    return out


def _layout_of_runs(runs: list[Runs]) -> DTensorLayout:
    lshape = tuple(sum(b - a for a, b in r) for r in runs)
    if not all(lshape):
        return DTensorLayout(lshape, [])
    per_dim = []
    for r in runs:
        pos, entries = 0, []
        for a, b in r:
            entries.append((a, b - a, pos))
            pos += b - a
        per_dim.append(entries)
    boxes = [(tuple(e[0] for e in combo), tuple(e[1] for e in combo),
              tuple(e[2] for e in combo)) for combo in itertools.product(*per_dim)]
    return DTensorLayout(lshape, boxes)


def is_dtensor(obj: Any) -> bool:
    """Whether ``obj`` is a ``torch.distributed.tensor.DTensor`` (never imports torch)."""
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(obj, mod.DTensor)
