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

This module holds the backend (``ObjectStorage``); the transaction and its
writers live in ``_object_write``, the reader in ``_object_read``, leases in
``_object_lease``, URLs and client options in ``_object_config``.
"""

from __future__ import annotations

import builtins
import dataclasses
import errno
import hashlib
import json
import logging
import os
import re
import threading
import uuid
from typing import Any, ClassVar

from statestream import _hooks
from statestream.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    ManagerLockedError,
    StorageError,
    storage_error,
)
from statestream.format import COMMIT_NAME, MAX_COMMIT_BYTES
from statestream.storage._base import Leftover, LeftoverKeptError, StorageCapabilities
from statestream.storage._object_config import (
    DAMAGED_MARKER,
    DELETING_NAME,
    ROOT_RE,
    TransferOptions,
    check_transfer_options,
    client_and_retry,
    redact,
    split_object_url,
    version_of,
)
from statestream.storage._object_errors import (
    ATTEMPTS,
    DENIED,
    UNIT_S,
    credentials_refused,
    scrub,
)
from statestream.storage._object_fork import check as fork_check
from statestream.storage._object_fork import mark as fork_mark
from statestream.storage._object_lease import LEASE_SLACK_S, ObjectLease, parse_lease
from statestream.storage._object_list import (
    child_names,
    listed,
    odd_key,
    odd_reason,
    saved_kind,
    saved_roots,
    shown_key,
)
from statestream.storage._object_pages import pages
from statestream.storage._object_read import ObjectReader
from statestream.storage._object_write import ObjectFileWriter, ObjectTxn

#: The most of a lease object that is read: a lease is a few hundred bytes of JSON; a
#: larger object at its key is someone else's, and its body is not read.
_MAX_LEASE_BYTES = 4096

__all__ = ["ObjectStorage", "TransferOptions", "check_transfer_options", "client_and_retry",
           "redact", "split_object_url"]



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
    #: Error codes that mean the bucket does not exist, as the store's error document
    #: gives them (lower case, spaces removed): in their element, as the bare word may
    #: be in the key the message names (a prefix ``runs/NoSuchBucket-ablation/``)
    missing_bucket_codes: ClassVar[tuple[str, ...]] = ("<code>nosuchbucket</code>",)
    #: The permission a listing needs, named when the store refuses one.
    list_permission: ClassVar[str] = "permission to list the bucket's objects"

    # Measured on a local S3-compatible server: 256 MiB GETs with 8 readers
    # loaded ~3x faster than 32 MiB with 4 (benchmarks/results/s3-*).
    capabilities = StorageCapabilities(atomic_rename=False, random_write=False,
                                       read_request_bytes=256 << 20, read_threads=8)

    def __init__(self, options: Any) -> None:
        self.options = options
        self.capabilities = dataclasses.replace(
            type(self).capabilities,
            writer_buffer_bytes=ObjectFileWriter.OWN_PARTS * int(options.part_bytes))
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

        if isinstance(exc, CheckpointError):
            return exc  # mapped already (building the client): wrapping it repeats it
        name = type(exc).__name__
        first = str(exc).splitlines()[0] if str(exc) else name
        first = redact(first)
        # the store's error code may sit in the response body, lines below the first
        # (a PUT to a missing bucket: "<Code>NoSuchBucket</Code>"); codes are looked
        # for without the URLs, addresses and durations ("127.0.0.1:40371" is no 403)
        squashed = scrub(redact(str(exc))).lower().replace(" ", "")
        word = self.bucket_word
        if any(code in squashed for code in self.missing_bucket_codes):
            named = re.search(rf"\b{re.escape(self.scheme)}://[^/\s]+", what)
            bucket = f"{word} {named.group(0)}" if named else word
            return StorageError(f"{what}: the {bucket} does not exist")
        if isinstance(exc, (oe.NotFoundError, FileNotFoundError)):
            return CheckpointNotFoundError(f"{what}: not found")
        refused = credentials_refused(exc)
        denied = (f"{what}: access denied (403); the store did not accept the credentials "
                  f"({refused}): {self.credentials_hint}" if refused else
                  f"{what}: access denied (403); check the credentials and the {word} policy")
        if isinstance(exc, (oe.PermissionDeniedError, PermissionError)):
            return storage_error(denied, errno.EACCES)
        if isinstance(exc, oe.UnauthenticatedError):
            return StorageError(f"{what}: not authenticated; {self.credentials_hint}")
        text = scrub(first).lower()
        if DENIED.search(text):
            return storage_error(denied, errno.EACCES)
        if ("kind: Timeout" in str(exc) or "TimedOut" in str(exc)  # obstore's error chain
                or self._attempts_timed_out(str(exc))):
            return storage_error(f"{what} timed out ({self.timeout_hint}): "
                                 f"{name}: {first[:300]}", errno.ETIMEDOUT)
        if "credential" in text or "signature" in text:
            return StorageError(f"{what}: credentials missing or invalid")
        return StorageError(f"{what} failed: {name}: {first[:300]}")

    def _attempts_timed_out(self, text: str) -> bool:
        """Whether a request's attempts all ran into the client's time limits, by its
        message alone: obstore's writer (open_writer) raises a plain OSError with the
        first line of the error, without the chain that says "kind: Timeout"."""
        m = ATTEMPTS.search(text)
        if m is None:
            return False
        elapsed = float(m.group(1)) * UNIT_S[m.group(2)]
        attempts = 1 + int(m.group(3) or 0)
        # every attempt ends within timeout_s (connect_timeout_s while connecting) plus
        # a backoff of ~0.1-3 s in all; a transport error after that long on average is
        # the limit running out (a refused or reset connection fails in milliseconds)
        limit = float(min(self.options.timeout_s, self.options.connect_timeout_s))
        return elapsed / attempts >= 0.9 * limit

    def _write_error(self, exc: BaseException, bucket: str, key: str) -> BaseException:
        """The error of a PUT of ``key``: "not found" can only be the bucket's (a store
        whose answer names no code for it, as fake-gcs-server's JSON)."""
        err = self._map_error(exc, f"writing {self._url(bucket, key)}")
        if isinstance(err, CheckpointNotFoundError):
            return StorageError(f"writing {self._url(bucket, key)}: the {self.bucket_word} "
                                f"{self._url(bucket)} does not exist (the store answered "
                                "404 to a write)")
        return err

    def _list_error(self, exc: BaseException, url: str, why: str) -> BaseException:
        """The error of a listing of the objects under ``url``: a refusal says that it was
        the listing, of which prefix, for what (``why``) and which permission it needs."""
        key = odd_key(exc)
        if key is not None:
            store = re.match(r"[a-z0-9]+://[^/]+", url)
            return StorageError(
                f"listing {url.rstrip('/')}/ ({why}) failed: it holds the object "
                f"{store.group(0) if store else ''}/{shown_key(key)} ({odd_reason(key)}: it "
                "names no path inside it; not written by statestream; not followed) and the "
                "client cannot list past it. Delete it with the store's own tools")
        err = self._map_error(exc, f"listing {url.rstrip('/')}/ ({why})")
        if isinstance(err, PermissionError) and not credentials_refused(exc):
            return storage_error(
                f"listing the objects under {url.rstrip('/')}/ was refused (403): {why} "
                f"needs {self.list_permission}; check the credentials and the "
                f"{self.bucket_word} policy", errno.EACCES)
        return err

    def _config_key(self) -> tuple[Any, ...]:
        """What a client is built from: the options and every variable it reads.

        Values are hashed so that the key holds no secret in clear.
        """
        env = tuple(sorted((k, hashlib.sha256(v.encode()).hexdigest())
                           for k, v in os.environ.items() if k.startswith(self.env_prefixes)))
        return (self.options, env)

    def _store(self, bucket: str) -> Any:
        """The client for ``bucket``, rebuilt whenever its configuration changed; a
        StorageError in a process forked from one that ran the client (see _object_fork)."""
        fork_check()
        fork_mark(self._url(bucket))
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
            raise self._write_error(exc, bucket, key) from exc

    def _put_new(self, bucket: str, key: str, data: bytes) -> bool:
        """Create ``key`` only if absent; False when it already exists."""
        return self._put_if(bucket, key, data, "create") is not None

    def _get_small(self, bucket: str, key: str, max_bytes: int, missing_ok: bool = False
                   ) -> bytes | None:
        import obstore

        where = self._url(bucket, key)
        try:
            # one GET, not HEAD then GET: its size comes with the answer's headers (the
            # body is not read past the limit), and a missing object's answer has a
            # body, which tells a missing bucket (NoSuchBucket, ContainerNotFound) from
            # a missing key without listing the bucket (see check_bucket)
            got = obstore.get(self._store(bucket), key)
            size = int(got.meta["size"])
            if size > max_bytes:
                raise CheckpointCorruptError(
                    f"{where} is {size} bytes, over the {max_bytes}-byte limit"
                )
            return bytes(got.bytes())
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
        """Raise a clear StorageError if the bucket is missing or not accessible.

        It lists the bucket: a save does not call it (reading the commit marker tells a
        missing bucket already, see :meth:`_get_small`), so saving needs no permission
        to list."""
        try:
            next(pages(self, bucket, "statestream-probe/", chunk_size=1), None)
        except Exception as exc:
            text = scrub(str(exc)).lower()
            squashed = text.replace(" ", "")
            # a status of 404, not "404" inside a port, key or request id of the message
            if (any(code in squashed for code in self.missing_bucket_codes)
                    or re.search(r"\b404\b", text)):
                raise StorageError(
                    f"{self._url(bucket)} does not exist (or is not visible with these "
                    "credentials)"
                ) from None
            raise self._list_error(exc, self._url(bucket, "statestream-probe"),
                                   f"checking that {self._url(bucket)} exists") from exc

    def _live_root(self, bucket: str, prefix: str) -> str | None:
        """The root the commit marker at ``prefix`` names; None without a marker;
        :data:`DAMAGED_MARKER` for a marker that names no valid root (the checkpoint is
        there but damaged: listed, refused when read, and none of its data is garbage)."""
        try:
            data = self._get_small(bucket, f"{prefix}/{COMMIT_NAME}", MAX_COMMIT_BYTES,
                                   missing_ok=True)
        except CheckpointCorruptError:  # over the size limit: damaged, as a local one is
            return DAMAGED_MARKER
        if data is None:
            return None
        try:
            root = json.loads(data).get("root")
        except (ValueError, AttributeError, RecursionError):
            return DAMAGED_MARKER
        return root if isinstance(root, str) and ROOT_RE.match(root) else DAMAGED_MARKER

    def _delete_prefix(self, bucket: str, prefix: str, keep: str | None = None) -> None:
        """Delete every object under ``prefix`` but ``keep``."""
        import obstore

        st = self._store(bucket)
        try:
            paths = [m["path"] for m in listed(self, bucket, prefix) if m["path"] != keep]
        except Exception as exc:
            raise self._list_error(exc, self._url(bucket, prefix),
                                   "deleting them (they are found by listing)") from exc
        if not paths:
            return
        try:
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
            raise self._write_error(exc, bucket, key) from exc
        return version_of(res)

    def acquire_lease(self, path: str, *, holder: str, ttl_s: float) -> ObjectLease:
        """The lease object ``path``: created if absent, taken over once expired.

        Expiry is judged on the store's clock alone: the lease's Last-Modified
        against that of a probe object written at once (hosts' clocks may
        disagree; see :meth:`_store_now`).
        """
        bucket, key = self.split_url(path)
        # a nonce makes the body ours alone: a create or renewal whose answer was lost
        # (the client's retry refused) is recognised by it, see _version_if_ours
        body = json.dumps({"holder": holder, "ttl_s": ttl_s,
                           "nonce": uuid.uuid4().hex}).encode()
        for _ in range(3):
            version = self._create_lease(bucket, key, body)
            if version is None:
                version = self._take_expired(bucket, key, body, ttl_s)
            if version is not None:
                return ObjectLease(self, bucket, key, holder, ttl_s, body, version)
        raise ManagerLockedError(f"{path} is contended: it changed hands while being taken")

    def _create_lease(self, bucket: str, key: str, body: bytes) -> dict[str, str] | None:
        """Create lease ``key``; None if it exists. A PUT that failed may have been
        stored all the same (its answer lost): then the lease is ours."""
        try:
            return self._put_if(bucket, key, body, "create")
        except CheckpointError:
            try:
                version = self._version_if_ours(bucket, key, body)
            except CheckpointError:
                version = None  # the store is still unreachable: report the first failure
            if version is None:
                raise
            return version

    def _take_expired(self, bucket: str, key: str, body: bytes, ttl_s: float
                      ) -> dict[str, str] | None:
        """Take the existing lease ``key`` over if it expired; None if it vanished meanwhile."""
        where = self._url(bucket, key)
        got = self._read_lease(bucket, key)
        if got is None:
            return None  # released meanwhile: try to create it again
        meta, held = got
        if held == body:  # our own create, whose answer was lost (its retry refused)
            return version_of(meta)
        holder, held_ttl = parse_lease(held, ttl_s)
        age = self._store_now(bucket, key) - meta["last_modified"].timestamp()
        if age <= held_ttl + LEASE_SLACK_S:
            raise ManagerLockedError(
                f"{where} is held by {holder}, renewed {max(age, 0):.0f} s ago "
                f"(lease of {held_ttl:g} s: if its holder crashed, it expires "
                f"{held_ttl + LEASE_SLACK_S:g} s after that renewal)"
            )
        return self._put_if(bucket, key, body, version_of(meta))

    def _read_lease(self, bucket: str, key: str) -> tuple[Any, bytes] | None:
        """(metadata, body) of the lease object ``key`` from one GET; None if absent. A body
        over :data:`_MAX_LEASE_BYTES` (no lease's: someone else's object) is not read."""
        import obstore

        try:
            got = obstore.get(self._store(bucket), key)
            if int(got.meta["size"]) > _MAX_LEASE_BYTES:
                return got.meta, b"<an object of %d bytes>" % int(got.meta["size"])
            return got.meta, bytes(got.bytes())
        except Exception as exc:
            err = self._map_error(exc, f"reading {self._url(bucket, key)}")
            if isinstance(err, CheckpointNotFoundError):
                return None
            raise err from exc

    def _version_if_ours(self, bucket: str, key: str, body: bytes) -> dict[str, str] | None:
        """The version of lease ``key`` if it holds exactly ``body`` (nonce included):
        a conditional PUT refused only because its own first attempt had succeeded."""
        got = self._read_lease(bucket, key)
        return version_of(got[0]) if got is not None and got[1] == body else None

    def _store_now(self, bucket: str, key: str) -> float:
        """The store's clock now: the Last-Modified of a probe object written beside
        ``key`` (and deleted). A taker whose own clock runs ahead would otherwise see
        a live lease as expired and take it from its holder."""
        import obstore

        st = self._store(bucket)
        probe = f"{key}.clock-{uuid.uuid4().hex}"
        where = self._url(bucket, probe)
        try:
            obstore.put(st, probe, b"")
            return float(obstore.head(st, probe)["last_modified"].timestamp())
        except Exception as exc:
            raise self._map_error(exc, f"writing {where} (the store's time, to judge a "
                                  "lease's age)") from exc
        finally:
            try:
                obstore.delete(st, probe)
            except Exception:
                pass  # best effort: an empty object that names nothing

    def leftovers(self, parent: str) -> builtins.list[Leftover]:
        """Roots of the checkpoints directly under ``parent`` that no marker names.

        Root names cannot record a writer (readers accept 32 hex digits only),
        so every leftover here has an unverifiable writer: removed after the
        age limit, or by the lease holder of ``parent``. An unfinished multipart
        upload is invisible until it completes (see docs/storage.md). Only what a
        save writes counts: a "checkpoint" holding any other object (a nested
        checkpoint, another tool's files under a hex-named folder) has no
        leftovers, whatever its age.
        """
        bucket, prefix = self.split_url(parent)
        roots, foreign = saved_roots(self, bucket, prefix, parent)
        names = {name for name, _ in roots if name not in foreign}
        live = {name: self._live_root(bucket, f"{prefix}/{name}") for name in names}
        # a damaged marker cannot say which root is live: none of them is garbage
        return [Leftover(self._url(bucket, f"{prefix}/{name}/{root}"), name, None, when)
                for (name, root), when in sorted(roots.items())
                if name in names and live[name] not in (root, DAMAGED_MARKER)]

    def remove_leftover(self, leftover: Leftover) -> None:
        bucket, key = self.split_url(leftover.path)
        checkpoint, _, root = key.rpartition("/")
        if not ROOT_RE.match(root) or not checkpoint:
            raise LeftoverKeptError(
                f"{leftover.path} is not the root of a checkpoint; not removing it")
        try:  # what it holds now, not what the listing saw: only what a save writes
            for m in listed(self, bucket, checkpoint + "/"):
                if saved_kind(m["path"][len(checkpoint) + 1 :]) is None:
                    raise LeftoverKeptError(
                        f"{self._url(bucket, checkpoint)} holds {self._url(bucket, m['path'])}"
                        f", which no save writes; not removing {leftover.path}")
        except StorageError:
            raise
        except Exception as exc:
            raise self._list_error(exc, self._url(bucket, checkpoint),
                                   "removing what an unfinished save left") from exc
        live = self._live_root(bucket, checkpoint)
        if live == root:
            raise LeftoverKeptError(f"{leftover.path} was committed meanwhile; not removing it")
        if live == DAMAGED_MARKER:
            raise LeftoverKeptError(f"the commit marker of {self._url(bucket, checkpoint)} is "
                                    f"damaged, so {leftover.path} may be its data; not removing it")
        self._delete_prefix(bucket, key + "/")

    # -- Storage protocol ------------------------------------------------------------
    def begin_write(self, path: str, *, overwrite: bool) -> ObjectTxn:
        bucket, prefix = self.split_url(path)
        if not overwrite and self._live_root(bucket, prefix) is not None:
            raise CheckpointExistsError(
                f"{path} already holds a checkpoint; pass overwrite=True to replace it "
                "atomically or choose another path"
            )
        return ObjectTxn(self, path, overwrite, None)

    def join_write(self, path: str, token: str) -> ObjectTxn:
        if not ROOT_RE.match(token):
            raise StorageError(f"cannot join write of {path}: bad token")
        return ObjectTxn(self, path, False, token)

    def open_read(self, path: str, *, follow_links: bool = True) -> ObjectReader:
        return ObjectReader(self, path)  # an object store has no links to follow

    def is_committed(self, path: str) -> bool:
        bucket, prefix = self.split_url(path)
        return self._live_root(bucket, prefix) is not None

    def list(self, path: str) -> builtins.list[str]:
        """Names directly under ``path`` (a bucket too); objects whose keys name no path
        inside it (``run/../x``, ``run//y``) are skipped with a warning (see
        ``_object_list``)."""
        bucket, prefix = self._split_listed(path)
        return child_names(self, bucket, prefix, path)

    def _split_listed(self, path: str) -> tuple[str, str]:
        """:meth:`split_url`, and a bare bucket (``s3://bucket``) as prefix "": the
        checkpoints directly under it are its entries (``s3://bucket/run``'s siblings)."""
        head = f"{self.scheme}://"
        rest = path[len(head):].rstrip("/") if path.startswith(head) else ""
        if rest and "/" not in rest:  # the bucket's name checked as any URL's
            return self.split_url(f"{head}{rest}/-")[0], ""
        return self.split_url(path)

    def delete(self, path: str) -> None:
        """Mark the deletion, uncommit, delete everything under ``path``, then the mark.

        A deletion killed part-way leaves no commit marker (nothing loads what is
        left) and its mark, :data:`DELETING_NAME`, by which
        :meth:`deletion_interrupted` knows the rest for remains: deleting the path
        again finishes the job."""
        import obstore

        bucket, prefix = self.split_url(path)
        st = self._store(bucket)
        mark = f"{prefix}/{DELETING_NAME}"
        try:
            self._put(bucket, mark, b"")
        except TimeoutError:
            raise  # the store is not answering: so would the deletes
        except CheckpointError as exc:  # credentials that may delete but not write, or
            # a store that refuses this PUT (fake-gcs-server): delete as before, unmarked
            logging.getLogger("statestream").info(
                "deleting %s without its %s mark: %s", path, DELETING_NAME, exc)
        try:  # uncommit first: a half-deleted checkpoint never loads
            obstore.delete(st, f"{prefix}/{COMMIT_NAME}")
        except Exception as exc:  # only "already gone" may pass; else data would go first
            err = self._map_error(exc, f"uncommitting {path}")
            if not isinstance(err, CheckpointNotFoundError):
                raise err from exc
        _hooks.fire("delete.uncommitted")
        self._delete_prefix(bucket, prefix + "/", keep=mark)
        try:
            obstore.delete(st, mark)
        except Exception as exc:
            err = self._map_error(exc, f"deleting {self._url(bucket, mark)}")
            if not isinstance(err, CheckpointNotFoundError):
                raise err from exc

    def deletion_interrupted(self, path: str) -> bool:
        """Whether ``path`` holds what a :meth:`delete` killed part-way left: its mark
        and no commit marker (a save to ``path`` committed since then)."""
        bucket, prefix = self.split_url(path)
        mark = self._get_small(bucket, f"{prefix}/{DELETING_NAME}", 4096, missing_ok=True)
        return mark is not None and not self.is_committed(path)
