"""Checks of an Orbax checkpoint's stored arrays made before anything is read from them
(interop/_orbax.py).

Orbax's metadata of a number (``ScalarMetadata``) says shape ``()`` whatever is stored:
orbax restores it by reading its whole stored array and only then checks that it is 0-d.
A tiny checkpoint whose ``.zarray`` gives ``step`` the shape ``[2**40]`` (and whose
``_METADATA`` lets missing chunks read as the fill value) made that restore allocate and
fill terabytes. Each number's stored array is opened (its metadata only) and must be
0-d with a numeric dtype before orbax restores it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from statestream.errors import CheckpointCorruptError
from statestream.interop._deps import require
from statestream.tree import KeyPath, format_keypath

__all__ = ["check_scalars", "leaves_where"]

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
