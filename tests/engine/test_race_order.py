"""The order in which a racing snapshot's copy threads take chunks."""

from __future__ import annotations

import pytest

from statestream.engine._snapshot import copy_order
from statestream.plan import ArraySpec, StreamPlanner

MiB = 1 << 20


def _llama_items() -> list:
    # A Llama-like state's parameters (hidden 1024, 16 layers, vocab 32000: 1.01 GiB
    # of fp32) laid out as a save lays them out: 4 files, chunks up to 64 MiB.
    shapes = [(32000, 1024)]
    for _ in range(16):
        shapes += [(1024,), (1024, 1024), (1024, 1024), (1024, 1024), (1024, 1024),
                   (1024,), (2816, 1024), (2816, 1024), (1024, 2816)]
    shapes += [(1024,), (32000, 1024)]
    sp = StreamPlanner(file_prefix="data/r0", max_files=4, max_chunk_bytes=64 * MiB)
    return [sp.add(i, ArraySpec(s, 4)) for i, s in enumerate(shapes)]


def _left_per_file(items: list, order: list, budget: int) -> list[int]:
    # The race: copy threads take chunks in ``order`` until one does not fit the
    # budget; each file's writer writes the rest from the state while the call blocks.
    copied, used = set(), 0
    for it in order:
        if used + it.nbytes > budget:
            break
        used += it.nbytes
        copied.add((it.array, it.chunk))
    left = [0] * 4
    for its in items:
        for it in its:
            if (it.array, it.chunk) not in copied:
                left[it.file] += it.nbytes
    return left


@pytest.mark.parametrize("fraction", [0.25, 0.5, 0.75])
def test_copies_leave_every_writer_about_the_same_bytes(fraction: float) -> None:
    items = _llama_items()
    total = sum(it.nbytes for its in items for it in its)
    order = copy_order(items)
    assert sorted((it.array, it.chunk) for it in order) == sorted(
        (it.array, it.chunk) for its in items for it in its)  # every chunk once
    left = _left_per_file(items, order, int(fraction * total))
    # Balanced to within one of the small chunks (taking the last chunk first left
    # the writer behind the embedding's 64 MiB chunks 53-67 MiB more than the others).
    assert max(left) - min(left) <= 16 * MiB, [n // MiB for n in left]
    backwards = [it for its in reversed(items) for it in reversed(its)]
    old = _left_per_file(items, backwards, int(fraction * total))
    assert max(left) < max(old)  # the blocking phase ends with the slowest writer


def test_each_file_is_taken_from_the_back() -> None:
    # Within a file the copies go from its last chunk towards its first, so they meet
    # its writer, which goes from the first chunk on.
    items = _llama_items()
    seen: dict[int, list[int]] = {}
    for it in copy_order(items):
        seen.setdefault(it.file, []).append(it.offset)
    for offsets in seen.values():
        assert offsets == sorted(offsets, reverse=True)
