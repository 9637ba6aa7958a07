"""Building a save's manifest, for one process or many, from typed records.

Every process describes what it walked (:class:`RankTree`: its tree and the
key path, dtype and shape of each of its arrays). Before any data is
written, :func:`merge_trees` unites those descriptions into the one tree of
the checkpoint -- the same answer on every process -- or names which rank
holds what at the first key path where they disagree. After the writers
have finished, each process reports the chunks it wrote (:class:`RankPart`:
records made *after* the bytes exist, so offsets and stored sizes come from
the writer, never from a plan made in advance), and :func:`build_manifest`
joins the parts into a :class:`~statestream.format.Manifest`. When a process
cannot confirm a commit (a peer died right after it), :func:`manifest_matches`
tells whether a committed manifest is the one these parts build.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Collection, Sequence
from typing import Any, Protocol

from statestream.errors import CheckpointError, TargetMismatchError
from statestream.format import (
    ArrayEntry,
    ChunkEntry,
    ChunkRef,
    FileEntry,
    Manifest,
    decode_manifest,
    encode_manifest,
    itemsize_of,
)
from statestream.plan._keys import array_key, shown_key, twin_key
from statestream.tree import Key, KeyPath, Node, format_keypath

__all__ = [
    "ArrayDecl",
    "ArrayShape",
    "MergedTree",
    "RankPart",
    "RankTree",
    "build_manifest",
    "manifest_matches",
    "merge_trees",
    "single_tree",
]


@dataclasses.dataclass(frozen=True, slots=True)
class ArrayDecl:
    """One array of the checkpoint: key, dtype and global shape.

    The key is its key path's display form, told apart by key type (see
    :meth:`at`: an int key and a str key that reads the same are two arrays).
    """

    key: str
    dtype: str
    shape: tuple[int, ...]

    @staticmethod
    def at(path: KeyPath, dtype: str, shape: tuple[int, ...]) -> ArrayDecl:
        """The array at key path ``path`` (its key: ``plan/_keys.py``).

        Example:
            >>> ArrayDecl.at(("a", 0), "int8", (2,)).key, ArrayDecl.at(("a", "0"), "int8", (2,)).key
            ('a/0', 'a/~20')
        """
        return ArrayDecl(array_key(path), dtype, shape)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize_of(self.dtype)


@dataclasses.dataclass(slots=True)
class RankTree:
    """What one process walked: its tree (leaves index ``arrays``)."""

    tree: Node
    arrays: list[ArrayDecl]
    #: indices of the arrays of which this process holds no element (an empty shard):
    #: it cannot tell whether such an array is tied to another (an empty shard has no
    #: memory to share), so the processes that hold some of it decide
    unheld: Collection[int] = ()


class ArrayShape(Protocol):
    """What the manifest needs of an array: dtype and global shape."""

    @property
    def dtype(self) -> str: ...

    @property
    def shape(self) -> tuple[int, ...]: ...


@dataclasses.dataclass(slots=True)
class MergedTree:
    """The checkpoint's tree with global array indices, and its array table."""

    tree: Node
    arrays: Sequence[ArrayShape]
    #: key path -> global array index (empty for one process, whose indices are
    #: already global)
    index: dict[str, int]
    #: key path of an array that some process holds no element of -> key path of the
    #: array the processes holding some tie it to (``index`` gives both one number)
    tied: dict[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(slots=True)
class RankPart:
    """The chunks one process wrote: its files and, per global array, its chunks.

    A chunk's ``file`` indexes this part's ``files``.
    """

    files: list[FileEntry]
    chunks: dict[int, list[ChunkEntry]]

    def to_wire(self) -> dict[str, Any]:
        """Plain data for a collective gather."""
        return {
            "files": [[f.name, f.size] for f in self.files],
            "chunks": [[a, [_chunk_to_wire(c) for c in cs]] for a, cs in self.chunks.items()],
        }

    @staticmethod
    def from_wire(doc: dict[str, Any]) -> RankPart:
        files = [FileEntry(str(n), int(s)) for n, s in doc["files"]]
        chunks = {int(a): [_chunk_from_wire(c) for c in cs] for a, cs in doc["chunks"]}
        return RankPart(files, chunks)


def _chunk_to_wire(c: ChunkEntry) -> list[Any]:
    out = [c.file, c.offset, c.nbytes, c.checksum, list(c.start), list(c.shape), c.block_rows,
           list(c.block_checksums)]
    if c.codec is not None or c.digest is not None or c.ref is not None:  # format v2 fields
        out.append([c.codec, c.shuffle, c.digest.hex() if c.digest is not None else None,
                    [c.ref.base, c.ref.file] if c.ref is not None else None])
    return out


def _chunk_from_wire(w: list[Any]) -> ChunkEntry:
    f, off, nb, crc, st, sh, br, bl = w[:8]
    c = ChunkEntry(f, off, nb, crc, tuple(st), tuple(sh), br, tuple(bl))
    if len(w) > 8:
        codec, shuffle, digest, ref = w[8]
        c.codec, c.shuffle = codec, bool(shuffle)
        c.digest = bytes.fromhex(digest) if digest is not None else None
        c.ref = ChunkRef(str(ref[0]), int(ref[1])) if ref is not None else None
    return c


# ----------------------------------------------------------------------------- trees


#: how an error says that a rank holds no element of an array (``RankTree.unheld``)
_EMPTY = "but none of its elements (an empty shard)"


def _describe(node: Node | None, arrays: list[ArrayDecl], unheld: Collection[int]) -> str:
    if node is None:
        return "nothing"
    k = node.kind
    if k in ("array", "alias") and node.array is not None:
        a = arrays[node.array]
        if k == "alias":  # ``a`` is the array first found in the same memory
            return f"the same array as '{shown_key(a.key)}' (tied: {a.dtype}{list(a.shape)})"
        if node.array in unheld:  # it could not see a tie: say why it may differ
            return f"an array ({a.dtype}{list(a.shape)}) {_EMPTY}"
        return f"an array ({a.dtype}{list(a.shape)})"
    if k in ("list", "tuple"):
        return f"a {k} of {len(node.children or [])}"
    if k in ("bytes", "pickle", "none", "bool", "int", "float", "str"):
        return f"a value of kind {k}"
    return f"a {k}" + (f" ({node.type_name})" if node.type_name else "")


def _node_at(node: Node, path: KeyPath) -> Node | None:
    for key in path:
        found = node.child(key)
        if found is None:
            return None
        node = found
    return node


def _mismatch(ranks: Sequence[RankTree], path: KeyPath, what: str) -> TargetMismatchError:
    views = "; ".join(
        f"rank {r} holds {_describe(_node_at(rt.tree, path), rt.arrays, rt.unheld)}"
        for r, rt in enumerate(ranks)
    )
    return TargetMismatchError(
        f"processes saved {what} at key path '{format_keypath(path) or '<root>'}': {views}. "
        "Every process must save the same structure; nothing was written"
    )


@dataclasses.dataclass(slots=True)
class _Merging:
    """What merging one more rank's tree needs besides the two trees."""

    ranks: Sequence[RankTree]
    #: the rank's array keys, by its local index
    keys_b: list[str]
    #: the rank's arrays of which it holds no element (``RankTree.unheld``)
    unheld_b: Collection[int]
    #: what the merge found tied for processes that hold no element (``MergedTree.tied``)
    tied: dict[str, str]


@dataclasses.dataclass(frozen=True, slots=True)
class _Unheld:
    """An array leaf's key where no process merged so far holds an element of it:
    whether it is tied to another array is for a process that holds some to say."""

    key: str


def _merge(a: Node, b: Node, path: KeyPath, m: _Merging) -> Node:
    """Union of ``a`` (ranks so far, leaves hold key paths) and one more rank's ``b``."""
    if a.kind != b.kind:
        tie = _unseen_tie(a, b, m)
        if tie is None:
            raise _mismatch(m.ranks, path, "different kinds of value")
        return tie
    if a.children is None:
        if a.kind == "alias" and a.value != m.keys_b[b.array or 0]:
            raise _mismatch(m.ranks, path, "ties to different arrays")
        if type(a.value) is _Unheld and b.array not in m.unheld_b:
            return _keyed(b, m.keys_b, ())  # a rank holding some of it: not tied
        return a
    kids_b = b.children or []
    if a.keys is not None:
        keys = list(a.keys)
        kids = list(a.children)
        index = {(type(k), k): i for i, k in enumerate(keys)}
        for k, c in zip(b.keys or [], kids_b):
            i = index.get((type(k), k))
            if i is None:
                _no_twin(k, index, len(a.keys), b.keys or [], path, m.ranks)
                index[(type(k), k)] = len(keys)
                keys.append(k)
                kids.append(_keyed(c, m.keys_b, m.unheld_b))
            else:
                kids[i] = _merge(kids[i], c, path + (k,), m)
        return Node(a.kind, keys, kids, a.type_name, a.value, a.array, a.attrs)
    if len(a.children) != len(kids_b):
        raise _mismatch(m.ranks, path, f"{a.kind}s of different lengths")
    return Node(a.kind, a.keys, [_merge(x, y, path + (i,), m)
                                 for i, (x, y) in enumerate(zip(a.children, kids_b))],
                a.type_name, a.value, a.array, a.attrs)


def _unseen_tie(a: Node, b: Node, m: _Merging) -> Node | None:
    """The alias where one side says tied and the other holds no element of the array
    (its local shard is empty, so its walk could not see the tie), else None."""
    if a.kind == "array" and b.kind == "alias" and type(a.value) is _Unheld:
        target = m.keys_b[b.array or 0]
        m.tied[a.value.key] = target
        return Node("alias", None, None, b.type_name, target, None, b.attrs)
    if a.kind == "alias" and b.kind == "array" and b.array in m.unheld_b:
        m.tied[m.keys_b[b.array or 0]] = a.value
        return a
    return None


def _no_twin(key: Key, index: dict[tuple[type, Key], int], merged: int, keys_b: list[Key],
             path: KeyPath, ranks: Sequence[RankTree]) -> None:
    """Refuse ``key``, new to the ranks merged so far, where one of them holds its twin
    (``0`` for ``"0"``: a key of the other type that a key path writes alike) and this
    rank does not: the same entry under keys of different types, not two entries."""
    twin = twin_key(key)
    if twin is None or index.get((type(twin), twin), merged) >= merged:
        return
    if any(type(k) is type(twin) and k == twin for k in keys_b):
        return  # this rank holds both: two entries, as on one process

    def held(rt: RankTree) -> str:
        node = _node_at(rt.tree, path)
        got = [k for k in (node.keys or [] if node is not None else [])
               if (type(k), k) in ((type(key), key), (type(twin), twin))]
        return " and ".join(f"the {type(k).__name__} key {k!r}" for k in got) or "neither"

    views = "; ".join(f"rank {r} holds {held(rt)}" for r, rt in enumerate(ranks))
    raise TargetMismatchError(
        f"processes saved keys of different types at key path "
        f"'{format_keypath(path)}': {views}. Every process must save the same structure; "
        "nothing was written"
    )


# (Nodes are built field by field below: ``dataclasses.replace`` costs ~5 us a call,
# and a save by N processes of n arrays each makes about 2 N n of these on every rank.)


def _keyed(node: Node, keys: list[str], unheld: Collection[int]) -> Node:
    """A copy of ``node`` whose array leaves hold key paths (see ``_number``), as
    :class:`_Unheld` for ``unheld`` arrays."""
    if node.children is not None:
        return Node(node.kind, node.keys, [_keyed(c, keys, unheld) for c in node.children],
                    node.type_name, node.value, node.array, node.attrs)
    if node.array is not None:
        key: str | _Unheld = keys[node.array]
        if unheld and node.kind == "array" and node.array in unheld:
            key = _Unheld(keys[node.array])
        return Node(node.kind, node.keys, None, node.type_name, key, None, node.attrs)
    return node


def _number(node: Node, order: dict[str, int]) -> Node:
    """Replace key paths held by array leaves by global indices (first seen first)."""
    if node.children is not None:
        return Node(node.kind, node.keys, [_number(c, order) for c in node.children],
                    node.type_name, node.value, node.array, node.attrs)
    if node.kind in ("array", "alias", "bytes", "pickle"):  # an alias: its array's key
        key = node.value.key if type(node.value) is _Unheld else node.value
        return Node(node.kind, node.keys, None, node.type_name, None,
                    order.setdefault(key, len(order)), node.attrs)
    return node


def merge_trees(ranks: Sequence[RankTree]) -> MergedTree:
    """The checkpoint's tree from every process's tree (the same result everywhere).

    Keyed containers are united (rank order decides plain values and key
    order); lists, tuples and kinds of value must agree; an array's dtype and
    shape must agree on every rank that holds it.

    Raises:
        TargetMismatchError: naming the first key path where processes disagree
            and what each rank holds there.

    Example:
        >>> from statestream.tree import Node
        >>> t = Node("dict", keys=["w"], children=[Node("array", array=0)])
        >>> m = merge_trees([RankTree(t, [ArrayDecl("w", "float32", (2,))])] * 2)
        >>> m.index, m.arrays[0].shape
        ({'w': 0}, (2,))
    """
    if len(ranks) == 1:  # one process: its tree is the checkpoint's, as it is
        return single_tree(ranks[0].tree, ranks[0].arrays)
    keys = [[a.key for a in rt.arrays] for rt in ranks]
    tied: dict[str, str] = {}
    merged = _keyed(ranks[0].tree, keys[0], ranks[0].unheld)
    for r in range(1, len(ranks)):
        merged = _merge(merged, ranks[r].tree, (),
                        _Merging(ranks, keys[r], ranks[r].unheld, tied))
    order: dict[str, int] = {}
    tree = _number(merged, order)
    decls: dict[str, ArrayDecl] = {}
    for rt in ranks:
        for a in rt.arrays:
            key = tied.get(a.key, a.key) if tied else a.key
            seen = decls.setdefault(key, a)
            if (seen.dtype, seen.shape) != (a.dtype, a.shape):
                raise _disagree(ranks, key, tied)
    index = order
    if tied:  # a tied array's key numbers the array it is tied to
        index = {**order, **{k: order[t] for k, t in tied.items()}}
    return MergedTree(tree, [decls[k] for k in order], index, tied)


def _disagree(ranks: Sequence[RankTree], key: str, tied: dict[str, str]
              ) -> TargetMismatchError:
    """The error for the array at ``key`` (with those tied to it) differing in dtype or
    shape between processes."""
    holders = "; ".join(
        f"rank {q}: {b.dtype}{list(b.shape)}"
        + (f" at '{shown_key(b.key)}', tied to it" if b.key != key else "")
        + (f", {_EMPTY}" if i in other.unheld else "")
        for q, other in enumerate(ranks) for i, b in enumerate(other.arrays)
        if tied.get(b.key, b.key) == key)
    return TargetMismatchError(
        f"processes disagree about the array at key path '{shown_key(key)}' ({holders}); "
        "nothing was written"
    )


def single_tree(tree: Node, arrays: Sequence[ArrayShape]) -> MergedTree:
    """The checkpoint's tree when one process saved it: its own tree, as it is
    (no key paths needed: the local array indices are the global ones)."""
    return MergedTree(tree, arrays, {})


# ----------------------------------------------------------------------------- manifest


def build_manifest(merged: MergedTree, parts: Sequence[RankPart],
                   meta: dict[str, Any]) -> Manifest:
    """Join every process's written chunks into the manifest (parts in rank order).

    Example:
        >>> from statestream.format import ChunkEntry, FileEntry
        >>> t = Node("array", array=0)
        >>> m = merge_trees([RankTree(t, [ArrayDecl("", "uint8", (4,))])])
        >>> part = RankPart([FileEntry("data/r0-0.bin", 4)],
        ...                 {0: [ChunkEntry(0, 0, 4, 123, (0,), (4,))]})
        >>> man = build_manifest(m, [part], {})
        >>> man.files[0].name, man.arrays[0].chunks[0].checksum
        ('data/r0-0.bin', 123)
    """
    files: list[FileEntry] = []
    chunks: list[list[ChunkEntry]] = [[] for _ in merged.arrays]
    for part in parts:
        base = len(files)
        files.extend(part.files)
        for ai, cs in part.chunks.items():
            if base:  # a reference's file is the base checkpoint's: it stays
                cs = [c if c.ref is not None else c.in_file(c.file + base) for c in cs]
            chunks[ai].extend(cs)
    arrays = [ArrayEntry(a.dtype, a.shape, tuple(cs)) for a, cs in zip(merged.arrays, chunks)]
    return Manifest(tree=merged.tree, arrays=arrays, files=files, meta=meta)


#: The one meta entry a process cannot know of another's manifest: its clock.
_COMMIT_TIME = "created_unix"


def _timeless(meta: dict[str, Any]) -> str:
    return json.dumps({k: v for k, v in meta.items() if k != _COMMIT_TIME},
                      sort_keys=True, default=repr)


def meta_matches(data: bytes, meta: dict[str, Any]) -> bool:
    """Whether manifest bytes ``data`` decode, whole and valid, with metadata ``meta``
    (the commit time aside).

    What a process of a multi-process save that does not hold every part checks:
    its metadata carries the save's random id, which no other save commits.

    Example:
        >>> from statestream.format import ChunkEntry, FileEntry, encode_manifest
        >>> m = merge_trees([RankTree(Node("array", array=0), [ArrayDecl("", "uint8", (4,))])])
        >>> part = RankPart([FileEntry("data/r0-0.bin", 4)],
        ...                 {0: [ChunkEntry(0, 0, 4, 123, (0,), (4,))]})
        >>> meta = {"save_id": "ab", "created_unix": 1.0}
        >>> data = encode_manifest(build_manifest(m, [part], meta))
        >>> meta_matches(data, {"save_id": "ab", "created_unix": 2.0})
        True
        >>> meta_matches(data, {"save_id": "cd"})
        False
    """
    try:
        committed = decode_manifest(data, "the committed manifest")
    except CheckpointError:
        return False
    return _timeless(committed.meta) == _timeless(meta)


def manifest_matches(data: bytes, merged: MergedTree, parts: Sequence[RankPart],
                     meta: dict[str, Any]) -> bool:
    """Whether manifest bytes ``data`` are exactly what these parts build.

    That is the manifest :func:`build_manifest` makes of ``merged``, ``parts``
    and ``meta``, byte for byte -- the same tree and plain values, the same
    data files and sizes, every chunk at the same place with the same
    checksums -- and the same metadata (user metadata included), apart from
    the commit time, which only the committing process knows. Every process
    of a save holds ``merged`` and ``parts``, so a survivor can check what
    the committing process wrote. An older checkpoint differs in some of
    that unless it holds exactly this state.

    Example:
        >>> from statestream.format import ChunkEntry, FileEntry, encode_manifest
        >>> m = merge_trees([RankTree(Node("array", array=0), [ArrayDecl("", "uint8", (4,))])])
        >>> part = RankPart([FileEntry("data/r0-0.bin", 4)],
        ...                 {0: [ChunkEntry(0, 0, 4, 123, (0,), (4,))]})
        >>> data = encode_manifest(build_manifest(m, [part], {"created_unix": 1.0}))
        >>> manifest_matches(data, m, [part], {"created_unix": 2.0})
        True
        >>> manifest_matches(data, m, [part], {"user": {"step": 3}})
        False
    """
    try:
        committed = decode_manifest(data, "the committed manifest")
    except CheckpointError:
        return False
    if _timeless(committed.meta) != _timeless(meta):
        return False
    # the committed meta (its commit time) re-encodes to the very bytes it was read from
    return encode_manifest(build_manifest(merged, parts, committed.meta)) == data
