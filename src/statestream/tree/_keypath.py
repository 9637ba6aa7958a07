"""Key paths: where a value sits inside a nested state.

A key path is a tuple of keys (``str`` for mapping keys and field names,
``int`` for sequence indices and integer mapping keys). Its display form
follows JSON Pointer (RFC 6901) without the leading slash: segments are
joined by ``/`` and, inside a segment, ``~`` is written ``~0`` and ``/`` is
written ``~1``. So ``{"a/b": {"c.d": x}}`` puts ``x`` at ``a~1b/c.d``.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Union

# (Union, not `str | int`: a runtime type alias must work on Python 3.10's typing.)
__all__ = ["Key", "KeyPath", "format_keypath", "match_keypath", "parse_keypath"]

Key = Union[str, int]  # noqa: UP007
KeyPath = tuple[Key, ...]


def _escape(key: Key) -> str:
    text = str(key)
    return text.replace("~", "~0").replace("/", "~1")


def format_keypath(path: KeyPath) -> str:
    """Return the display form of ``path``.

    Example:
        >>> format_keypath(("params", "layer/0", 3))
        'params/layer~10/3'
        >>> format_keypath(())
        '<root>'
    """
    if not path:
        return "<root>"
    return "/".join(_escape(k) for k in path)


def parse_keypath(text: str) -> tuple[str, ...]:
    """Split a display key path into its (string) segments.

    Example:
        >>> parse_keypath("params/layer~10/w")
        ('params', 'layer/0', 'w')
    """
    if text in ("", "<root>"):
        return ()
    return tuple(seg.replace("~1", "/").replace("~0", "~") for seg in text.split("/"))


def match_keypath(pattern: str, path: KeyPath) -> bool:
    """Whether key path ``path`` is at or under a key path matching ``pattern``.

    ``pattern`` is a display key path whose segments may use shell wildcards
    within one key (``*``, ``?``, ``[seq]``; :func:`fnmatch.fnmatchcase`),
    and ``**`` for any number of keys (zero or more). As with
    ``pickle_paths``, a pattern covers the whole subtree of what it matches:
    ``"opt"``, ``"opt/**"`` and ``"opt/*"`` all match ``opt/m/w``.

    Example:
        >>> match_keypath("opt/**", ("opt", "m", "w")), match_keypath("params", ("opt", "w"))
        (True, False)
        >>> match_keypath("**/bias", ("model", "layers", 3, "bias"))
        True
        >>> match_keypath("model/layers/*/w*", ("model", "layers", 3, "weight"))
        True
    """
    pat = parse_keypath(pattern)
    keys = tuple(str(k) for k in path)
    return _match(pat, 0, keys, 0)


def _match(pat: tuple[str, ...], i: int, keys: tuple[str, ...], j: int) -> bool:
    while i < len(pat):
        seg = pat[i]
        if seg == "**":
            # any number of keys, then the rest of the pattern (or nothing: a subtree)
            return any(_match(pat, i + 1, keys, k) for k in range(j, len(keys) + 1))
        if j >= len(keys) or not fnmatchcase(keys[j], seg):
            return False
        i, j = i + 1, j + 1
    return True  # the pattern is used up: ``keys[:j]`` matched, the rest is its subtree
