"""Key paths: where a value sits inside a nested state.

A key path is a tuple of keys (``str`` for mapping keys and field names,
``int`` for sequence indices and integer mapping keys). Its display form
follows JSON Pointer (RFC 6901) without the leading slash: segments are
joined by ``/`` and, inside a segment, ``~`` is written ``~0`` and ``/`` is
written ``~1``. So ``{"a/b": {"c.d": x}}`` puts ``x`` at ``a~1b/c.d``.
"""

from __future__ import annotations

from typing import Union

# (Union, not `str | int`: a runtime type alias must work on Python 3.10's typing.)
__all__ = ["Key", "KeyPath", "format_keypath", "parse_keypath"]

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
