"""The key of an array in a multi-process plan: its key path, told apart by key type.

The processes of a save name each array by its key path when they unite their
trees, number the arrays and assign the writers. A key path's display form
(:func:`~statestream.tree.format_keypath`) writes an int key and a str key alike
(``{0: x, "0": y}`` puts both at ``0``), which would make two arrays one. An array's
key is its display form but for a str key that reads as an int, which is marked
``~2`` (the display form writes ``~`` only as ``~0`` or ``~1``, so nothing else
reads ``~2``): ``{0: x, "0": y}`` gives the keys ``0`` and ``~20``. Errors show a
key as its display form (:func:`shown_key`).
"""

from __future__ import annotations

import re

from statestream.tree import Key, KeyPath, format_keypath

__all__ = ["array_key", "shown_key", "twin_key"]

#: what ``str()`` writes of an int
_INT_TEXT = re.compile(r"-?(?:0|[1-9][0-9]*)")
_INT_START = frozenset("-0123456789")
_MARK = "~2"


def _int_text(key: Key) -> bool:
    return (isinstance(key, str) and key[:1] in _INT_START
            and _INT_TEXT.fullmatch(key) is not None)


def _segment(key: Key) -> str:
    return _MARK + str(key) if _int_text(key) else format_keypath((key,))


def array_key(path: KeyPath) -> str:
    """The key of the array at ``path`` (its display form unless a str key reads as
    an int).

    Example:
        >>> array_key(("a", 0)), array_key(("a", "0")), array_key(("a", "07"))
        ('a/0', 'a/~20', 'a/07')
    """
    for k in path:  # (a loop, not any(): this runs for every array of every save)
        if type(k) is str and k[:1] in _INT_START and _INT_TEXT.fullmatch(k):
            return "/".join(_segment(k) for k in path)
    return format_keypath(path)


def shown_key(key: str) -> str:
    """An array's key as a key path's display form, for errors.

    Example:
        >>> shown_key("a/~20/b~1c")
        'a/0/b~1c'
    """
    return key.replace(_MARK, "")


def twin_key(key: Key) -> Key | None:
    """The key of the other type that a key path writes alike, if any.

    Example:
        >>> twin_key(0), twin_key("-3"), twin_key("07"), twin_key("w")
        ('0', -3, None, None)
    """
    if isinstance(key, int):
        return str(key)
    return int(key) if _int_text(key) else None
