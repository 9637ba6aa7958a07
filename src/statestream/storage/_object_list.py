"""Object stores: listings that survive objects whose keys map to no path.

Anyone who may write to a bucket can put an object named ``run/../x``,
``run/step_5/../../evil``, ``run/./y`` or ``run//z`` beside a manager's steps.
Such a key has a ``..``, ``.`` or empty segment: it names no path inside
``run/`` (``..`` would climb out of it), and the client (obstore) refuses to
return it, failing the whole page of the listing that holds it. Before
2026-12-07 that failure ended every listing of ``run/``: ``steps()``,
``latest_step()``, the keep policy, ``statestream ls`` and the manager's start
(it looks for leftovers) all raised.

Here a listing skips such a key with a warning that names it, never follows it,
and goes on after it (the stores take an ``offset``: list what sorts after a
key). What the client cannot do is read the rest of the page that held it: the
objects in that page that sort *before* the odd key are not seen, and the
warning says which range that was. A listing of many checkpoints' objects is
done one checkpoint at a time when one of them holds such a key, so the odd key
only hides its own checkpoint (which is then left alone: nothing of it is taken
for garbage).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from statestream.errors import CheckpointError
from statestream.format import COMMIT_NAME, MANIFEST_NAME, validate_file_name
from statestream.storage._object_config import DELETING_NAME, ROOT_RE

if TYPE_CHECKING:
    from statestream.storage._object import ObjectStorage

__all__ = ["child_names", "odd_key", "saved_kind", "saved_roots"]

#: obstore's message for a key it cannot parse: ``Error parsing Path "<key>": ...`` or
#: ``Path "<key>" contained empty path segment`` (the key is quoted as it is)
_ODD_RE = re.compile(r'Path "(.*)"(?:: | contained )')
_ODD_SEGMENTS = ("", ".", "..")


def odd_key(exc: BaseException) -> str | None:
    """The key of the object that made a listing fail because it maps to no path (a
    ``..``, ``.`` or empty segment); None when ``exc`` is another failure."""
    if type(exc).__name__ != "InvalidPathError":
        return None
    m = _ODD_RE.search(str(exc).splitlines()[0] if str(exc) else "")
    return m.group(1) if m else None


def _skip_offset(key: str) -> str | None:
    """The offset that lists what sorts after every key that shares ``key``'s first odd
    segment (``run/step_5/..0`` after ``run/step_5/../../evil``: ``0`` follows ``/``);
    None when ``key`` has no odd segment."""
    parts = key.split("/")
    for i, part in enumerate(parts):
        if part in _ODD_SEGMENTS and (part or i < len(parts) - 1):
            return "/".join(parts[:i] + [part + "0"])
    return None


def _warn_odd(owner: ObjectStorage, bucket: str, key: str, listing: str, after: str | None
              ) -> None:
    start = f"{owner._url(bucket, after)}" if after else f"the start of {listing}"
    warnings.warn(
        f"ignored {owner._url(bucket, key)} while listing {listing}: its key has an "
        "empty, '.' or '..' segment, so it names no path inside it (not written by "
        "statestream; it was not followed). The store answers a listing in pages and "
        "the client cannot read the page that holds it: entries that sort between "
        f"{start} and that key may be missing from this listing. Delete the object "
        "with the store's own tools to list them again.", stacklevel=4)


def _scan(owner: ObjectStorage, bucket: str, prefix: str, listing: str) -> Iterator[Any]:
    """Every object under ``prefix/`` (its metadata), skipping odd keys (warned)."""
    import obstore

    st = owner._store(bucket)
    offset: str | None = None
    while True:
        last = offset
        try:
            for batch in obstore.list(st, prefix=prefix + "/", offset=offset, chunk_size=1000):
                for m in batch:
                    last = m["path"]
                    yield m
            return
        except Exception as exc:
            key = odd_key(exc)
            nxt = _skip_offset(key) if key is not None else None
            if key is None or nxt is None or (offset is not None and nxt <= offset):
                raise owner._list_error(exc, listing, "finding what it holds") from exc
            _warn_odd(owner, bucket, key, listing, last)
            offset = nxt


def child_names(owner: ObjectStorage, bucket: str, prefix: str, path: str) -> list[str]:
    """Names of the entries directly under ``path`` (``prefix`` in ``bucket``), without
    those that name no path inside it (warned)."""
    import obstore

    try:
        res = obstore.list_with_delimiter(owner._store(bucket), prefix=prefix + "/")
        names = {p.rstrip("/").rsplit("/", 1)[-1] for p in res["common_prefixes"]}
        names |= {m["path"].rsplit("/", 1)[-1] for m in res["objects"]}
    except Exception as exc:
        if odd_key(exc) is None:
            raise owner._list_error(exc, path, "finding the checkpoints under it") from exc
        # a direct child with an odd name: the listing with a delimiter takes no offset,
        # so every key is listed, going on after each odd one
        names = set()
        for m in _scan(owner, bucket, prefix, path):
            names.add(m["path"][len(prefix) + 1:].partition("/")[0])
    return sorted(n for n in names if n not in _ODD_SEGMENTS and _mappable(owner, path, n))


def _mappable(owner: ObjectStorage, path: str, name: str) -> bool:
    """Whether ``path/name`` is a URL of this store (Azure refuses a backslash)."""
    try:
        owner.split_url(f"{path}/{name}")
    except CheckpointError as exc:
        warnings.warn(f"ignored the entry {name!r} of {path}: {exc}", stacklevel=4)
        return False
    return True


def saved_kind(rel: str) -> str | None:
    """What the object at ``rel`` (below a checkpoint's prefix) is: ``""`` for its
    commit marker (or a deletion's mark), the root for a root's manifest or data file,
    None for anything a save (or a deletion) does not write there."""
    if rel in (COMMIT_NAME, DELETING_NAME):
        return ""
    root, _, rest = rel.partition("/")
    if not ROOT_RE.match(root):
        return None
    if rest == MANIFEST_NAME:
        return root
    try:
        validate_file_name(rest)
    except CheckpointError:
        return None
    return root


def saved_roots(owner: ObjectStorage, bucket: str, prefix: str, parent: str
                ) -> tuple[dict[tuple[str, str], float], set[str]]:
    """The roots saves wrote in the checkpoints directly under ``parent`` (``(name,
    root)`` -> newest modification time) and the names of those holding any other
    object (foreign). One listing of everything; when an odd key makes it fail, one
    listing per checkpoint, and the checkpoint holding the odd key counts as foreign."""
    import obstore

    roots: dict[tuple[str, str], float] = {}
    foreign: set[str] = set()

    def note(name: str, rest: str, m: Any) -> None:
        kind = saved_kind(rest)
        if kind is None:
            if rest:  # an object directly under parent is no checkpoint's
                foreign.add(name)
        elif kind:
            when = m["last_modified"].timestamp()
            roots[name, kind] = max(roots.get((name, kind), 0), when)

    try:
        for batch in obstore.list(owner._store(bucket), prefix=prefix + "/"):
            for m in batch:
                name, _, rest = m["path"][len(prefix) + 1:].partition("/")
                note(name, rest, m)
        return roots, foreign
    except Exception as exc:
        if odd_key(exc) is None:
            raise owner._list_error(exc, parent, "finding what unfinished saves left") from exc
    roots.clear()
    foreign.clear()
    for name in child_names(owner, bucket, prefix, parent):
        top = f"{prefix}/{name}"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                found = list(_scan(owner, bucket, top, owner._url(bucket, top)))
            except CheckpointError as exc:  # a store that cannot list past it
                if exc.__cause__ is None or odd_key(exc.__cause__) is None:
                    raise
                warnings.warn(str(exc), stacklevel=2)  # caught just below
                found = []
        for w in caught:
            warnings.warn(f"{w.message} Nothing of {owner._url(bucket, top)} is taken for "
                          "an unfinished save's leftovers.", stacklevel=3)
        if caught:
            foreign.add(name)
        for m in found:
            note(name, m["path"][len(top) + 1:], m)
    return roots, foreign
