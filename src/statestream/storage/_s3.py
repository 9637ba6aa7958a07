"""S3-compatible object storage (via ``obstore``): commit by writing a marker last.

Layout of ``s3://bucket/prefix``::

    prefix/COMMITTED                 the commit marker; names the live root
    prefix/<root>/manifest.json      the manifest of that save
    prefix/<root>/data/r<R>-<N>.bin  its data objects (multipart uploads)

Each save writes under a fresh random ``<root>``; the single PUT of
``COMMITTED`` makes it visible (old or new, never a mix), then the previous
root is deleted. An interrupted save leaves only an unreferenced root,
which nothing loads. Credentials come from the usual ``AWS_*`` environment
variables (read by the client) or :class:`S3Options`; they are never put in
messages or reprs.
"""

from __future__ import annotations

import builtins
import dataclasses
import datetime
import errno
import hashlib
import json
import os
import re
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

from statestream.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    ManagerLockedError,
    StorageError,
    TruncatedFileError,
    UnsafeCheckpointError,
    storage_error,
)
from statestream.format import COMMIT_NAME, DATA_DIR, MAX_COMMIT_BYTES, validate_file_name
from statestream.storage._base import Buffer, Leftover, StorageCapabilities, check_member_name
from statestream.storage._hints import manager_steps_hint

__all__ = ["S3Options", "S3Storage"]

_ROOT_RE = re.compile(r"^[0-9a-f]{32}$")


@dataclasses.dataclass(frozen=True, kw_only=True)
class S3Options:
    """Where and how to reach an S3-compatible store (unset: ``AWS_*`` environment).

    Attributes:
        endpoint: e.g. ``http://127.0.0.1:9000`` for MinIO or a local server.
        region: the bucket's region.
        access_key_id, secret_access_key, session_token: credentials (hidden in repr).
        allow_http: permit plain-HTTP endpoints (local test servers).
        part_bytes: multipart upload part size.
        max_concurrency: parts uploaded in parallel per object.
        timeout_s: limit on one request, from connecting to the end of the response.
        connect_timeout_s: limit on establishing a connection.
        max_retries: retries of a failed request (server errors, dropped
            connections, timeouts of read-only requests), with exponential backoff.
        retry_timeout_s: no retry starts this long after a request's first attempt.
            A request thus fails within about ``retry_timeout_s + timeout_s``.
    """

    endpoint: str | None = None
    region: str | None = None
    access_key_id: str | None = dataclasses.field(default=None, repr=False)
    secret_access_key: str | None = dataclasses.field(default=None, repr=False)
    session_token: str | None = dataclasses.field(default=None, repr=False)
    allow_http: bool = False
    part_bytes: int = 16 << 20
    max_concurrency: int = 8
    timeout_s: float = 120.0
    connect_timeout_s: float = 10.0
    max_retries: int = 5
    retry_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        for name in ("timeout_s", "connect_timeout_s", "retry_timeout_s"):
            if not getattr(self, name) > 0:
                raise StorageError(f"S3Options.{name} must be > 0, got {getattr(self, name)!r}")
        if self.max_retries < 0:
            raise StorageError(f"S3Options.max_retries must be >= 0, got {self.max_retries}")


def split_url(url: str) -> tuple[str, str]:
    """``s3://bucket/a/b`` -> (``bucket``, ``a/b``)."""
    if not url.startswith("s3://"):
        raise StorageError(f"not an s3:// URL: {url!r}")
    rest = url[5:]
    bucket, _, prefix = rest.partition("/")
    prefix = prefix.strip("/")
    if len(bucket) < 3 or not prefix:
        raise StorageError(
            f"{url!r} must look like s3://bucket/prefix (bucket names have 3+ characters)"
        )
    if any(part in ("", ".", "..") for part in prefix.split("/")):
        raise StorageError(f"{url!r} has an empty, '.' or '..' path segment")
    return bucket, prefix


def _map_error(exc: BaseException, what: str) -> BaseException:
    """Turn a client error into a statestream error without leaking credentials."""
    from obstore import exceptions as oe

    name = type(exc).__name__
    first = str(exc).splitlines()[0] if str(exc) else name
    first = re.sub(r"(?i)(secret|signature|credential|token)[^ ,;]*", r"\1=<hidden>", first)
    if "nosuchbucket" in first.lower().replace(" ", ""):
        return StorageError(f"{what}: the bucket does not exist")
    if isinstance(exc, (oe.NotFoundError, FileNotFoundError)):
        return CheckpointNotFoundError(f"{what}: not found")
    if isinstance(exc, (oe.PermissionDeniedError, PermissionError)):
        return storage_error(f"{what}: access denied (403); check the credentials and the "
                             "bucket policy", errno.EACCES)
    if isinstance(exc, oe.UnauthenticatedError):
        return StorageError(f"{what}: not authenticated; set AWS_ACCESS_KEY_ID and "
                            "AWS_SECRET_ACCESS_KEY (or pass S3Options)")
    text = first.lower()
    if "403" in text or "forbidden" in text or "accessdenied" in text:
        return storage_error(f"{what}: access denied (403); check the credentials and the "
                             "bucket policy", errno.EACCES)
    if "kind: Timeout" in str(exc) or "TimedOut" in str(exc):  # obstore's error chain
        return storage_error(f"{what} timed out (S3Options.timeout_s / retry_timeout_s): "
                             f"{name}: {first[:300]}", errno.ETIMEDOUT)
    if "credential" in text or "signature" in text:
        return StorageError(f"{what}: credentials missing or invalid")
    return StorageError(f"{what} failed: {name}: {first[:300]}")


#: Client options obstore reads from ``AWS_<NAME>`` only when given none explicitly.
_ENV_CLIENT_BOOLS = ("allow_http", "allow_invalid_certificates", "http1_only", "http2_only")
_ENV_CLIENT_STRINGS = ("proxy_url", "proxy_ca_certificate", "proxy_excludes", "user_agent")


def _env_client_options() -> dict[str, Any]:
    """``AWS_ALLOW_HTTP`` & co.: passing client options (for the timeouts) makes obstore
    ignore these variables, so they are read here."""
    out: dict[str, Any] = {}
    for name in _ENV_CLIENT_BOOLS:
        value = os.environ.get(f"AWS_{name.upper()}")
        if value is not None:
            out[name] = value.strip().lower() == "true"
    for name in _ENV_CLIENT_STRINGS:
        value = os.environ.get(f"AWS_{name.upper()}")
        if value:
            out[name] = value
    return out


def _config_key(options: S3Options) -> tuple[Any, ...]:
    """What a client is built from: the options and every ``AWS_*`` variable.

    Values are hashed so that the key holds no secret in clear.
    """
    env = tuple(sorted((k, hashlib.sha256(v.encode()).hexdigest())
                       for k, v in os.environ.items() if k.startswith("AWS_")))
    return (options, env)


class _S3FileWriter:
    def __init__(self, owner: S3Storage, bucket: str, key: str) -> None:
        import obstore

        self._where = f"s3://{bucket}/{key}"
        try:
            self._w = obstore.open_writer(owner._store(bucket), key,
                                          buffer_size=owner.options.part_bytes,
                                          max_concurrency=owner.options.max_concurrency)
        except Exception as exc:
            raise _map_error(exc, f"opening {self._where}") from exc
        self._pos = 0

    def write_at(self, buffers: Sequence[Buffer], offset: int) -> None:
        if offset < self._pos:
            raise StorageError(f"object writes must be sequential ({self._where})")
        try:
            if offset > self._pos:
                self._w.write(bytes(offset - self._pos))
            for b in buffers:
                mv = memoryview(b).cast("B")
                if mv.nbytes:
                    # Zero-copy: obstore keeps a reference to the buffer until its
                    # part is uploaded (capabilities.retains_buffers), so callers do
                    # not recycle buffers they hand to an S3 writer.
                    self._w.write(mv)
                    offset += mv.nbytes
        except Exception as exc:
            raise _map_error(exc, f"uploading {self._where}") from exc
        self._pos = offset

    def finish(self) -> None:
        try:
            self._w.close()
        except Exception as exc:
            raise _map_error(exc, f"completing {self._where}") from exc

    def abort(self) -> None:
        pass  # an unfinished multipart upload is never visible


class _S3Txn:
    def __init__(self, owner: S3Storage, url: str, overwrite: bool, root: str | None) -> None:
        self._owner = owner
        self.location = url
        self._bucket, self._prefix = split_url(url)
        self._is_owner = root is None
        self._root = root or uuid.uuid4().hex
        self._overwrite = overwrite
        self._marker: bytes | None = None
        self._done = False

    @property
    def token(self) -> str:
        return self._root

    def _key(self, name: str) -> str:
        return f"{self._prefix}/{self._root}/{check_member_name(name)}"

    def create_file(self, name: str, size_hint: int) -> _S3FileWriter:
        return _S3FileWriter(self._owner, self._bucket, self._key(name))

    def write_bytes(self, name: str, data: bytes) -> None:
        if name == COMMIT_NAME:
            self._marker = data  # written by commit(), last
            return
        self._owner._put(self._bucket, self._key(name), data)

    def commit(self) -> None:
        if not self._is_owner:
            raise StorageError("only the process that began a write may commit it")
        if self._marker is None:
            raise StorageError("commit() before the commit marker was written")
        doc = json.loads(self._marker)
        doc["root"] = self._root
        marker = json.dumps(doc, separators=(",", ":")).encode()
        key = f"{self._prefix}/{COMMIT_NAME}"
        if not self._overwrite:
            # Create-only (a conditional PUT): of two writers racing to the same
            # path, exactly one commits; the other fails here and cleans up.
            if not self._owner._put_new(self._bucket, key, marker):
                self.abort()
                raise CheckpointExistsError(
                    f"{self.location} already holds a checkpoint; pass overwrite=True"
                )
            self._done = True
            return
        old = self._owner._live_root(self._bucket, self._prefix)
        self._owner._put(self._bucket, key, marker)
        self._done = True
        if old is not None and old != self._root:
            self._owner._delete_prefix(self._bucket, f"{self._prefix}/{old}/")

    def abort(self) -> None:
        if not self._done and self._is_owner:
            self._done = True
            try:
                self._owner._delete_prefix(self._bucket, f"{self._prefix}/{self._root}/")
            except CheckpointError:
                # abort runs while the save's own failure propagates: reporting the
                # cleanup's failure instead would hide it. The root is unreferenced
                # (nothing loads it); `delete` of the checkpoint removes it later.
                pass
        self._done = True


class _S3Reader:
    def __init__(self, owner: S3Storage, url: str) -> None:
        self._owner = owner
        self.location = url
        self._bucket, self._prefix = split_url(url)
        marker = owner._get_small(self._bucket, f"{self._prefix}/{COMMIT_NAME}",
                                  MAX_COMMIT_BYTES, missing_ok=True)
        if marker is None:
            owner.check_bucket(self._bucket)
            raise CheckpointNotFoundError(
                manager_steps_hint(owner, url)
                or f"no committed checkpoint at {url}: it has no {COMMIT_NAME} marker"
            )
        self._marker = marker
        try:
            root = json.loads(marker).get("root")
        except (ValueError, AttributeError):
            raise CheckpointCorruptError(f"commit marker of {url} is not valid JSON") from None
        if type(root) is not str or not _ROOT_RE.match(root):
            raise UnsafeCheckpointError(f"commit marker of {url} names an invalid root {root!r}")
        self._root = root
        self._sizes: dict[str, int] = {}
        self._lock = threading.Lock()

    def _key(self, name: str) -> str:
        if name != COMMIT_NAME and not name.startswith(DATA_DIR + "/") and "/" in name:
            raise UnsafeCheckpointError(f"refusing to read {name!r} outside the checkpoint")
        if name.startswith(DATA_DIR + "/"):
            validate_file_name(name)
        return f"{self._prefix}/{self._root}/{name}"

    def read_bytes(self, name: str, max_bytes: int) -> bytes:
        if name == COMMIT_NAME:
            return self._marker
        data = self._owner._get_small(self._bucket, self._key(name), max_bytes)
        assert data is not None
        return data

    def file_size(self, name: str) -> int:
        with self._lock:
            if name in self._sizes:
                return self._sizes[name]
        import obstore

        key = self._key(name)
        try:
            size = int(obstore.head(self._owner._store(self._bucket), key)["size"])
        except Exception as exc:
            err = _map_error(exc, f"s3://{self._bucket}/{key}")
            if isinstance(err, CheckpointNotFoundError):
                raise TruncatedFileError(
                    f"data object s3://{self._bucket}/{key} is missing; the checkpoint is "
                    "damaged"
                ) from None
            raise err from exc
        with self._lock:
            self._sizes[name] = size
        return size

    def read_into(self, name: str, offset: int, buffers: Sequence[Buffer]) -> None:
        import numpy as np
        import obstore

        views = [memoryview(b).cast("B") for b in buffers]
        total = sum(v.nbytes for v in views)
        if total == 0:
            return
        key = self._key(name)
        size = self.file_size(name)
        if offset + total > size:
            raise TruncatedFileError(
                f"data object s3://{self._bucket}/{key} has {size} bytes; the manifest needs "
                f"bytes up to {offset + total}; the checkpoint is truncated"
            )
        try:
            got = obstore.get_range(self._owner._store(self._bucket), key, start=offset,
                                    length=total)
        except Exception as exc:
            raise _map_error(exc, f"reading s3://{self._bucket}/{key}") from exc
        src = np.frombuffer(memoryview(got), dtype=np.uint8)
        if src.nbytes != total:
            raise TruncatedFileError(f"short read of s3://{self._bucket}/{key}")
        pos = 0
        for v in views:
            np.frombuffer(v, dtype=np.uint8)[...] = src[pos : pos + v.nbytes]
            pos += v.nbytes

    def list_files(self) -> list[str]:
        """Every object of the checkpoint, named like the local reader's entries.

        Objects under the committed root are named relative to it
        (``manifest.json``, ``data/<name>``); other objects under the
        checkpoint's prefix keep their name relative to it (``COMMITTED``,
        ``extra.bin``, ``sub/x``). Other roots (an overwritten version not yet
        deleted, a killed save's leftovers) belong to ``statestream gc``.
        """
        import obstore

        top = self._prefix + "/"
        out: list[str] = []
        try:
            for batch in obstore.list(self._owner._store(self._bucket), prefix=top):
                for m in batch:
                    rel = m["path"][len(top):]
                    first, sep, rest = rel.partition("/")
                    if first == self._root and sep:
                        out.append(rest)
                    elif not (sep and _ROOT_RE.match(first)):
                        out.append(rel)
        except Exception as exc:
            raise _map_error(exc, f"listing {self.location}") from exc
        return out

    def close(self) -> None:
        pass


#: Last-Modified has a resolution of one second; a lease is expired only past this slack.
_LEASE_SLACK_S = 2.0


def _parse_lease(data: bytes, default_ttl: float) -> tuple[str, float]:
    """(holder, ttl_s) of a lease object; a plain-text lock of older versions has ours."""
    try:
        doc = json.loads(data)
        return str(doc["holder"])[:200], float(doc["ttl_s"])
    except (ValueError, KeyError, TypeError):
        return data.decode(errors="replace")[:200] or "an unknown holder", default_ttl


class _S3Lease:
    """A lease object, renewed by a conditional PUT on the ETag we last wrote."""

    def __init__(self, owner: S3Storage, bucket: str, key: str, holder: str, ttl_s: float,
                 body: bytes, etag: str) -> None:
        self._owner, self._bucket, self._key = owner, bucket, key
        self.holder = holder
        self.ttl_s: float | None = ttl_s
        self._body = body
        self._etag = etag

    def renew(self) -> None:
        etag = self._owner._put_if(self._bucket, self._key, self._body, {"e_tag": self._etag})
        if etag is None:
            raise ManagerLockedError(
                f"s3://{self._bucket}/{self._key} expired and was taken over by another holder"
            )
        self._etag = etag

    def release(self) -> None:
        import obstore

        st = self._owner._store(self._bucket)
        try:
            if obstore.head(st, self._key)["e_tag"] == self._etag:  # still ours
                obstore.delete(st, self._key)
        except Exception:
            pass  # best effort: a lease not released expires after its ttl_s anyway


class S3Storage:
    """Checkpoints in an S3-compatible object store (AWS S3, MinIO, ...).

    Example:
        >>> "secret" in repr(S3Storage(S3Options(secret_access_key="secret")))
        False
    """

    # Measured on a local S3-compatible server: 256 MiB GETs with 8 readers
    # loaded ~3x faster than 32 MiB with 4 (benchmarks/results/s3-*).
    capabilities = StorageCapabilities(atomic_rename=False, random_write=False,
                                       read_request_bytes=256 << 20, read_threads=8,
                                       retains_buffers=True)

    def __init__(self, options: S3Options | None = None) -> None:
        self.options = options or S3Options()
        self._stores: dict[str, tuple[tuple[Any, ...], Any]] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"S3Storage({self.options!r})"

    def _store(self, bucket: str) -> Any:
        """The client for ``bucket``, rebuilt whenever its configuration changed."""
        key = _config_key(self.options)
        with self._lock:
            cached = self._stores.get(bucket)
            if cached is None or cached[0] != key:
                cached = self._stores[bucket] = (key, self._new_store(bucket))
            return cached[1]

    def _new_store(self, bucket: str) -> Any:
        from obstore.store import S3Store

        o = self.options
        kw: dict[str, Any] = {name: getattr(o, name) for name in (
            "endpoint", "region", "access_key_id", "secret_access_key", "session_token")
            if getattr(o, name)}
        client = _env_client_options()
        client["timeout"] = datetime.timedelta(seconds=o.timeout_s)
        client["connect_timeout"] = datetime.timedelta(seconds=o.connect_timeout_s)
        if o.allow_http or (o.endpoint or "").startswith("http://"):
            client["allow_http"] = True
        retry: dict[str, Any] = {
            "max_retries": o.max_retries,
            "retry_timeout": datetime.timedelta(seconds=o.retry_timeout_s),
        }
        try:
            return S3Store(bucket, client_options=client,  # type: ignore[arg-type]
                           retry_config=retry, **kw)  # type: ignore[arg-type]
        except Exception as exc:
            raise _map_error(exc, f"configuring access to s3://{bucket}") from exc

    def _put(self, bucket: str, key: str, data: bytes) -> None:
        import obstore

        try:
            obstore.put(self._store(bucket), key, data)
        except Exception as exc:
            raise _map_error(exc, f"writing s3://{bucket}/{key}") from exc

    def _put_new(self, bucket: str, key: str, data: bytes) -> bool:
        """Create ``key`` only if absent; False when it already exists."""
        return self._put_if(bucket, key, data, "create") is not None

    def _get_small(self, bucket: str, key: str, max_bytes: int, missing_ok: bool = False
                   ) -> bytes | None:
        import obstore

        try:
            meta = obstore.head(self._store(bucket), key)
            if int(meta["size"]) > max_bytes:
                raise CheckpointCorruptError(
                    f"s3://{bucket}/{key} is {meta['size']} bytes, over the {max_bytes}-byte "
                    "limit"
                )
            return bytes(obstore.get(self._store(bucket), key).bytes())
        except CheckpointCorruptError:
            raise
        except Exception as exc:
            err = _map_error(exc, f"reading s3://{bucket}/{key}")
            if isinstance(err, CheckpointNotFoundError):
                if missing_ok:
                    return None
                raise CheckpointCorruptError(
                    f"s3://{bucket}/{key} is missing; the checkpoint is damaged"
                ) from None
            raise err from exc

    def check_bucket(self, bucket: str) -> None:
        """Raise a clear StorageError if the bucket is missing or not accessible."""
        import obstore

        try:
            stream = obstore.list(self._store(bucket), prefix="statestream-probe/",
                                  chunk_size=1)
            next(iter(stream), None)
        except Exception as exc:
            text = str(exc).lower()
            # a status of 404, not "404" inside a port or request id of the message
            if "nosuchbucket" in text.replace(" ", "") or re.search(r"\b404\b", text):
                raise StorageError(
                    f"s3://{bucket} does not exist (or is not visible with these credentials)"
                ) from None
            raise _map_error(exc, f"accessing s3://{bucket}") from exc

    def _live_root(self, bucket: str, prefix: str) -> str | None:
        data = self._get_small(bucket, f"{prefix}/{COMMIT_NAME}", MAX_COMMIT_BYTES,
                               missing_ok=True)
        if data is None:
            return None
        try:
            root = json.loads(data).get("root")
        except (ValueError, AttributeError):
            return None
        return root if isinstance(root, str) and _ROOT_RE.match(root) else None

    def _delete_prefix(self, bucket: str, prefix: str) -> None:
        import obstore

        st = self._store(bucket)
        try:
            paths = [m["path"] for batch in obstore.list(st, prefix=prefix) for m in batch]
            if paths:
                obstore.delete(st, paths)
        except Exception as exc:
            raise _map_error(exc, f"deleting s3://{bucket}/{prefix}") from exc

    # -- leases --------------------------------------------------------------------
    def _put_if(self, bucket: str, key: str, data: bytes, mode: Any) -> str | None:
        """Conditional PUT (``"create"`` or ``{"e_tag": ...}``); its ETag, None if refused."""
        import obstore

        try:
            res = obstore.put(self._store(bucket), key, data, mode=mode)
        except Exception as exc:
            if type(exc).__name__ in ("AlreadyExistsError", "PreconditionError", "FileExistsError"):
                return None
            raise _map_error(exc, f"writing s3://{bucket}/{key}") from exc
        return str(res["e_tag"])

    def acquire_lease(self, path: str, *, holder: str, ttl_s: float) -> _S3Lease:
        """The lease object ``path``: created if absent, taken over once expired.

        Expiry compares the object's Last-Modified (the store's clock) with this
        host's clock, so clocks must agree to within a few seconds.
        """
        bucket, key = split_url(path)
        body = json.dumps({"holder": holder, "ttl_s": ttl_s}).encode()
        for _ in range(3):
            etag = self._put_if(bucket, key, body, "create")
            if etag is None:
                etag = self._take_expired(bucket, key, body, ttl_s)
            if etag is not None:
                return _S3Lease(self, bucket, key, holder, ttl_s, body, etag)
        raise ManagerLockedError(f"{path} is contended: it changed hands while being taken")

    def _take_expired(self, bucket: str, key: str, body: bytes, ttl_s: float) -> str | None:
        """Take the existing lease ``key`` over if it expired; None if it vanished meanwhile."""
        import obstore

        try:
            meta = obstore.head(self._store(bucket), key)
            held = bytes(obstore.get(self._store(bucket), key).bytes())[:4096]
        except Exception as exc:
            err = _map_error(exc, f"reading s3://{bucket}/{key}")
            if isinstance(err, CheckpointNotFoundError):
                return None  # released meanwhile: try to create it again
            raise err from exc
        holder, held_ttl = _parse_lease(held, ttl_s)
        age = time.time() - meta["last_modified"].timestamp()
        if age <= held_ttl + _LEASE_SLACK_S:
            raise ManagerLockedError(
                f"s3://{bucket}/{key} is held by {holder}, renewed {max(age, 0):.0f} s ago "
                f"(lease of {held_ttl:g} s)"
            )
        return self._put_if(bucket, key, body, {"e_tag": meta["e_tag"]})

    def leftovers(self, parent: str) -> builtins.list[Leftover]:
        """Roots of the checkpoints directly under ``parent`` that no marker names.

        Root names cannot record a writer (readers accept 32 hex digits only),
        so every leftover here has an unverifiable writer: removed after the
        age limit, or by the lease holder of ``parent``. An unfinished multipart
        upload is invisible until it completes (see docs/storage.md).
        """
        import obstore

        bucket, prefix = split_url(parent)
        roots: dict[tuple[str, str], float] = {}
        try:
            for batch in obstore.list(self._store(bucket), prefix=prefix + "/"):
                for m in batch:
                    parts = m["path"][len(prefix) + 1 :].split("/")
                    if len(parts) >= 3 and _ROOT_RE.match(parts[1]):
                        when = m["last_modified"].timestamp()
                        roots[parts[0], parts[1]] = max(roots.get((parts[0], parts[1]), 0), when)
        except Exception as exc:
            raise _map_error(exc, f"listing {parent}") from exc
        live = {name: self._live_root(bucket, f"{prefix}/{name}") for name, _ in roots}
        return [Leftover(f"s3://{bucket}/{prefix}/{name}/{root}", name, None, when)
                for (name, root), when in sorted(roots.items()) if live[name] != root]

    def remove_leftover(self, leftover: Leftover) -> None:
        bucket, key = split_url(leftover.path)
        checkpoint, _, root = key.rpartition("/")
        if not _ROOT_RE.match(root) or not checkpoint:
            raise StorageError(f"{leftover.path} is not the root of a checkpoint; not removing it")
        if self._live_root(bucket, checkpoint) == root:
            raise StorageError(f"{leftover.path} was committed meanwhile; not removing it")
        self._delete_prefix(bucket, key + "/")

    # -- Storage protocol ------------------------------------------------------------
    def begin_write(self, path: str, *, overwrite: bool) -> _S3Txn:
        bucket, prefix = split_url(path)
        self.check_bucket(bucket)
        if not overwrite and self._live_root(bucket, prefix) is not None:
            raise CheckpointExistsError(
                f"{path} already holds a checkpoint; pass overwrite=True to replace it "
                "atomically or choose another path"
            )
        return _S3Txn(self, path, overwrite, None)

    def join_write(self, path: str, token: str) -> _S3Txn:
        if not _ROOT_RE.match(token):
            raise StorageError(f"cannot join write of {path}: bad token")
        return _S3Txn(self, path, False, token)

    def open_read(self, path: str) -> _S3Reader:
        return _S3Reader(self, path)

    def is_committed(self, path: str) -> bool:
        bucket, prefix = split_url(path)
        return self._live_root(bucket, prefix) is not None

    def list(self, path: str) -> list[str]:
        import obstore

        bucket, prefix = split_url(path)
        try:
            res = obstore.list_with_delimiter(self._store(bucket), prefix=prefix + "/")
        except Exception as exc:
            raise _map_error(exc, f"listing {path}") from exc
        names = [p.rstrip("/").rsplit("/", 1)[-1] for p in res["common_prefixes"]]
        names += [m["path"].rsplit("/", 1)[-1] for m in res["objects"]]
        return sorted(names)

    def delete(self, path: str) -> None:
        import obstore

        bucket, prefix = split_url(path)
        st = self._store(bucket)
        try:  # uncommit first: a half-deleted checkpoint never loads
            obstore.delete(st, f"{prefix}/{COMMIT_NAME}")
        except Exception as exc:  # only "already gone" may pass; else data would go first
            err = _map_error(exc, f"uncommitting {path}")
            if not isinstance(err, CheckpointNotFoundError):
                raise err from exc
        self._delete_prefix(bucket, prefix + "/")
