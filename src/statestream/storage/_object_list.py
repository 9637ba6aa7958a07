"""Object stores: listings that survive objects whose keys map to no path.

Anyone who may write to a bucket can put an object named ``run/../x``,
``run/step_5/../../evil``, ``run/./y``, ``run//z`` or ``run/a\x01b`` beside a
manager's steps. Such a key has a ``..``, ``.`` or empty segment or an ASCII
control character: it names no path inside ``run/`` (``..`` would climb out of
it), and the client (obstore) refuses to return it, failing the whole page of
the listing that holds it. Before 2026-12-07 that failure ended every listing
of ``run/``: ``steps()``, ``latest_step()``, the keep policy, ``statestream
ls`` and the manager's start (it looks for leftovers) all raised.

Here a listing skips such a key with a warning that names it, never follows it,
and goes on after it (the stores take an ``offset``: list what sorts after a
key; the offset's own key is read apart, as a listing leaves it out). What the
client cannot do is read the rest of the page that held it: the objects in that
page that sort *before* the odd key are not seen, and the warning says which
range that was. A listing of names raises instead when that range may hold a
name starting with a letter, digit or ``_`` (a checkpoint's): never fewer
steps. A listing of many checkpoints' objects is done one checkpoint at a time
when one of them holds such a key, so the odd key only hides its own checkpoint
(which is then left alone: nothing of it is taken for garbage).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from statestream.errors import CheckpointError, CheckpointNotFoundError, StorageError
from statestream.format import COMMIT_NAME, MANIFEST_NAME, validate_file_name
from statestream.storage._object_config import DELETING_NAME, ROOT_RE
from statestream.storage._object_pages import delimited, pages

if TYPE_CHECKING:
    from statestream.storage._object import ObjectStorage

__all__ = ["child_names", "listed", "odd_key", "odd_reason", "saved_kind", "saved_roots",
           "shown_key"]

#: obstore's message for a key it cannot parse: ``Error parsing Path "<key>": ...`` or
#: ``Path "<key>" contained empty path segment`` (the key is quoted as it is)
_ODD_RE = re.compile(r'Path "(.*)"(?:: | contained )')
#: the same key in the error's debug text, escaped as Rust escapes it (``\u{1}``, ``\"``)
_ODD_DEBUG_RE = re.compile(r'\n\s*path: "((?:[^"\\]|\\.)*)"')
_RUST_ESCAPE = re.compile(r"\\(u\{([0-9a-fA-F]{1,6})\}|.)")
_RUST_CHARS = {"n": "\n", "t": "\t", "r": "\r", "0": "\0"}
_ODD_SEGMENTS = ("", ".", "..")
#: what the client refuses in a key's segment besides those: ASCII control characters
_ILLEGAL = re.compile(r"[\x00-\x1f\x7f]")


def listed(owner: ObjectStorage, bucket: str, prefix: str, **kw: Any) -> Iterator[Any]:
    """Every object the store lists under ``prefix`` (``run/``: ends with ``/``), checked:
    a key outside it (a store or proxy that does not apply the prefix; deleting what it
    lists would delete someone else's objects), a key listed twice (a continuation token
    that repeats or loops: the client would list forever) or a batch that does not come
    (the same with empty pages, see :mod:`._object_pages`) is a StorageError. The object
    ``run/`` itself (a folder made in a console), which the client lists as ``run``, is
    no entry of it."""
    seen: set[str] = set()
    for batch in pages(owner, bucket, prefix, **kw):
        for m in batch:
            key = m["path"]
            if key == prefix[:-1]:
                continue  # the folder marker ``run/`` of a console, listed without its "/"
            if not key.startswith(prefix):
                raise _outside_error(owner, bucket, prefix, key)
            if key in seen:
                raise StorageError(
                    f"listing {owner._url(bucket, prefix)} failed: the store answered "
                    f"{owner._url(bucket, shown_key(key))} twice (its continuation token "
                    "repeats or loops); stopped instead of listing forever")
            seen.add(key)
            yield m


def _outside_error(owner: ObjectStorage, bucket: str, prefix: str, key: str) -> StorageError:
    """The error of a listing of ``prefix`` (ends with ``/``) that answered ``key``, which
    is not under it."""
    return StorageError(
        f"listing {owner._url(bucket, prefix)} failed: the store answered "
        f"{owner._url(bucket, shown_key(key))}, which is not under it (a store or proxy "
        "that does not apply the listing's prefix); nothing it listed was used")


def _unescape(text: str) -> str:
    def one(m: re.Match[str]) -> str:
        if m.group(2):
            return chr(int(m.group(2), 16))
        return _RUST_CHARS.get(m.group(1), m.group(1))
    return _RUST_ESCAPE.sub(one, text)


def odd_key(exc: BaseException) -> str | None:
    """The key of the object that made a listing fail because the client refuses it as a
    path (a ``..``, ``.`` or empty segment, a control character); None when ``exc`` is
    another failure."""
    if type(exc).__name__ != "InvalidPathError":
        return None
    text = str(exc)
    m = _ODD_DEBUG_RE.search(text)
    if m is not None:
        return _unescape(m.group(1))
    m = _ODD_RE.search(text.splitlines()[0] if text else "")
    return m.group(1) if m else None


def shown_key(key: str) -> str:
    """``key`` for a message: its control characters escaped (``\\x01``)."""
    return _ILLEGAL.sub(lambda m: f"\\x{ord(m.group()):02x}", key)


def odd_reason(key: str) -> str:
    """Why the client refuses ``key`` as a path."""
    if _ILLEGAL.search(key):
        return "its key holds a control character"
    return "its key has an empty, '.' or '..' segment"


def _skip_offset(key: str) -> str | None:
    """The offset that lists what sorts after every key that shares ``key``'s first odd
    part, itself a key the client accepts: ``run/step_5/..0`` after
    ``run/step_5/../../evil`` (``0`` follows ``/``), ``run/a `` after ``run/a\\x01b``
    (`` `` follows the control characters), ``run/.. `` after ``run/..``. The one key equal
    to it is not listed (see :func:`_scan`); None when ``key`` has no odd part."""
    pos = 0
    parts = key.split("/")
    for i, part in enumerate(parts):
        bad = _ILLEGAL.search(part)
        if bad is not None:
            at = pos + bad.start()  # the first character after it the client accepts
            return key[:at] + ("\x80" if key[at] == "\x7f" else " ")
        if part in _ODD_SEGMENTS and (part or i < len(parts) - 1):
            end = pos + len(part)
            return key[:end] + (" " if end == len(key) else "0")
        pos += len(part) + 1
    return None


def _warn_odd(owner: ObjectStorage, bucket: str, key: str, listing: str, after: str | None
              ) -> None:
    start = f"{owner._url(bucket, after)}" if after else f"the start of {listing}"
    warnings.warn(
        f"ignored {owner._url(bucket, shown_key(key))} while listing {listing}: "
        f"{odd_reason(key)}, so it names no path inside it (not written by "
        "statestream; it was not followed). The store answers a listing in pages and "
        "the client cannot read the page that holds it: entries that sort between "
        f"{start} and that key may be missing from this listing. Delete the object "
        "with the store's own tools to list them again.", stacklevel=4)


#: what a listing does before it skips an odd key: given the last key it listed (None at
#: the start) and the odd key, it may raise (entries that must not go missing may be
#: hidden between them)
SkipCheck = Callable[[str | None, str], None]


def _head(owner: ObjectStorage, bucket: str, key: str) -> Any:
    """The metadata of object ``key``, None when there is none."""
    import obstore

    try:
        return obstore.head(owner._store(bucket), key)
    except Exception as exc:
        err = owner._map_error(exc, f"reading {owner._url(bucket, key)}")
        if isinstance(err, CheckpointNotFoundError):
            return None
        raise err from exc


def _scan(owner: ObjectStorage, bucket: str, prefix: str, listing: str,
          check: SkipCheck | None = None) -> Iterator[Any]:
    """Every object under ``prefix/`` (its metadata; ``prefix`` "": the whole bucket),
    skipping odd keys (warned)."""
    lead = f"{prefix}/" if prefix else ""
    offset: str | None = None
    while True:
        last = offset
        try:
            for m in listed(owner, bucket, lead, offset=offset, chunk_size=1000):
                last = m["path"]
                yield m
            return
        except Exception as exc:
            key = odd_key(exc)
            nxt = _skip_offset(key) if key is not None else None
            if key is None or nxt is None or (offset is not None and nxt <= offset):
                raise owner._list_error(exc, listing, "finding what it holds") from exc
        if check is not None:
            check(last, key)
        _warn_odd(owner, bucket, key, listing, last)
        offset = nxt
        exact = _head(owner, bucket, nxt)  # a listing after an offset leaves out its key
        if exact is not None:
            yield exact


def child_names(owner: ObjectStorage, bucket: str, prefix: str, path: str) -> list[str]:
    """Names of the entries directly under ``path`` (``prefix`` in ``bucket``), without
    those that name no path inside it (warned). Raises a StorageError when an odd key
    may hide a name that starts with a letter, digit or ``_`` (see :func:`_hides`).
    ``prefix`` "" lists the bucket itself (checkpoints directly under it)."""
    lead = f"{prefix}/" if prefix else ""
    try:
        res = delimited(owner, bucket, lead)
        keys = [p.rstrip("/") for p in res["common_prefixes"]]
        keys += [m["path"] for m in res["objects"] if m["path"] != prefix]  # folder marker
        outside = next((k for k in keys if not k.startswith(lead)), None)
        if outside is not None:
            raise _outside_error(owner, bucket, lead, outside)
        names = {k[len(lead):].partition("/")[0] for k in keys}
    except Exception as exc:
        if odd_key(exc) is None:
            raise owner._list_error(exc, path, "finding the checkpoints under it") from exc
        # a direct child with an odd name: the listing with a delimiter takes no offset,
        # so every key is listed, going on after each odd one
        names = set()

        def check(last: str | None, key: str) -> None:
            low = None if last is None else last[len(lead):].partition("/")[0]
            name = key[len(lead):].partition("/")[0]
            if _hides(low, name):
                raise _hidden_error(owner, bucket, path, key, last)

        for m in _scan(owner, bucket, prefix, path, check):
            names.add(m["path"][len(lead):].partition("/")[0])
    return sorted(n for n in names if n not in _ODD_SEGMENTS and not _ILLEGAL.search(n)
                  and _mappable(owner, path, n))


#: the first characters of the names that no odd key may hide from a listing of names
#: (every name statestream writes, ``step_...``, ``<32 hex>``, ``COMMITTED``, starts
#: with one of them)
_WORD_FIRST = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ_abcdefghijklmnopqrstuvwxyz"


def _hides(low: str | None, high: str) -> bool:
    """Whether a name that starts with a letter, digit or ``_`` sorts after ``low`` (None:
    the start) and before ``high``: the names the listing page of an odd key may hide."""
    for c in _WORD_FIRST:
        if low is None or low < c:
            least = c
        elif low[0] == c:
            least = low + "\x00"
        else:
            continue
        if least < high:
            return True
    return False


def _hidden_error(owner: ObjectStorage, bucket: str, path: str, key: str, last: str | None
                  ) -> StorageError:
    start = owner._url(bucket, last) if last else f"the start of {path}"
    return StorageError(
        f"listing {path.rstrip('/')}/ failed: it holds the object "
        f"{owner._url(bucket, shown_key(key))} ({odd_reason(key)}: it names no path inside "
        "it; not written by statestream; not followed), and the client cannot read the "
        "page of the listing that holds it, so entries that sort between "
        f"{start} and that object (checkpoints among them) would be missing from it. "
        "Delete the object with the store's own tools")


def _mappable(owner: ObjectStorage, path: str, name: str) -> bool:
    """Whether ``path/name`` is a URL of this store (Azure refuses a backslash)."""
    try:
        owner.split_url(f"{path.rstrip('/')}/{name}")
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
        for m in listed(owner, bucket, prefix + "/"):
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
