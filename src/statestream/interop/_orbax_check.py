"""Checks of an Orbax checkpoint's stored arrays made before anything is read from them
(interop/_orbax.py).

Orbax's metadata of a number (``ScalarMetadata``) says shape ``()`` whatever is stored:
orbax restores it by reading its whole stored array and only then checks that it is 0-d.
A tiny checkpoint whose ``.zarray`` gives ``step`` the shape ``[2**40]`` (and whose
``_METADATA`` lets missing chunks read as the fill value) made that restore allocate and
fill terabytes. Each number's stored array is opened (its metadata only) and must be
0-d with a numeric dtype before orbax restores it.

An array's chunks are read with missing chunks an error (never the fill value), but a
load allocates each array the size its metadata claims before reading it: a 1 KB
checkpoint claiming arrays of 2**40 elements made it allocate them (a MemoryError naming
nothing, or, for several that each fit, memory reserved for reads that then failed).
When the arrays' bytes exceed :data:`STORED_FACTOR` times the bytes of the item's files
plus 64 MiB (as foreign torch files, interop/_chunks.py) -- a real checkpoint is there
only when it compresses well, say zeros -- each array must have every chunk stored
(tensorstore's storage statistics, which see the inner chunks of a zarr v3 shard too);
the first that does not is refused, naming it, before anything is allocated. What a
stored chunk decompresses to is the codec's business (zstd: at most about 32,000 times
its size, for a run of zeros).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from statestream.errors import CheckpointCorruptError
from statestream.interop._chunks import _STORED_SLACK, STORED_FACTOR
from statestream.interop._deps import require
from statestream.tree import KeyPath, format_keypath

__all__ = ["check_fully_stored", "check_scalars", "leaves_where"]

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


def check_fully_stored(item: str, arrays: list[tuple[KeyPath, int, Callable[[], Any]]],
                       stored: int) -> None:
    """Refuse an array some of whose chunks are missing, when ``arrays`` (key path, bytes,
    a function opening its tensorstore) add up to more than :data:`STORED_FACTOR` times
    the ``stored`` bytes of the item's files plus 64 MiB.

    Raises:
        CheckpointCorruptError: naming ``item``, the key path and the bytes claimed.
    """
    total = sum(n for _, n, _ in arrays)
    if total <= STORED_FACTOR * stored + _STORED_SLACK:
        return
    stats = []
    for path, nbytes, open_store in arrays:
        if nbytes:  # opened in order (each open starts the next ones)
            stats.append((path, nbytes, open_store().storage_statistics(
                query_fully_stored=True)))
    for path, nbytes, f in stats:
        try:
            full = f.result().fully_stored
        except (MemoryError, KeyboardInterrupt):
            raise
        except Exception as exc:
            raise CheckpointCorruptError(
                f"{item}: key path '{format_keypath(path)}': cannot list its stored chunks "
                f"({type(exc).__name__}: {str(exc)[:300]})") from exc
        if not full:
            raise CheckpointCorruptError(
                f"{item}: key path '{format_keypath(path)}' claims {nbytes} bytes, but some "
                f"of its chunks are missing (the arrays claim {total} bytes; the item's "
                f"files hold {stored}); refusing to allocate them")
