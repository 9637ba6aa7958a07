"""Pick a storage backend for a path or URL."""

from __future__ import annotations

import os

from statestream.errors import StorageError
from statestream.storage._base import Storage
from statestream.storage._local import LocalStorage

__all__ = ["storage_for"]


def storage_for(path: str | os.PathLike[str]) -> tuple[Storage, str]:
    """Return ``(backend, path_within_backend)`` for a local path or URL.

    Example:
        >>> backend, p = storage_for("/tmp/ckpt")
        >>> type(backend).__name__, p
        ('LocalStorage', '/tmp/ckpt')
    """
    text = os.fspath(path)
    if "://" in text:
        scheme, _, rest = text.partition("://")
        if scheme == "file":
            return LocalStorage(), os.path.abspath(rest)
        raise StorageError(
            f"no storage backend for {scheme}:// URLs in this statestream version "
            f"(path {text!r}); use a local path"
        )
    return LocalStorage(), os.path.abspath(text)
