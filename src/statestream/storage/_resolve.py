"""Pick a storage backend for a path or URL."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

from statestream.errors import InvalidOptionError, StorageError
from statestream.storage._base import Storage
from statestream.storage._local import LocalStorage

__all__ = ["registered_backend", "set_backend", "storage_for"]

_LOCK = threading.Lock()
_BACKENDS: dict[str, Any] = {}


def set_backend(scheme: str, backend: Storage | None) -> None:
    """Use ``backend`` for ``scheme://`` URLs (``None`` restores the default).

    Example:
        >>> from statestream.storage import S3Storage, S3Options
        >>> set_backend("s3", S3Storage(S3Options(endpoint="http://127.0.0.1:9000")))
        >>> set_backend("s3", None)
    """
    with _LOCK:
        if backend is None:
            _BACKENDS.pop(scheme, None)
        else:
            _BACKENDS[scheme] = backend


def registered_backend(scheme: str) -> Storage | None:
    """The backend :func:`set_backend` installed for ``scheme``, if any."""
    with _LOCK:
        backend: Storage | None = _BACKENDS.get(scheme)
        return backend


def _s3() -> Storage:
    from statestream.storage._s3 import S3Storage

    return S3Storage()


def _gcs() -> Storage:
    from statestream.storage._gcs import GCSStorage

    return GCSStorage()


def _azure() -> Storage:
    from statestream.storage._azure import AzureStorage

    return AzureStorage()


#: The backend a scheme gets when set_backend installed none (configured from the environment).
_DEFAULTS: dict[str, Callable[[], Storage]] = {"s3": _s3, "gs": _gcs, "az": _azure}


def storage_for(path: str | os.PathLike[str]) -> tuple[Storage, str]:
    """Return ``(backend, path_within_backend)`` for a local path or URL.

    ``s3://bucket/prefix`` uses :class:`S3Storage` configured from the
    ``AWS_*`` environment, ``gs://bucket/prefix`` :class:`GCSStorage` (``GOOGLE_*``)
    and ``az://container/prefix`` :class:`AzureStorage` (``AZURE_*``), unless
    :func:`set_backend` installed another.

    Example:
        >>> backend, p = storage_for("/tmp/ckpt")
        >>> type(backend).__name__, p
        ('LocalStorage', '/tmp/ckpt')
    """
    text = os.fspath(path)
    if not text or text == "file://":
        # an unset variable, most likely: the current directory (which a manager would
        # lock, collect garbage in and delete steps from) is never meant by it
        raise InvalidOptionError(f"the path {text!r} is empty: it names no checkpoint (pass "
                                 "'.' to mean the current directory)")
    if "://" in text:
        scheme, _, rest = text.partition("://")
        if scheme == "file":
            return _local(), os.path.abspath(rest)
        with _LOCK:
            backend = _BACKENDS.get(scheme)
            if backend is None and scheme in _DEFAULTS:
                backend = _BACKENDS[scheme] = _DEFAULTS[scheme]()
        if backend is None:
            raise StorageError(
                f"no storage backend for {scheme}:// URLs (path {text!r}); use a local path, "
                "s3://, gs://, az://, or register one with statestream.storage.set_backend"
            )
        return backend, text.rstrip("/")
    return _local(), os.path.abspath(text)


def _local() -> Storage:
    """The backend for local paths: ``set_backend("file", ...)``'s, else the default."""
    backend: Storage | None = _BACKENDS.get("file")
    return backend if backend is not None else LocalStorage()
