"""Checks of an Orbax checkpoint's stored arrays made before anything is read from them
(interop/_orbax.py).

Orbax's metadata of a number (``ScalarMetadata``) says shape ``()`` whatever is stored:
orbax restores it by reading its whole stored array and only then checks that it is 0-d.
A tiny checkpoint whose ``.zarray`` gives ``step`` the shape ``[2**40]`` (and whose
``_METADATA`` lets missing chunks read as the fill value) made that restore allocate and
fill terabytes. Each number's stored array is opened (its metadata only) and must be
0-d with a numeric dtype before orbax restores it.

A load allocates each array the size its metadata claims before reading it: a 1 KB
checkpoint claiming arrays of 2**40 elements made it allocate them (a MemoryError naming
nothing, or, for several that each fit, memory reserved for reads that then failed).
When the arrays' bytes exceed :data:`STORED_FACTOR` times the bytes of the item's files
plus 64 MiB (as foreign torch files, interop/_chunks.py) -- a real checkpoint is there
only when it compresses well, say zeros -- each array is asked which of its chunks are
stored (tensorstore's storage statistics, which see the inner chunks of a zarr v3 shard
too), before anything is allocated:

- orbax now stores every chunk, zeros too, and says so in ``_METADATA``
  (``store_array_data_equal_to_fill_value``); a missing chunk is then damage, an error
  when read, and an array missing one is refused here;
- a checkpoint without that flag (orbax's zarr v3 checkpoints did not store a chunk of
  zeros: an optimizer's fresh moments) reads a missing chunk as the fill value, as orbax
  does; the arrays with a chunk missing (each counted whole) may add up to at most the
  same bound, and are refused past it.

What a stored chunk decompresses to is the codec's business (zstd: at most about 32,000
times its size, for a run of zeros).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from statestream.errors import CheckpointCorruptError
from statestream.format import dtype_from_name
from statestream.interop._chunks import _STORED_SLACK, STORED_FACTOR
from statestream.interop._deps import require
from statestream.tree import KeyPath, format_keypath

__all__ = ["Stored", "check_claims", "check_fully_stored", "check_scalars", "leaves_where"]

#: The widest item of a number orbax stores (complex128).
_MAX_SCALAR_ITEMSIZE = 16


def leaves_where(tree: Any, pred: Callable[[Any], bool],
                 path: KeyPath = ()) -> list[tuple[KeyPath, Any]]:
    """(key path, leaf) of each leaf of orbax's metadata ``tree`` for which ``pred``
    holds."""
    if isinstance(tree, dict):
        return [x for k, v in tree.items() for x in leaves_where(v, pred, path + (k,))]
    if isinstance(tree, (list, tuple)):
        return [x for i, v in enumerate(tree) for x in leaves_where(v, pred, path + (i,))]
    return [(path, tree)] if pred(tree) else []


def check_scalars(item: str, scalars: list[tuple[KeyPath, Any]], spec: Callable[[str], Any],
                  context: Any) -> None:
    """Open the stored array of each number in ``scalars`` (key path, orbax's metadata;
    ``spec`` builds the tensorstore spec of orbax's name) and refuse one that is not 0-d
    or whose items are wider than a number's, before orbax reads its values.

    Raises:
        CheckpointCorruptError: naming ``item``, the key path, the stored shape and dtype.
    """
    if not scalars:
        return
    ts = require("tensorstore", "orbax", "reading Orbax checkpoints")
    futures = []
    for _, m in scalars:
        try:
            futures.append(ts.open(spec(str(m.name)), context=context, open=True, read=True))
        except (MemoryError, KeyboardInterrupt):
            raise
        except Exception as exc:  # orbax's restore reports it
            futures.append(exc)
    for (path, _), f in zip(scalars, futures):
        try:
            if isinstance(f, BaseException):
                continue
            store = f.result()
        except (MemoryError, KeyboardInterrupt):
            raise
        except Exception:  # a spec that does not open: orbax's restore reports it
            continue
        shape = tuple(int(n) for n in store.shape)
        itemsize = store.dtype.numpy_dtype.itemsize
        if shape or itemsize > _MAX_SCALAR_ITEMSIZE:
            raise CheckpointCorruptError(
                f"{item}: key path '{format_keypath(path)}' is a number in _METADATA, but "
                f"its stored array is {store.dtype.name} of shape {shape!r:.200}; refusing "
                "to read it")


def check_claims(item: str, leaves: Sequence[Any], open_store: Callable[[Any], Any],
                 stored: tuple[int, int], fills: bool) -> None:
    """:func:`check_fully_stored` of the reader's ``leaves`` (each with its key path,
    shape and dtype name), whose tensorstores ``open_store(leaf)`` opens; ``stored``:
    the bytes of the item's files, and of their holes (:func:`refuse_links`)."""
    arrays = [Stored(leaf.path, math.prod(leaf.shape) * dtype_from_name(leaf.dtype).itemsize,
                     functools.partial(open_store, leaf)) for leaf in leaves]
    check_fully_stored(item, arrays, stored[0], fills, stored[1])


class Stored(NamedTuple):
    """An array as :func:`check_fully_stored` asks about it."""

    path: KeyPath
    #: its bytes
    nbytes: int
    #: opens its tensorstore
    open_store: Callable[[], Any]


def check_fully_stored(item: str, arrays: list[Stored], stored: int, fills: bool,
                       holes: int = 0) -> None:
    """When ``arrays`` add up to more than :data:`STORED_FACTOR` times the ``stored``
    bytes of the item's files plus 64 MiB, refuse an array some of whose chunks are
    missing; or, where missing chunks read as the fill value (``fills``: a checkpoint
    written without ``store_array_data_equal_to_fill_value``, as orbax wrote before it
    stored every chunk), refuse once the arrays with a chunk missing add up to more
    than that (each counted whole: tensorstore answers for a whole array at once, but
    for part of one it visits every chunk of that part, millions of chunks of one
    element each for a hostile ``.zarray``). Files that are mostly holes (``holes``
    bytes of them past the same bound: a sparse chunk file stored uncompressed reads as
    zeros and ships as nothing) are refused too.

    Raises:
        CheckpointCorruptError: naming ``item``, the key path and the bytes claimed.
    """
    total = sum(a.nbytes for a in arrays)
    bound = STORED_FACTOR * stored + _STORED_SLACK
    if total <= bound:
        return
    if holes > bound:
        raise CheckpointCorruptError(
            f"{item}: its files are sparse, {holes} bytes of holes holding none of their "
            f"{stored} bytes stored, and the arrays claim {total} bytes; refusing to "
            "allocate them")
    missing = 0
    for a in _not_fully_stored(item, arrays):
        if not fills:
            raise CheckpointCorruptError(
                f"{item}: key path '{format_keypath(a.path)}' claims {a.nbytes} bytes, but "
                f"some of its chunks are missing (the arrays claim {total} bytes; the "
                f"item's files hold {stored}); refusing to allocate them")
        missing += a.nbytes
        if missing > bound:
            raise CheckpointCorruptError(
                f"{item}: key path '{format_keypath(a.path)}': the arrays with chunks "
                f"missing so far (read as the fill value) add up to {missing} bytes, more "
                f"than {STORED_FACTOR} times the {stored} bytes of the item's files plus "
                "64 MiB; refusing to allocate them")


def _not_fully_stored(item: str, arrays: list[Stored]) -> list[Stored]:
    """The arrays with bytes some of whose chunks are not stored."""
    stats = []
    for a in arrays:
        if a.nbytes:  # opened in order (each open starts the next ones)
            stats.append((a, a.open_store().storage_statistics(query_fully_stored=True)))
    out = []
    for a, f in stats:
        try:
            if not f.result().fully_stored:
                out.append(a)
        except (MemoryError, KeyboardInterrupt):
            raise
        except Exception as exc:
            raise CheckpointCorruptError(
                f"{item}: key path '{format_keypath(a.path)}': cannot list its stored "
                f"chunks ({type(exc).__name__}: {str(exc)[:300]})") from exc
    return out
