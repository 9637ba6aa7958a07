"""Whether the boxes every process holds of an array cover it exactly once.

A multi-process save writes each distinct box of each array once (see
:func:`~statestream.plan.assign_writers`), so the distinct boxes must tile the
array: every element in exactly one of them. They do not when a sharded array
(a DTensor, a global JAX array) is saved at a key path by some ranks only
(elements held by no rank), or as a DTensor on one rank and a plain tensor on
another, or with different placements on different ranks (elements held in two
different boxes). :func:`cover_fault` finds where, cheaply: one box (a plain or
replicated array) and row blocks cost a sort at most; other layouts are cut
into the grid of every box's edges and each grid cell is counted once per box
covering it (for boxes that tile a grid, one cell per box), unless that grid
is too fine, where a sweep along one axis looks for two overlapping boxes.
:func:`cover_message` says, for an error, which rank holds which box.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterable, Mapping, Sequence

__all__ = ["Box", "CoverFault", "cover_fault", "cover_message"]

#: A box of an array: global start and shape.
Box = tuple[tuple[int, ...], tuple[int, ...]]

#: The grid cells (see the module docstring) counted per box at most, beyond a free
#: allowance; a finer grid is checked by the sweep instead.
_CELLS_PER_BOX = 16
_CELLS_FREE = 1 << 16
#: Boxes an error lists by name (then "and N more").
_LISTED = 8


@dataclasses.dataclass(frozen=True, slots=True)
class CoverFault:
    """Where an array's boxes fail to cover it exactly once.

    ``kind`` is ``"gap"`` (``region`` is held by no box; ``None`` where the layout
    is too irregular to say where cheaply), ``"overlap"`` (``region`` is held by
    both of ``boxes``) or ``"outside"`` (``boxes[0]`` reaches past the array).
    """

    kind: str
    region: Box | None
    boxes: tuple[Box, ...] = ()
    #: elements held by no box (a gap)
    missing: int = 0


def cover_fault(shape: tuple[int, ...], boxes: Iterable[Box]) -> CoverFault | None:
    """None if the non-empty ``boxes`` (distinct) cover an array of ``shape`` exactly
    once; else where they do not.

    Example:
        >>> cover_fault((4, 4), [((0, 0), (2, 4)), ((2, 0), (2, 4))]) is None
        True
        >>> cover_fault((4, 4), [((2, 0), (2, 4))])
        CoverFault(kind='gap', region=((0, 0), (2, 4)), boxes=(), missing=8)
        >>> cover_fault((4, 4), [((0, 0), (2, 4)), ((0, 2), (4, 2))]).region
        ((0, 2), (2, 2))
    """
    boxes = list(boxes)
    if _tiles(shape, boxes):
        return None
    nd = len(shape)
    total = math.prod(shape)
    live: list[Box] = []
    vol = 0
    for b in boxes:
        s, n = b
        if len(s) != nd or len(n) != nd or any(
                x < 0 or k < 0 or x + k > m for x, k, m in zip(s, n, shape)):
            return CoverFault("outside", None, (b,))
        v = math.prod(n)
        if v:
            live.append(b)
            vol += v
    if vol == total and len(live) <= 1:  # one box of all of it, or an empty array
        return None
    axes = [a for a in range(nd) if any(s[a] or n[a] != shape[a] for s, n in live)]
    if vol == total and len(axes) == 1:  # blocks along one axis: disjoint is enough
        a = axes[0]
        spans = sorted((s[a], s[a] + n[a]) for s, n in live)
        if all(q[0] >= p[1] for p, q in zip(spans, spans[1:])):
            return None
    return _grid_fault(shape, sorted(live), axes, total - vol)


def _tiles(shape: tuple[int, ...], boxes: list[Box]) -> bool:
    """Whether ``boxes`` (distinct) are the cells of a product grid over the array --
    one box of all of it, row blocks, a grid of blocks -- and so tile it exactly;
    False where not sure (then :func:`cover_fault` looks closer). Linear in the
    boxes: on each axis their spans must be intervals that split the axis, and
    there must be a box for every combination of one interval per axis."""
    nd = len(shape)
    if len(boxes) == 1:
        s, n = boxes[0]
        return n == shape and len(s) == nd and not any(s)
    if not nd:
        return False
    rest = {(s[1:], n[1:], len(s), len(n)) for s, n in boxes}
    if rest == {((0,) * (nd - 1), shape[1:], nd, nd)}:  # row blocks (the usual shards)
        return _splits(sorted([(s[0], s[0] + n[0]) for s, n in boxes]), shape[0])
    if {(len(s), len(n)) for s, n in boxes} != {(nd, nd)}:
        return False
    cells = 1
    for a, dim in enumerate(shape):
        spans = sorted({(s[a], s[a] + n[a]) for s, n in boxes})
        if not _splits(spans, dim):
            return False
        cells *= len(spans)
    return cells == len(boxes)


def _splits(spans: list[tuple[int, int]], dim: int) -> bool:
    """Whether the intervals ``spans`` (sorted) split ``[0, dim)``, one after another."""
    end = 0
    for lo, hi in spans:
        if lo != end or hi < lo:
            return False
        end = hi
    return end == dim


def _grid_fault(shape: tuple[int, ...], live: list[Box], axes: list[int],
                missing: int) -> CoverFault | None:
    """:func:`cover_fault` by counting cells of the grid of every box's edges on the
    ``axes`` some box does not span (the others are whole in every box)."""
    cuts = []
    for a in axes:
        edges = {0, shape[a]}
        for s, n in live:
            edges.add(s[a])
            edges.add(s[a] + n[a])
        cuts.append(sorted(edges))
    pos = [{c: i for i, c in enumerate(cs)} for cs in cuts]
    spans = [[range(p[s[a]], p[s[a] + n[a]]) for a, p in zip(axes, pos)] for s, n in live]
    if sum(math.prod(len(r) for r in sp) for sp in spans) > \
            _CELLS_PER_BOX * len(live) + _CELLS_FREE:
        k = max(range(len(axes)), key=lambda k: len(cuts[k]))  # the most cut axis
        return _sweep_fault(live, axes[k], missing)
    owner: dict[tuple[int, ...], int] = {}
    for i, sp in enumerate(spans):
        for cell in itertools.product(*sp):
            j = owner.setdefault(cell, i)
            if j != i:
                return CoverFault("overlap", _meet(live[j], live[i]), (live[j], live[i]))
    if not missing:  # no overlap and all the volume: covered exactly
        return None
    # the first cell held by none comes within len(owner) + 1 cells (in this order)
    grid = [len(cs) - 1 for cs in cuts]
    hole = next(c for c in itertools.product(*(range(g) for g in grid)) if c not in owner)
    end = _grow(hole, grid, owner)
    start, size = [0] * len(shape), list(shape)
    for k, a in enumerate(axes):
        start[a], size[a] = cuts[k][hole[k]], cuts[k][end[k] + 1] - cuts[k][hole[k]]
    return CoverFault("gap", (tuple(start), tuple(size)), (), missing)


def _grow(hole: tuple[int, ...], grid: list[int], owner: Mapping[tuple[int, ...], int]
          ) -> list[int]:
    """The last cell of a block of cells held by none from cell ``hole``, grown along
    each axis in turn while the next slab of cells is held by none (at most about
    ``len(owner)`` cells looked at, beyond a free allowance)."""
    end = list(hole)
    budget = _CELLS_PER_BOX * len(owner) + _CELLS_FREE
    for k in range(len(grid)):
        while end[k] + 1 < grid[k]:
            ranges = [range(h, e + 1) for h, e in zip(hole, end)]
            ranges[k] = range(end[k] + 1, end[k] + 2)
            budget -= math.prod(len(r) for r in ranges)
            if budget < 0 or any(c in owner for c in itertools.product(*ranges)):
                break
            end[k] += 1
    return end


def _sweep_fault(live: list[Box], a: int, missing: int) -> CoverFault | None:
    """Two overlapping boxes, found by a sweep along axis ``a``, else a gap not
    located (``missing`` elements), else None."""
    order = sorted(live, key=lambda b: b[0][a])
    for i, p in enumerate(order):
        end = p[0][a] + p[1][a]
        for j in range(i + 1, len(order)):
            q = order[j]
            if q[0][a] >= end:
                break
            meet = _meet(p, q)
            if meet is not None:
                return CoverFault("overlap", meet, (p, q))
    return CoverFault("gap", None, (), missing) if missing else None


def _meet(p: Box, q: Box) -> Box | None:
    """The box both ``p`` and ``q`` cover, if any."""
    lo = tuple(max(x, y) for x, y in zip(p[0], q[0]))
    hi = tuple(min(x + n, y + m) for x, n, y, m in zip(p[0], p[1], q[0], q[1]))
    if any(h <= low for low, h in zip(lo, hi)):
        return None
    return lo, tuple(h - low for low, h in zip(lo, hi))


# ----------------------------------------------------------------------------- messages


def region_text(box: Box, shape: tuple[int, ...]) -> tuple[str, bool]:
    """How an error names ``box`` of an array of ``shape``, and whether it is plural.

    Example:
        >>> region_text(((0, 0), (2, 4)), (4, 4)), region_text(((0, 3), (4, 1)), (4, 4))
        (('rows 0-1', True), ('column 3', False))
        >>> region_text(((0, 0, 2), (4, 1, 2)), (4, 4, 4))[0]
        'elements [:, 0:1, 2:4]'
    """
    s, n = box
    if not shape:
        return "the value", False
    part = [a for a in range(len(shape)) if s[a] or n[a] != shape[a]]
    if not part:
        return "the whole array", False
    nouns = {0: "element" if len(shape) == 1 else "row"}
    if len(shape) == 2:
        nouns[1] = "column"
    if len(part) == 1 and part[0] in nouns:
        a = part[0]
        if n[a] == 1:
            return f"{nouns[a]} {s[a]}", False
        return f"{nouns[a]}s {s[a]}-{s[a] + n[a] - 1}", True
    return "elements [" + ", ".join(
        ":" if x == 0 and k == m else f"{x}:{x + k}" for x, k, m in zip(s, n, shape)) + "]", True


def ranks_text(ranks: Sequence[int]) -> str:
    """``rank 3`` or ``ranks 0-3, 7`` (``ranks`` ascending).

    Example:
        >>> ranks_text([0, 1, 2, 3, 7]), ranks_text([1])
        ('ranks 0-3, 7', 'rank 1')
    """
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    parts = [str(a) if a == b else f"{a}, {b}" if b == a + 1 else f"{a}-{b}" for a, b in runs]
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(parts)


def cover_message(key: str, dtype: str, shape: tuple[int, ...], fault: CoverFault,
                  held: Mapping[Box, Sequence[int]], declared: Sequence[int],
                  world: int) -> str:
    """The error for ``fault`` of the array at key path ``key``: where, and which rank
    holds which box (``held``: distinct box -> holding ranks; ``declared``: the ranks
    that save the key path at all, ascending; ``world``: how many processes save)."""
    what = f"key path '{key}' ({dtype}{list(shape)})"
    if fault.kind == "outside":
        box = fault.boxes[0]
        head = (f"{ranks_text(sorted(held.get(box, ())))} holds the box at {list(box[0])} of "
                f"shape {list(box[1])} of {what}, which reaches outside the array")
    elif fault.kind == "overlap":
        p, q = fault.boxes
        a, b = min(held[p]), min(held[q])
        by = f"rank {a} twice, in" if a == b else f"ranks {min(a, b)} and {max(a, b)} with"
        text, plural = region_text(fault.region or p, shape)
        head = f"{text} of {what} {'are' if plural else 'is'} held by {by} different boxes"
    elif fault.region is not None:
        text, plural = region_text(fault.region, shape)
        head = (f"{text} of {what} {'are' if plural else 'is'} held by no rank "
                f"({fault.missing} of its {math.prod(shape)} elements are)")
    else:
        head = f"{fault.missing} of the {math.prod(shape)} elements of {what} are held by no rank"
    return (f"{head}; {_holders(shape, fault, held, declared, world)}. The ranks' boxes of "
            "an array must cover it exactly once, a box held by several ranks being the same "
            "box on each (a DTensor or global JAX array saved by some ranks only, a DTensor on "
            "one rank and a plain tensor on another, or different placements on different "
            "ranks break this); nothing was written")


def _holders(shape: tuple[int, ...], fault: CoverFault, held: Mapping[Box, Sequence[int]],
             declared: Sequence[int], world: int) -> str:
    """Who holds what: the boxes of ``fault`` first, at most :data:`_LISTED` boxes, then
    the ranks holding none of it and those without the key path."""
    first = [b for b in fault.boxes if b in held]
    rest = sorted(b for b in held if b not in first and math.prod(b[1]) > 0)
    boxes = first + rest
    groups: dict[tuple[int, ...], list[str]] = {}  # the same holders: one entry
    for b in boxes[:_LISTED]:
        groups.setdefault(tuple(sorted(held[b])), []).append(region_text(b, shape)[0])
    parts = [f"{ranks_text(ranks)} {'holds' if len(ranks) == 1 else 'hold'} {', '.join(where)}"
             for ranks, where in groups.items()]
    if len(boxes) > _LISTED:
        parts.append(f"{len(boxes) - _LISTED} more boxes are held")
    holding = {r for b in boxes for r in held[b]}
    none = [r for r in declared if r not in holding]
    if none:
        parts.append(f"{ranks_text(none)} {'holds' if len(none) == 1 else 'hold'} none of it")
    have = set(declared)
    absent = [r for r in range(world) if r not in have]
    if absent:
        parts.append(f"{ranks_text(absent)} {'has' if len(absent) == 1 else 'have'} "
                     "no such key path")
    return "; ".join(parts)
