"""``load``: read the manifest, match it with the target, read only what is wanted."""

from __future__ import annotations

import dataclasses
import os
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from statestream._gc import gc_paused
from statestream.distributed import Collective, agree, default_collective
from statestream.engine import ByteBudget, IOOptions, MemoryOptions, Progress, read_requests
from statestream.errors import (
    CheckpointCorruptError,
    MissingKeyError,
    PickleNotAllowedError,
    TargetMismatchError,
)
from statestream.format import (
    COMMIT_NAME,
    MANIFEST_NAME,
    MAX_COMMIT_BYTES,
    MAX_MANIFEST_BYTES,
    Manifest,
    checksum,
    decode_commit,
    decode_manifest,
    dtype_from_name,
)
from statestream.interop import FileSetReader, open_foreign
from statestream.plan import ReadPiece, ReadRequest, Wanted, plan_load
from statestream.providers import (
    Destination,
    NumpyProvider,
    expand_pytree,
    provider_by_kind,
    providers,
    rebuild_pytree,
    target_provider_for,
)
from statestream.storage import CheckpointReader, storage_for
from statestream.tree import (
    Key,
    KeyPath,
    Node,
    format_keypath,
    is_stateful,
    rebuild_container,
    state_fields,
    type_name,
)

__all__ = ["load", "open_checkpoint", "read_manifest"]

_NUMPY = NumpyProvider()
Build = Callable[[], Any]


class _NoTarget:
    def __repr__(self) -> str:
        return "<no target>"


NO_TARGET: Any = _NoTarget()


def read_manifest(reader: CheckpointReader) -> Manifest:
    """Read and verify the commit marker and manifest of an open checkpoint."""
    where = f"{reader.location}/{MANIFEST_NAME}"
    size, crc = decode_commit(
        reader.read_bytes(COMMIT_NAME, MAX_COMMIT_BYTES), f"{reader.location}/{COMMIT_NAME}"
    )
    data = reader.read_bytes(MANIFEST_NAME, MAX_MANIFEST_BYTES)
    if len(data) != size or checksum(data) != crc:
        raise CheckpointCorruptError(
            f"manifest {where} does not match its commit marker (size {len(data)} vs {size}, "
            "or checksum differs); the checkpoint is corrupt"
        )
    return decode_manifest(data, where)


def skip_missing_checksums(reader: CheckpointReader, requests: list[ReadRequest]) -> None:
    """Foreign formats carry no checksums: their reads check sizes and bounds only."""
    if isinstance(reader, FileSetReader):
        for r in requests:
            for p in r.pieces:
                p.verify = []


def open_checkpoint(path: str | os.PathLike[str], *, allow_pickle: bool = False
                    ) -> tuple[CheckpointReader, Manifest]:
    """Open the committed checkpoint at ``path`` and read its verified manifest.

    A foreign checkpoint (safetensors, ...; see docs/interop.md) is recognised
    by its content and comes back as a manifest its parser built
    (``allow_pickle``: see torch.save files there).
    """
    foreign = open_foreign(path, allow_pickle=allow_pickle)
    if foreign is not None:
        return foreign.reader, foreign.manifest
    storage, spath = storage_for(path)
    reader = storage.open_read(spath)
    try:
        return reader, read_manifest(reader)
    except BaseException:
        reader.close()
        raise


@dataclasses.dataclass
class _Job:
    """Everything the walk of manifest + target asks the engine to read."""

    allow_pickle: bool
    in_place: bool = False
    wanted: list[Wanted] = dataclasses.field(default_factory=list)
    paths: dict[int, KeyPath] = dataclasses.field(default_factory=dict)


def _restore_array(node: Node, like: Any, path: KeyPath, m: Manifest, job: _Job,
                   default_kind: str) -> Build:
    assert node.array is not None
    entry = m.arrays[node.array]
    attrs = node.attrs or {}
    scalar = bool(attrs.get("scalar"))
    if like is NO_TARGET:
        kind = default_kind if default_kind != "saved" else str(attrs.get("kind", "numpy"))
        dest: Destination = provider_by_kind(kind).restore(entry.dtype, entry.shape, None, path,
                                                           scalar=scalar)
    elif type(like) in (bool, int, float) and entry.shape == ():
        dest = _python_scalar(entry.dtype, like, path)
    else:
        prov = target_provider_for(like)
        if prov is None:
            raise TargetMismatchError(
                f"the checkpoint holds an array at key path '{format_keypath(path)}' but the "
                f"target has a {type_name(like)}; pass an array (or jax.ShapeDtypeStruct) "
                "there, or leave the key out of the target"
            )
        want = prov.target_shape(like)
        if want != entry.shape:
            raise TargetMismatchError(
                f"shape mismatch at key path '{format_keypath(path)}': the checkpoint has "
                f"{entry.shape} ({entry.dtype}), the target has {want}"
            )
        found = (prov.restore_into(entry.dtype, entry.shape, like, path)
                 if job.in_place and prov.capabilities.in_place_restore else None)
        dest = found if found is not None else prov.restore(entry.dtype, entry.shape, like, path)
    for start, buf in dest.boxes:
        job.wanted.append(Wanted(node.array, start, buf))
    job.paths[node.array] = path
    return dest.finish


def _python_scalar(dtype: str, like: Any, path: KeyPath) -> Destination:
    """A saved 0-d array into a Python number target (a fresh flax TrainState's ``step=0``).

    Only where no value changes: an integer or bool array into an int, a bool
    into a bool, any real number into a float.
    """
    want = type(like)
    kind = np.dtype(dtype_from_name(dtype)).kind
    if kind not in {bool: "b", int: "biu", float: "biuf"}[want]:
        raise TargetMismatchError(
            f"the checkpoint holds a 0-d {dtype} array at key path '{format_keypath(path)}' "
            f"but the target has a Python {want.__name__}; pass an array there"
        )
    dest = _NUMPY.restore(dtype, (), None, path)
    return Destination(boxes=dest.boxes, finish=lambda: want(dest.finish().item()))


def _restore_blob(node: Node, path: KeyPath, m: Manifest, job: _Job) -> Build:
    assert node.array is not None
    if node.kind == "pickle" and not job.allow_pickle:
        t = (node.attrs or {}).get("type", "?")
        raise PickleNotAllowedError(
            f"key path '{format_keypath(path)}' holds a pickled {t}; unpickling can run "
            "arbitrary code, so pass allow_pickle=True only if you trust this checkpoint"
        )
    entry = m.arrays[node.array]
    dest = _NUMPY.restore(entry.dtype, entry.shape, None, path)
    for start, buf in dest.boxes:
        job.wanted.append(Wanted(node.array, start, buf))
    job.paths[node.array] = path
    if node.kind == "bytes":
        return lambda: dest.finish().tobytes()
    return lambda: pickle.loads(dest.finish().tobytes())


def _children(node: Node) -> list[tuple[Key, Node]]:
    kids = node.children or []
    if node.keys is None:
        return list(enumerate(kids))
    return list(zip(node.keys, kids))


def _walk(node: Node, like: Any, path: KeyPath, m: Manifest, job: _Job,
          default_kind: str, merge: bool) -> Build:
    k = node.kind
    if like is None and k != "none":
        like = NO_TARGET  # None in a target means "whatever was saved"
    if k in ("none", "bool", "int", "float", "str"):
        if like is not NO_TARGET and target_provider_for(like) is not None:
            raise TargetMismatchError(
                f"the target has an array at key path '{format_keypath(path)}' but the "
                f"checkpoint holds a {k} there"
            )
        v = node.value
        return lambda: v
    if k == "array":
        return _restore_array(node, like, path, m, job, default_kind)
    if k in ("bytes", "pickle"):
        return _restore_blob(node, path, m, job)

    # a stateful target: load its state (all of it), then call load_state_dict
    if like is not NO_TARGET and is_stateful(like) and target_provider_for(like) is None:
        inner = node.children[0] if k == "stateful" and node.children else node
        sub_like = like.state_dict()
        for prov in providers():
            if prov.capabilities.state_hints:
                prov.state_hints(like, sub_like, inner, lambda i: m.arrays[i].shape)
        build_inner = _walk(inner, sub_like, path, m, job, "saved", True)

        def build_stateful() -> Any:
            value = build_inner()
            try:
                like.load_state_dict(value)
            except Exception as exc:
                raise TargetMismatchError(
                    f"{type_name(like)}.load_state_dict() at key path "
                    f"'{format_keypath(path)}' rejected the checkpoint's state: {exc}"
                ) from exc
            return like

        return build_stateful
    if k == "stateful":
        assert node.children
        return _walk(node.children[0], like, path, m, job, default_kind, merge)

    if like is not NO_TARGET and target_provider_for(like) is not None:
        raise TargetMismatchError(
            f"the target has an array at key path '{format_keypath(path)}' but the checkpoint "
            f"holds a {k} there"
        )

    kids = _children(node)
    if like is NO_TARGET:
        builds = [(key, _walk(c, NO_TARGET, path + (key,), m, job, default_kind, merge))
                  for key, c in kids]
        return _container_build(k, NO_TARGET, builds, path)

    # match the target's own keys against the saved node
    if k in ("list", "tuple") and isinstance(like, (list, tuple)) and not hasattr(
        type(like), "_fields"
    ):
        if len(like) != len(kids) and merge:
            # inside a stateful object the fresh state_dict() is only a hint (a history
            # list may have grown since): load what was saved
            builds = [(i, _walk(c, NO_TARGET, path + (i,), m, job, "saved", merge))
                      for i, c in kids]
            return _container_build(k, NO_TARGET, builds, path)
        if len(like) != len(kids):
            raise TargetMismatchError(
                f"length mismatch at key path '{format_keypath(path)}': the checkpoint has a "
                f"{k} of {len(kids)} items, the target has {len(like)}"
            )
        builds = [(i, _walk(c, t, path + (i,), m, job, default_kind, merge))
                  for (i, c), t in zip(kids, like)]
        return _container_build(k, like, builds, path)

    target_items, rebuild = _target_items(like, path)
    saved = {(type(key), key): c for key, c in kids}
    builds = []
    seen = set()
    for key, t in target_items:
        c = saved.get((type(key), key))
        if c is None:
            avail = ", ".join(repr(x) for x, _ in kids[:20])
            raise MissingKeyError(
                f"key path '{format_keypath(path + (key,))}' is in the target but not in the "
                f"checkpoint (it has: {avail}{', ...' if len(kids) > 20 else ''}); remove it "
                "from the target"
            )
        seen.add((type(key), key))
        builds.append((key, _walk(c, t, path + (key,), m, job, default_kind, merge)))
    if merge:  # inside a stateful object, keep what the target does not mention,
        # in the order the checkpoint has it (a state_dict's order can matter)
        by_key = {(type(k), k): b for k, b in builds}
        builds = []
        for key, c in kids:
            b = by_key.get((type(key), key))
            if b is None:
                b = _walk(c, NO_TARGET, path + (key,), m, job, "saved", merge)
            builds.append((key, b))
    return _finish_build(rebuild, builds)


def _target_items(like: Any, path: KeyPath) -> tuple[list[tuple[Key, Any]], Any]:
    """The target's (key, sub-target) pairs and how to rebuild it."""
    if isinstance(like, dict):
        return list(like.items()), ("container", like)
    if isinstance(like, tuple) and hasattr(type(like), "_fields"):
        fields: tuple[str, ...] = type(like)._fields  # type: ignore[attr-defined]
        return list(zip(fields, like)), ("container", like)
    if dataclasses.is_dataclass(like) and not isinstance(like, type):
        # static fields (flax's pytree_node=False) are not state: the target's stay
        return [(f.name, getattr(like, f.name)) for f in state_fields(like)], (
            "container", like)
    exp = expand_pytree(like)
    if exp is not None:
        return list(zip(exp.keys, exp.children)), ("pytree", like)
    raise TargetMismatchError(
        f"the target at key path '{format_keypath(path)}' is a {type_name(like)}, but the "
        "checkpoint holds a container there"
    )


def _finish_build(rebuild: Any, builds: list[tuple[Key, Build]]) -> Build:
    how, like = rebuild

    def build() -> Any:
        keys = [k for k, _ in builds]
        values = [b() for _, b in builds]
        if how == "pytree":
            return rebuild_pytree(like, values)
        if isinstance(like, dict):
            return rebuild_container("dict", like, keys, values, ())
        return rebuild_container("dict", like, keys, values, ())

    return build


def _container_build(kind: str, like: Any, builds: list[tuple[Key, Build]],
                     path: KeyPath) -> Build:
    def build() -> Any:
        keys = [k for k, _ in builds]
        values = [b() for _, b in builds]
        return rebuild_container(kind, None if like is NO_TARGET else like, keys, values, path)

    return build


def _select(root: Node, items: Sequence[str], path: str) -> Node:
    """Restrict the root to the checkpointables named in ``items``."""
    node = root.children[0] if root.kind == "stateful" and root.children else root
    if node.keys is None:
        raise MissingKeyError(
            f"items= selects top-level keys, but the state saved at {path} is a {node.kind} "
            "without keys; load it whole"
        )
    by_key = {k: c for k, c in zip(node.keys, node.children or [])}
    keys: list[Key] = []
    kids: list[Node] = []
    for it in items:
        if it not in by_key:
            raise MissingKeyError(
                f"checkpoint {path} has no item {it!r}; it has: "
                + ", ".join(repr(k) for k in node.keys)
            )
        keys.append(it)
        kids.append(by_key[it])
    return Node("dict", keys=keys, children=kids)


def load(
    path: str | os.PathLike[str],
    target: Any = None,
    *,
    items: Sequence[str] | None = None,
    allow_pickle: bool = False,
    in_place: bool = False,
    io: IOOptions | None = None,
    memory: MemoryOptions | None = None,
    progress: Progress | None = None,
    collective: Collective | None = None,
) -> Any:
    """Load a checkpoint, verifying every chunk's checksum.

    Args:
        path: a checkpoint directory written by :func:`save`.
        target: optional tree like the saved one. Its leaves say what to
            return: torch tensors stay torch (target dtype and device), JAX
            arrays stay JAX (target sharding), NumPy stays NumPy; objects with
            ``load_state_dict`` get their state loaded and are returned. A
            target covering part of the checkpoint loads only that part.
            Without a target: NumPy arrays and plain dicts/lists/tuples.
        items: top-level keys (checkpointables) to load; others are not read.
        allow_pickle: permit unpickling leaves saved with ``pickle_paths``.
        in_place: read straight into the target's own CPU tensors/arrays (and
            DTensor local shards) when their dtype matches and they are
            contiguous, and return those same objects — as DCP does. Faster
            (no fresh memory to fault in) and no extra memory, but a load that
            fails part-way (a corrupt chunk) leaves the target partly
            overwritten. Without it, targets are never modified.
        io: thread count and request sizes.
        memory: the host scratch budget.
        progress: called as ``progress(bytes_done, bytes_total)`` while reading.
        collective: in a multi-process job every process loads (each reads
            only the bytes its target's shards need) and an error on any of
            them is raised on all, naming it. Defaults like :func:`save`; pass
            ``SingleProcess()`` to load on one process of a running job.

    Returns:
        The restored state.

    Raises:
        CheckpointNotFoundError: no committed checkpoint at ``path``.
        CheckpointCorruptError: a checksum, size or manifest check failed
            (the message names the key path and file).
        MissingKeyError: the target or ``items`` names a key not saved.
        TargetMismatchError: a shape or structure differs from the target.
        PickleNotAllowedError: a pickled leaf and ``allow_pickle`` is false.

    Example:
        >>> import numpy as np, tempfile, os, statestream as ss
        >>> d = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> ss.save(d, {"params": {"w": np.ones(2)}, "opt": {"m": np.zeros(2)}})
        >>> ss.load(d, items=["params"])
        {'params': {'w': array([1., 1.])}}
    """
    coll = collective if collective is not None else default_collective()
    result: Any = None
    err: BaseException | None = None
    with gc_paused():
        try:
            result = _load(path, target, items, allow_pickle, in_place, io or _default_io(path),
                           memory or MemoryOptions(), progress)
        except BaseException as exc:
            if coll.world_size == 1:
                raise
            err = exc
    agree(coll, "loading", err, outcome="no process returns a result")
    return result


def _default_io(path: str | os.PathLike[str]) -> IOOptions:
    """Engine options when the caller gives none: the backend's read preferences."""
    caps = storage_for(path)[0].capabilities
    kw: dict[str, int] = {}
    if caps.read_request_bytes:
        kw["max_request_bytes"] = caps.read_request_bytes
    if caps.read_threads:
        kw["num_threads"] = caps.read_threads
    return IOOptions(**kw)


def _load(
    path: str | os.PathLike[str],
    target: Any,
    items: Sequence[str] | None,
    allow_pickle: bool,
    in_place: bool,
    io: IOOptions,
    memory: MemoryOptions,
    progress: Progress | None,
) -> Any:
    reader, m = open_checkpoint(path, allow_pickle=allow_pickle)
    try:
        root = m.tree
        like = NO_TARGET if target is None else target
        if items is not None:
            root = _select(root, list(items), reader.location)
            if like is not NO_TARGET:
                if not isinstance(like, dict):
                    raise TargetMismatchError(
                        "with items=, the target must be a dict keyed by those items"
                    )
                like = {k: like[k] for k in items if k in like}
                missing = [k for k in items if k not in like]
                if missing:  # items without a target entry load with defaults
                    full = {k: like.get(k, NO_TARGET) for k in items}
                    like = full
        job = _Job(allow_pickle=allow_pickle, in_place=in_place)
        build = _walk(root, like, (), m, job, "numpy", False)
        requests = plan_load(m.arrays, job.wanted, max_request_bytes=io.max_request_bytes)
        skip_missing_checksums(reader, requests)
        names = [f.name for f in m.files]

        def describe(p: ReadPiece) -> str:
            return f"array at key path '{format_keypath(job.paths.get(p.array, ()))}'"

        read_requests(reader, names, requests, options=io,
                      budget=ByteBudget(memory.resolved()), describe=describe,
                      progress=progress)
    finally:
        reader.close()
    return build()

