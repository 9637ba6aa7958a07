"""Object stores through ``obstore``: commit by writing a marker last.

Shared by the S3, GCS and Azure backends, which only say how to build a
client and how to name their URLs. Layout of ``<scheme>://bucket/prefix``::

    prefix/COMMITTED                 the commit marker; names the live root
    prefix/<root>/manifest.json      the manifest of that save
    prefix/<root>/data/r<R>-<N>.bin  its data objects (multipart uploads)

Each save writes under a fresh random ``<root>``; the single PUT of
``COMMITTED`` makes it visible (old or new, never a mix), then the previous
root is deleted. An interrupted save leaves only an unreferenced root,
which nothing loads. Credentials are never put in messages or reprs.
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
from typing import Any, ClassVar

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

__all__ = ["ObjectStorage", "TransferOptions", "redact", "split_object_url"]

_ROOT_RE = re.compile(r"^[0-9a-f]{32}$")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransferOptions:
    """How objects move: part size, concurrency, timeouts, retries (GCS and Azure options)."""

    allow_http: bool = False
    part_bytes: int = 16 << 20
    max_concurrency: int = 8
    timeout_s: float = 120.0
    connect_timeout_s: float = 10.0
    max_retries: int = 5
    retry_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        check_transfer_options(self)


def check_transfer_options(options: Any) -> None:
    """Refuse timeouts that are not positive and negative retry counts."""
    cls = type(options).__name__
    for name in ("timeout_s", "connect_timeout_s", "retry_timeout_s"):
        if not getattr(options, name) > 0:
            raise StorageError(f"{cls}.{name} must be > 0, got {getattr(options, name)!r}")
    if options.max_retries < 0:
        raise StorageError(f"{cls}.max_retries must be >= 0, got {options.max_retries}")


def split_object_url(url: str, scheme: str, word: str = "bucket") -> tuple[str, str]:
    """``s3://bucket/a/b`` -> (``bucket``, ``a/b``); ``word`` names the bucket in messages."""
    head = f"{scheme}://"
    if not url.startswith(head):
        raise StorageError(f"not an {head} URL: {url!r}")
    rest = url[len(head):]
    bucket, _, prefix = rest.partition("/")
    prefix = prefix.strip("/")
    if len(bucket) < 3 or not prefix:
        raise StorageError(
            f"{url!r} must look like {head}{word}/prefix ({word} names have 3+ characters)"
        )
    if any(part in ("", ".", "..") for part in prefix.split("/")):
        raise StorageError(f"{url!r} has an empty, '.' or '..' path segment")
    return bucket, prefix


#: Query parameters that carry secrets (an Azure SAS ``sig``, signed-URL signatures, tokens).
_SECRET_QUERY = re.compile(r"(?i)([?&][\w.-]*(?:sig|signature|token|credential|key)[\w.-]*=)"
                           r"[^&\s\"']*")


def redact(text: str) -> str:
    """``text`` with secret-looking words and query parameters replaced by ``<hidden>``."""
    text = _SECRET_QUERY.sub(r"\1<hidden>", text)
    return re.sub(r"(?i)(secret|signature|credential|token)[^ ,;]*", r"\1=<hidden>", text)


#: Client options obstore reads from ``<PREFIX><NAME>`` only when given none explicitly.
_ENV_CLIENT_BOOLS = ("allow_http", "allow_invalid_certificates", "http1_only", "http2_only")
_ENV_CLIENT_STRINGS = ("proxy_url", "proxy_ca_certificate", "proxy_excludes", "user_agent")


def env_client_options(prefix: str) -> dict[str, Any]:
    """``AWS_ALLOW_HTTP`` & co.: passing client options (for the timeouts) makes obstore
    ignore these variables, so they are read here."""
    out: dict[str, Any] = {}
    for name in _ENV_CLIENT_BOOLS:
        value = os.environ.get(f"{prefix}{name.upper()}")
        if value is not None:
            out[name] = value.strip().lower() == "true"
    for name in _ENV_CLIENT_STRINGS:
        value = os.environ.get(f"{prefix}{name.upper()}")
        if value:
            out[name] = value
    return out


def client_and_retry(options: Any, env_prefix: str, endpoint: str | None
                     ) -> tuple[dict[str, Any], dict[str, Any]]:
    """obstore's ``client_options`` and ``retry_config`` from transfer options."""
    client = env_client_options(env_prefix)
    client["timeout"] = datetime.timedelta(seconds=options.timeout_s)
    client["connect_timeout"] = datetime.timedelta(seconds=options.connect_timeout_s)
    if options.allow_http or (endpoint or "").startswith("http://"):
        client["allow_http"] = True
    retry: dict[str, Any] = {
        "max_retries": options.max_retries,
        "retry_timeout": datetime.timedelta(seconds=options.retry_timeout_s),
    }
    return client, retry


def _version_of(meta: Any) -> dict[str, str]:
    """The precondition of a conditional PUT on the object ``meta`` describes.

    S3 and Azure match the ETag; GCS matches the generation (``version``).
    """
    out = {"e_tag": str(meta["e_tag"])}
    if meta.get("version") is not None:
        out["version"] = str(meta["version"])
    return out


class _ObjectFileWriter:
    def __init__(self, owner: ObjectStorage, bucket: str, key: str) -> None:
        import obstore

        self._where = owner._url(bucket, key)
        self._owner = owner
        try:
            self._w = obstore.open_writer(owner._store(bucket), key,
                                          buffer_size=owner.options.part_bytes,
                                          max_concurrency=owner.options.max_concurrency)
        except Exception as exc:
            raise owner._map_error(exc, f"opening {self._where}") from exc
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
                    # not recycle buffers they hand to an object-store writer.
                    self._w.write(mv)
                    offset += mv.nbytes
        except Exception as exc:
            raise self._owner._map_error(exc, f"uploading {self._where}") from exc
        self._pos = offset

    def finish(self) -> None:
        try:
            self._w.close()
        except Exception as exc:
            raise self._owner._map_error(exc, f"completing {self._where}") from exc

    def abort(self) -> None:
        pass  # an unfinished multipart upload is never visible


class _ObjectTxn:
    def __init__(self, owner: ObjectStorage, url: str, overwrite: bool, root: str | None) -> None:
        self._owner = owner
        self.location = url
        self._bucket, self._prefix = owner.split_url(url)
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

    def create_file(self, name: str, size_hint: int) -> _ObjectFileWriter:
        return _ObjectFileWriter(self._owner, self._bucket, self._key(name))

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


class _ObjectReader:
    def __init__(self, owner: ObjectStorage, url: str) -> None:
        self._owner = owner
        self.location = url
        self._bucket, self._prefix = owner.split_url(url)
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
        where = self._owner._url(self._bucket, key)
        try:
            size = int(obstore.head(self._owner._store(self._bucket), key)["size"])
        except Exception as exc:
            err = self._owner._map_error(exc, where)
            if isinstance(err, CheckpointNotFoundError):
                raise TruncatedFileError(
                    f"data object {where} is missing; the checkpoint is damaged"
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
        where = self._owner._url(self._bucket, key)
        size = self.file_size(name)
        if offset + total > size:
            raise TruncatedFileError(
                f"data object {where} has {size} bytes; the manifest needs "
                f"bytes up to {offset + total}; the checkpoint is truncated"
            )
        try:
            got = obstore.get_range(self._owner._store(self._bucket), key, start=offset,
                                    length=total)
        except Exception as exc:
            raise self._owner._map_error(exc, f"reading {where}") from exc
        src = np.frombuffer(memoryview(got), dtype=np.uint8)
        if src.nbytes != total:
            raise TruncatedFileError(f"short read of {where}")
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
            raise self._owner._map_error(exc, f"listing {self.location}") from exc
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


class _ObjectLease:
    """A lease object, renewed by a conditional PUT on the version we last wrote."""

    def __init__(self, owner: ObjectStorage, bucket: str, key: str, holder: str, ttl_s: float,
                 body: bytes, version: dict[str, str]) -> None:
        self._owner, self._bucket, self._key = owner, bucket, key
        self.holder = holder
        self.ttl_s: float | None = ttl_s
        self._body = body
        self._version = version

    def renew(self) -> None:
        version = self._owner._put_if(self._bucket, self._key, self._body, self._version)
        if version is None:
            raise ManagerLockedError(
                f"{self._owner._url(self._bucket, self._key)} expired and was taken over by "
                "another holder"
            )
        self._version = version

    def release(self) -> None:
        import obstore

        st = self._owner._store(self._bucket)
        try:
            if _version_of(obstore.head(st, self._key)) == self._version:  # still ours
                obstore.delete(st, self._key)
        except Exception:
            pass  # best effort: a lease not released expires after its ttl_s anyway


class ObjectStorage:
    """The Storage protocol on an object store reached through obstore.

    A subclass names its URL scheme and builds the client (``_new_store``);
    everything else (commit protocol, leases, leftovers) is shared.
    """

    #: URL scheme (``s3``), the word for a bucket in messages, and the prefixes of the
    #: environment variables the client reads (a change rebuilds the client).
    scheme: ClassVar[str] = ""
    bucket_word: ClassVar[str] = "bucket"
    env_prefixes: ClassVar[tuple[str, ...]] = ()
    #: What to do when no credentials were found, and which options bound the time.
    credentials_hint: ClassVar[str] = ""
    timeout_hint: ClassVar[str] = ""
    #: Error codes (lower case, spaces removed) that mean the bucket does not exist.
    missing_bucket_codes: ClassVar[tuple[str, ...]] = ("nosuchbucket",)

    # Measured on a local S3-compatible server: 256 MiB GETs with 8 readers
    # loaded ~3x faster than 32 MiB with 4 (benchmarks/results/s3-*).
    capabilities = StorageCapabilities(atomic_rename=False, random_write=False,
                                       read_request_bytes=256 << 20, read_threads=8,
                                       retains_buffers=True)

    def __init__(self, options: Any) -> None:
        self.options = options
        self._stores: dict[str, tuple[tuple[Any, ...], Any]] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.options!r})"

    # -- what a subclass provides --------------------------------------------------
    def _new_store(self, bucket: str) -> Any:
        raise NotImplementedError

    def split_url(self, url: str) -> tuple[str, str]:
        """``<scheme>://bucket/a/b`` -> (``bucket``, ``a/b``)."""
        return split_object_url(url, self.scheme, self.bucket_word)

    def _url(self, bucket: str, key: str = "") -> str:
        return f"{self.scheme}://{bucket}/{key}" if key else f"{self.scheme}://{bucket}"

    def _map_error(self, exc: BaseException, what: str) -> BaseException:
        """Turn a client error into a statestream error without leaking credentials."""
        from obstore import exceptions as oe

        name = type(exc).__name__
        first = str(exc).splitlines()[0] if str(exc) else name
        first = redact(first)
        squashed = first.lower().replace(" ", "")
        word = self.bucket_word
        if any(code in squashed for code in self.missing_bucket_codes):
            return StorageError(f"{what}: the {word} does not exist")
        if isinstance(exc, (oe.NotFoundError, FileNotFoundError)):
            return CheckpointNotFoundError(f"{what}: not found")
        denied = (f"{what}: access denied (403); check the credentials and the {word} "
                  "policy")
        if isinstance(exc, (oe.PermissionDeniedError, PermissionError)):
            return storage_error(denied, errno.EACCES)
        if isinstance(exc, oe.UnauthenticatedError):
            return StorageError(f"{what}: not authenticated; {self.credentials_hint}")
        text = first.lower()
        if "403" in text or "forbidden" in text or "accessdenied" in text:
            return storage_error(denied, errno.EACCES)
        if "kind: Timeout" in str(exc) or "TimedOut" in str(exc):  # obstore's error chain
            return storage_error(f"{what} timed out ({self.timeout_hint}): "
                                 f"{name}: {first[:300]}", errno.ETIMEDOUT)
        if "credential" in text or "signature" in text:
            return StorageError(f"{what}: credentials missing or invalid")
        return StorageError(f"{what} failed: {name}: {first[:300]}")

    def _config_key(self) -> tuple[Any, ...]:
        """What a client is built from: the options and every variable it reads.

        Values are hashed so that the key holds no secret in clear.
        """
        env = tuple(sorted((k, hashlib.sha256(v.encode()).hexdigest())
                           for k, v in os.environ.items() if k.startswith(self.env_prefixes)))
        return (self.options, env)

    def _store(self, bucket: str) -> Any:
        """The client for ``bucket``, rebuilt whenever its configuration changed."""
        key = self._config_key()
        with self._lock:
            cached = self._stores.get(bucket)
            if cached is None or cached[0] != key:
                cached = self._stores[bucket] = (key, self._new_store(bucket))
            return cached[1]

    # -- object primitives ----------------------------------------------------------
    def _put(self, bucket: str, key: str, data: bytes) -> None:
        import obstore

        try:
            obstore.put(self._store(bucket), key, data)
        except Exception as exc:
            raise self._map_error(exc, f"writing {self._url(bucket, key)}") from exc

    def _put_new(self, bucket: str, key: str, data: bytes) -> bool:
        """Create ``key`` only if absent; False when it already exists."""
        return self._put_if(bucket, key, data, "create") is not None

    def _get_small(self, bucket: str, key: str, max_bytes: int, missing_ok: bool = False
                   ) -> bytes | None:
        import obstore

        where = self._url(bucket, key)
        try:
            meta = obstore.head(self._store(bucket), key)
            if int(meta["size"]) > max_bytes:
                raise CheckpointCorruptError(
                    f"{where} is {meta['size']} bytes, over the {max_bytes}-byte limit"
                )
            return bytes(obstore.get(self._store(bucket), key).bytes())
        except CheckpointCorruptError:
            raise
        except Exception as exc:
            err = self._map_error(exc, f"reading {where}")
            if isinstance(err, CheckpointNotFoundError):
                if missing_ok:
                    return None
                raise CheckpointCorruptError(
                    f"{where} is missing; the checkpoint is damaged"
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
            squashed = text.replace(" ", "")
            # a status of 404, not "404" inside a port or request id of the message
            if (any(code in squashed for code in self.missing_bucket_codes)
                    or re.search(r"\b404\b", text)):
                raise StorageError(
                    f"{self._url(bucket)} does not exist (or is not visible with these "
                    "credentials)"
                ) from None
            raise self._map_error(exc, f"accessing {self._url(bucket)}") from exc

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
            err = self._map_error(exc, f"deleting {self._url(bucket, prefix)}")
            if isinstance(err, CheckpointNotFoundError):
                return  # deleted meanwhile (Azure reports a vanished blob; S3 does not)
            raise err from exc

    # -- leases --------------------------------------------------------------------
    def _put_if(self, bucket: str, key: str, data: bytes, mode: Any) -> dict[str, str] | None:
        """Conditional PUT (``"create"`` or a version); the new version, None if refused."""
        import obstore

        try:
            res = obstore.put(self._store(bucket), key, data, mode=mode)
        except Exception as exc:
            if type(exc).__name__ in ("AlreadyExistsError", "PreconditionError", "FileExistsError"):
                return None
            raise self._map_error(exc, f"writing {self._url(bucket, key)}") from exc
        return _version_of(res)

    def acquire_lease(self, path: str, *, holder: str, ttl_s: float) -> _ObjectLease:
        """The lease object ``path``: created if absent, taken over once expired.

        Expiry compares the object's Last-Modified (the store's clock) with this
        host's clock, so clocks must agree to within a few seconds.
        """
        bucket, key = self.split_url(path)
        body = json.dumps({"holder": holder, "ttl_s": ttl_s}).encode()
        for _ in range(3):
            version = self._put_if(bucket, key, body, "create")
            if version is None:
                version = self._take_expired(bucket, key, body, ttl_s)
            if version is not None:
                return _ObjectLease(self, bucket, key, holder, ttl_s, body, version)
        raise ManagerLockedError(f"{path} is contended: it changed hands while being taken")

    def _take_expired(self, bucket: str, key: str, body: bytes, ttl_s: float
                      ) -> dict[str, str] | None:
        """Take the existing lease ``key`` over if it expired; None if it vanished meanwhile."""
        import obstore

        where = self._url(bucket, key)
        try:
            meta = obstore.head(self._store(bucket), key)
            held = bytes(obstore.get(self._store(bucket), key).bytes())[:4096]
        except Exception as exc:
            err = self._map_error(exc, f"reading {where}")
            if isinstance(err, CheckpointNotFoundError):
                return None  # released meanwhile: try to create it again
            raise err from exc
        holder, held_ttl = _parse_lease(held, ttl_s)
        age = time.time() - meta["last_modified"].timestamp()
        if age <= held_ttl + _LEASE_SLACK_S:
            raise ManagerLockedError(
                f"{where} is held by {holder}, renewed {max(age, 0):.0f} s ago "
                f"(lease of {held_ttl:g} s)"
            )
        return self._put_if(bucket, key, body, _version_of(meta))

    def leftovers(self, parent: str) -> builtins.list[Leftover]:
        """Roots of the checkpoints directly under ``parent`` that no marker names.

        Root names cannot record a writer (readers accept 32 hex digits only),
        so every leftover here has an unverifiable writer: removed after the
        age limit, or by the lease holder of ``parent``. An unfinished multipart
        upload is invisible until it completes (see docs/storage.md).
        """
        import obstore

        bucket, prefix = self.split_url(parent)
        roots: dict[tuple[str, str], float] = {}
        try:
            for batch in obstore.list(self._store(bucket), prefix=prefix + "/"):
                for m in batch:
                    parts = m["path"][len(prefix) + 1 :].split("/")
                    if len(parts) >= 3 and _ROOT_RE.match(parts[1]):
                        when = m["last_modified"].timestamp()
                        roots[parts[0], parts[1]] = max(roots.get((parts[0], parts[1]), 0), when)
        except Exception as exc:
            raise self._map_error(exc, f"listing {parent}") from exc
        live = {name: self._live_root(bucket, f"{prefix}/{name}") for name, _ in roots}
        return [Leftover(self._url(bucket, f"{prefix}/{name}/{root}"), name, None, when)
                for (name, root), when in sorted(roots.items()) if live[name] != root]

    def remove_leftover(self, leftover: Leftover) -> None:
        bucket, key = self.split_url(leftover.path)
        checkpoint, _, root = key.rpartition("/")
        if not _ROOT_RE.match(root) or not checkpoint:
            raise StorageError(f"{leftover.path} is not the root of a checkpoint; not removing it")
        if self._live_root(bucket, checkpoint) == root:
            raise StorageError(f"{leftover.path} was committed meanwhile; not removing it")
        self._delete_prefix(bucket, key + "/")

    # -- Storage protocol ------------------------------------------------------------
    def begin_write(self, path: str, *, overwrite: bool) -> _ObjectTxn:
        bucket, prefix = self.split_url(path)
        self.check_bucket(bucket)
        if not overwrite and self._live_root(bucket, prefix) is not None:
            raise CheckpointExistsError(
                f"{path} already holds a checkpoint; pass overwrite=True to replace it "
                "atomically or choose another path"
            )
        return _ObjectTxn(self, path, overwrite, None)

    def join_write(self, path: str, token: str) -> _ObjectTxn:
        if not _ROOT_RE.match(token):
            raise StorageError(f"cannot join write of {path}: bad token")
        return _ObjectTxn(self, path, False, token)

    def open_read(self, path: str) -> _ObjectReader:
        return _ObjectReader(self, path)

    def is_committed(self, path: str) -> bool:
        bucket, prefix = self.split_url(path)
        return self._live_root(bucket, prefix) is not None

    def list(self, path: str) -> builtins.list[str]:
        import obstore

        bucket, prefix = self.split_url(path)
        try:
            res = obstore.list_with_delimiter(self._store(bucket), prefix=prefix + "/")
        except Exception as exc:
            raise self._map_error(exc, f"listing {path}") from exc
        names = [p.rstrip("/").rsplit("/", 1)[-1] for p in res["common_prefixes"]]
        names += [m["path"].rsplit("/", 1)[-1] for m in res["objects"]]
        return sorted(names)

    def delete(self, path: str) -> None:
        import obstore

        bucket, prefix = self.split_url(path)
        st = self._store(bucket)
        try:  # uncommit first: a half-deleted checkpoint never loads
            obstore.delete(st, f"{prefix}/{COMMIT_NAME}")
        except Exception as exc:  # only "already gone" may pass; else data would go first
            err = self._map_error(exc, f"uncommitting {path}")
            if not isinstance(err, CheckpointNotFoundError):
                raise err from exc
        self._delete_prefix(bucket, prefix + "/")
