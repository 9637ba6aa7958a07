"""``load``: read the manifest, match it with the target, read only what is wanted."""

from __future__ import annotations

import functools
import os
import pickle
from collections.abc import Sequence
from typing import Any

from statestream._gc import gc_paused
from statestream.api._builds import (
    adapted_build,
    container_build,
    finish_build,
    keyed_items,
    python_scalar,
    value_of,
)
from statestream.api._castfill import run_cast_fills
from statestream.api._job import Build, _Job, target_shape
from statestream.api._kinds import PLAIN_KINDS, fits
from statestream.api._open import (
    array_paths,
    open_checkpoint,
    read_manifest,
    skip_missing_checksums,
)
from statestream.api._options import (
    bool_option,
    collective_option,
    io_options,
    key_paths,
    max_arrays_option,
    memory_options,
    path_arg,
    progress_option,
)
from statestream.api._pickles import AllowPickle, _PickleTrust
from statestream.api._select import NO_TARGET, PartialTarget, _children, selected
from statestream.api._state_loads import StateLoad, run_state_loads
from statestream.api._target_keys import (
    int_keyed,
    naming_checkpoint,
    prefix_hint,
    refuse_early,
    unprefixed,
    with_target_ties,
)
from statestream.api._targets import (
    dtype_checked,
    number_into_array,
    refuse_array_target,
    refuse_structured,
    saved_plain,
)
from statestream.distributed import Collective, agree, default_collective
from statestream.engine import (
    IOOptions,
    MemoryOptions,
    Progress,
    read_budget,
    read_requests,
    saving_to,
)
from statestream.errors import CheckpointNotFoundError, MissingKeyError, TargetMismatchError
from statestream.format import Manifest
from statestream.plan import ReadPiece, Wanted
from statestream.providers import (
    Destination,
    NumpyProvider,
    StateAdapter,
    adapter_by_name,
    adapter_for,
    provider_by_kind,
    providers,
    target_provider_for,
)
from statestream.storage import CheckpointReader, MappedReader, ReadAhead, storage_for
from statestream.tree import (
    CONTAINER_KINDS,
    Key,
    KeyPath,
    Node,
    format_keypath,
    is_stateful,
    type_name,
)

__all__ = ["array_paths", "files_read", "load", "open_checkpoint", "read_manifest"]

_NUMPY = NumpyProvider()


def _restore_array(node: Node, like: Any, path: KeyPath, m: Manifest, job: _Job,
                   default_kind: str) -> Build:
    assert node.array is not None
    entry = m.arrays[node.array]
    attrs = node.attrs or {}
    scalar = bool(attrs.get("scalar"))
    mapped: Destination | None = None
    if like is NO_TARGET:  # the manifest alone says how much to allocate: check first
        job.check_supply(node.array, entry, path)
        kind = default_kind if default_kind != "saved" else str(attrs.get("kind", "numpy"))
        by_kind = provider_by_kind(kind)
        flat = None if scalar else job.restore_flat(by_kind, node.array, entry, None, path)
        if flat is not None:
            job.paths[node.array] = path
            return functools.partial(value_of, flat)
        mapped = job.restore_mapped(by_kind, node.array, entry, None, path, scalar)
        dest: Destination = mapped or by_kind.restore(entry.dtype, entry.shape, None, path,
                                                      scalar=scalar)
    elif type(like) in (bool, int, float) and entry.shape == ():
        dest = python_scalar(entry.dtype, like, path)
    else:
        prov = target_provider_for(like)
        if prov is None:
            raise TargetMismatchError(
                f"the checkpoint holds an array at key path '{format_keypath(path)}' but the "
                f"target has a {type_name(like)}; pass an array (or jax.ShapeDtypeStruct) "
                "there, or leave the key out of the target"
            )
        want = target_shape(prov, like, path)
        if want != entry.shape:
            raise TargetMismatchError(
                f"shape mismatch at key path '{format_keypath(path)}': the checkpoint has "
                f"{entry.shape} ({entry.dtype}), the target has {want}"
            )
        flat = job.restore_flat(prov, node.array, entry, like, path)
        if flat is not None:
            job.paths[node.array] = path
            return functools.partial(value_of, flat)
        found = job.restore_into(prov, node.array, entry, like, path)
        if found is None and job.cast_into(prov, node.array, entry, like, path):
            job.paths[node.array] = path
            return lambda: like
        if found is None:
            mapped = job.restore_mapped(prov, node.array, entry, like, path, False)
        dest = found or job.copied_in(
            prov, like, mapped or prov.restore(entry.dtype, entry.shape, like, path))
    for start, buf in dest.boxes:
        if buf.size:  # (an empty box has nothing to read: 1M empty arrays, no 1M plans)
            job.wanted.append(Wanted(node.array, start, buf, mapped=mapped is not None))
    job.paths[node.array] = path
    return dest.finish


def _restore_shared(node: Node, like: Any, path: KeyPath, m: Manifest, job: _Job,
                    default_kind: str) -> Build:
    """Restore an array once per (array, target leaf): tied leaves loaded without a
    target, or into the same target object, come back as one value, tied as saved."""
    assert node.array is not None
    kind = default_kind if default_kind != "saved" else str((node.attrs or {}).get("kind"))
    key = (node.array, id(like), kind)
    found = job.shared.get(key)
    if found is not None:
        return found
    finish = _restore_array(node, like, path, m, job, default_kind)
    done: list[Any] = []

    def build() -> Any:
        if not done:
            done.append(finish())
        return done[0]

    job.shared[key] = build
    return build


def _restore_blob(node: Node, path: KeyPath, m: Manifest, job: _Job) -> Build:
    assert node.array is not None
    if node.kind == "pickle" and not job.pickles.trusts(path):
        # refused: remembered (the walk goes on to name them all), never read
        job.pickles.refused.append((path, str((node.attrs or {}).get("type", "?"))))
        return lambda: None
    entry = m.arrays[node.array]
    job.check_supply(node.array, entry, path)
    # A large bytes leaf is read from a mapping of its file where it can be, so that its
    # only anonymous memory is the value returned (read into fresh memory first, it was
    # twice). Never a pickle: the pages of a mapping could change after the checksum
    # pass if the file were written meanwhile, and a pickle must be what was checked.
    mapped = (job.restore_mapped(_NUMPY, node.array, entry, None, path, False)
              if node.kind == "bytes" else None)
    dest = mapped or _NUMPY.restore(entry.dtype, entry.shape, None, path)
    for start, buf in dest.boxes:
        job.wanted.append(Wanted(node.array, start, buf, mapped=mapped is not None))
    job.paths[node.array] = path
    if node.kind == "bytes":
        return lambda: dest.finish().tobytes()
    return lambda: pickle.loads(dest.finish())  # from the checked buffer: no copy of it


def _walk(node: Node, like: Any, path: KeyPath, m: Manifest, job: _Job,
          default_kind: str, merge: bool) -> Build:
    k = node.kind
    if isinstance(like, PartialTarget):  # items= selects some of a module's entries
        build_module = _walk_stateful_target(node, like.module, path, m, job, partial=True)
        return lambda: (build_module(), like.returned)[1]
    if like is None and k != "none":
        # None in a target means "whatever was saved", of the kind it was saved as
        like, default_kind = NO_TARGET, "saved"
    if merge and like is not NO_TARGET and not fits(node, like, m):
        # inside a stateful object the fresh state_dict() is only a hint: a value of
        # another kind (an older torch's float step where a stepped optimizer has a
        # tensor) loads as saved, and its load_state_dict decides
        like, default_kind = NO_TARGET, "saved"
    adapter = adapter_for(like) if like is not NO_TARGET else None
    if adapter is not None:  # a generator, typed key or compiled module as target
        return _walk_adapted(adapter, node, like, path, m, job)
    if k in PLAIN_KINDS or k in ("bytes", "pickle"):
        number = number_into_array(node, like, path, job)
        if number is not None:
            return number
        # a plain target (an int for an int) takes it; an array, object or container
        # target would be returned untouched, its load_state_dict never called
        refuse_structured(like, k, path)
        if k in ("bytes", "pickle"):
            return _restore_blob(node, path, m, job)
        v = node.value
        return lambda: v
    if k in ("array", "alias"):  # an alias: another leaf holding the same array
        if k == "array" and node.array not in job.aliased():  # read by this leaf alone
            return _restore_array(node, like, path, m, job, default_kind)
        return _restore_shared(node, like, path, m, job, default_kind)

    # a stateful target: load its state (all of it), then call load_state_dict
    if like is not NO_TARGET and is_stateful(like) and target_provider_for(like) is None:
        return _walk_stateful_target(node, like, path, m, job)
    if k == "stateful":
        assert node.children
        described = _walk_described(node, like, path, m, job)
        if described is not None:
            return described
        refuse_array_target(node, like, path)
        build_state = _walk(node.children[0], like, path, m, job, default_kind, merge)
        rebuild = adapter_by_name(node.type_name) if like is NO_TARGET else None
        if rebuild is None or default_kind != "saved":
            return build_state
        # None in the target: a generator (or key) comes back as one
        return adapted_build(rebuild, None, build_state, path)

    if like is not NO_TARGET and target_provider_for(like) is not None:
        raise TargetMismatchError(
            f"the target has an array at key path '{format_keypath(path)}' but the checkpoint "
            f"holds a {k} there"
        )

    kids = _children(node)
    if like is NO_TARGET:
        builds = [(key, _walk(c, NO_TARGET, path + (key,), m, job, default_kind, merge))
                  for key, c in kids]
        return container_build(k, NO_TARGET, builds, path)

    # match the target's own keys against the saved node
    if k in ("list", "tuple") and isinstance(like, (list, tuple)) and not hasattr(
        type(like), "_fields"
    ):
        return _walk_sequence(k, kids, like, path, m, job, default_kind, merge)
    return _walk_mapping(k, kids, like, path, m, job, default_kind, merge)


def _walk_stateful_target(node: Node, like: Any, path: KeyPath, m: Manifest,
                          job: _Job, partial: bool = False) -> Build:
    """Load a stateful target's state (all of it; ``partial``: a module's entries that
    items= selects, with ``strict=False``), then call its load_state_dict."""
    inner = node.children[0] if node.kind == "stateful" and node.children else node
    if inner.kind not in CONTAINER_KINDS:  # (a compiled module's, from _walk_adapted)
        refuse_structured(like, inner.kind, path)
    sub_like = like.state_dict()
    named_ties = [names for prov in providers() if prov.capabilities.state_hints
                  for names in prov.tied_names(like)]
    inner = with_target_ties(unprefixed(inner, sub_like), sub_like, named_ties)
    refuse_early(like, sub_like, inner, path, partial=partial)
    options: dict[str, Any] = {"strict": False} if partial else {}
    for prov in providers():
        if prov.capabilities.state_hints:
            hinted = prov.state_hints(like, sub_like, inner, lambda i: m.arrays[i].shape)
            job.layout_only.update(id(h) for h in hinted or ())
            options.update(prov.load_options(like, sub_like))  # a meta module: assign
    # a module's load_state_dict copies; an optimizer (or assign=True) keeps: _Job.adopting
    copies = not options.get("assign") and any(
        prov.is_module(like) for prov in providers() if prov.capabilities.state_hints)
    with job.keeping(not copies):
        build_inner = _walk(inner, sub_like, path, m, job, "saved", True)

    def load_state(value: Any) -> None:
        restore = [r for r in (prov.keep_ties(like, options, named_ties) for prov in providers()
                               if prov.capabilities.state_hints) if r is not None]
        got = like.load_state_dict(value, **options)
        for r in restore:
            r()
        if partial and getattr(got, "unexpected_keys", None):  # a loader of its own
            raise TargetMismatchError(
                f"{type_name(like)}.load_state_dict(strict=False) at key path "
                f"'{format_keypath(path)}' had no place for the selected "
                f"{', '.join(map(repr, got.unexpected_keys))}; the other selected entries "
                "were loaded into it")

    def build_stateful() -> Any:
        # loaded once every value is built (_load): a value that fails to build (a
        # refused pickle, a lossy scalar) then leaves every stateful target as it was
        job.state_loads.append(StateLoad(path, f"{type_name(like)}.load_state_dict()",
                                         functools.partial(load_state, build_inner())))
        return like

    return build_stateful


def _walk_sequence(k: str, kids: list[tuple[Key, Node]], like: Any, path: KeyPath,
                   m: Manifest, job: _Job, default_kind: str, merge: bool) -> Build:
    """Match a list or tuple target item by item against a saved list or tuple."""
    if len(like) != len(kids) and merge:
        # inside a stateful object the fresh state_dict() is only a hint (a history
        # list may have grown since): load what was saved
        builds = [(i, _walk(c, NO_TARGET, path + (i,), m, job, "saved", merge))
                  for i, c in kids]
        return container_build(k, NO_TARGET, builds, path)
    if len(like) != len(kids):
        raise TargetMismatchError(
            f"length mismatch at key path '{format_keypath(path)}': the checkpoint has a "
            f"{k} of {len(kids)} items, the target has {len(like)}"
        )
    builds = [(i, _walk(c, t, path + (i,), m, job, default_kind, merge))
              for (i, c), t in zip(kids, like)]
    return container_build(k, like, builds, path)


def _walk_mapping(k: str, kids: list[tuple[Key, Node]], like: Any, path: KeyPath,
                  m: Manifest, job: _Job, default_kind: str, merge: bool) -> Build:
    """Match a keyed target (dict, namedtuple, dataclass, pytree) against the saved node."""
    target_items, rebuild = keyed_items(like, path, k)
    saved = {(type(key), key): c for key, c in kids}
    builds = []
    renamed: dict[tuple[type, Key], Key] = {}  # saved key -> the target's, if they differ
    for key, t in target_items:
        c = saved.get((type(key), key))
        if c is None and type(key) is int and job.str_keyed:  # DCP, Orbax: "0" for 0
            c = saved.get((str, str(key)))
            renamed[(str, str(key))] = key
        if c is None and merge:  # in a stateful object: its load_state_dict decides
            continue  # (a key an older version lacks: Adam's decoupled_weight_decay)
        if c is None:
            avail = ", ".join(repr(x) for x, _ in kids[:20])
            raise MissingKeyError(
                f"key path '{format_keypath(path + (key,))}' is in the target but not in the "
                f"checkpoint (it has: {avail}{', ...' if len(kids) > 20 else ''}); "
                f"{prefix_hint(key, saved) or 'remove it from the target'}"
            )
        builds.append((key, _walk(c, t, path + (key,), m, job, default_kind, merge)))
    if merge:  # in a stateful object, also what the target lacks, in the saved order
        by_key = {(type(k), k): b for k, b in builds}
        builds = []
        ints = job.str_keyed and int_keyed(kids, target_items)
        for key, c in kids:
            key = int(key) if ints else renamed.get((type(key), key), key)
            b = by_key.get((type(key), key))
            if b is None:
                b = _walk(c, NO_TARGET, path + (key,), m, job, "saved", merge)
            builds.append((key, b))
    return finish_build(rebuild, builds)


def _walk_adapted(adapter: StateAdapter, node: Node, like: Any, path: KeyPath, m: Manifest,
                  job: _Job) -> Build:
    """Load a value that a state adapter restores (its saved state is a stateful node,
    or a plain state_dict when the adapter's value wraps a stateful object)."""
    inner_like = adapter.wrapped(like)
    if inner_like is not None and (node.kind != "stateful"
                                   or adapter_by_name(node.type_name) is None):
        # a compiled module: loads as the module it wraps, a saved module or its
        # state_dict() (refused early, its load_state_dict once every value is built)
        build_wrapped = _walk_stateful_target(node, inner_like, path, m, job)
        return lambda: (build_wrapped(), like)[1]
    if adapter.plain_state and node.kind != "stateful":  # an nnx.state saved as it is
        inner = _walk(node, adapter.target_state(like), path, m, job, "saved", False)
        return adapted_build(adapter, like, inner, path, job.state_loads.append)
    if node.kind != "stateful" or not node.children or (
            adapter.name and node.type_name != adapter.name):
        saved = node.type_name if node.kind == "stateful" else node.kind
        raise TargetMismatchError(
            f"the target has a {type_name(like)} at key path '{format_keypath(path)}' but the "
            f"checkpoint holds a {saved} there"
        )
    adapter.refuse_saved(saved_plain(node.children[0]), like, path)
    sub_like = adapter.target_state(like)
    inner = _walk(node.children[0], sub_like, path, m, job, "saved", True)
    return adapted_build(adapter, like, inner, path, job.state_loads.append)


def _walk_described(node: Node, like: Any, path: KeyPath, m: Manifest,
                    job: _Job) -> Build | None:
    """A saved generator or key whose target only describes one (a typed JAX key as
    a ``jax.ShapeDtypeStruct``): its state loads as the adapter says, and the value is
    built new. None for any other target."""
    named = adapter_by_name(node.type_name) if like is not NO_TARGET else None
    if named is None or not node.children:
        return None
    sub_like = named.abstract_state(like)
    if sub_like is None:
        return None
    named.refuse_saved(saved_plain(node.children[0]), like, path)
    inner = _walk(node.children[0], sub_like, path, m, job, "saved", True)
    return dtype_checked(adapted_build(named, None, inner, path), like, path)


def load(
    path: str | os.PathLike[str],
    target: Any = None,
    *,
    items: Sequence[str] | None = None,
    allow_pickle: AllowPickle = False,
    in_place: bool = False,
    io: IOOptions | None = None,
    memory: MemoryOptions | None = None,
    progress: Progress | None = None,
    collective: Collective | None = None,
    max_arrays: int | None = None,
) -> Any:
    """Load a checkpoint, verifying every chunk's checksum.

    Args:
        path: a checkpoint directory written by :func:`save`.
        target: optional tree like the saved one. Its leaves say what to
            return: torch tensors stay torch (target dtype and device; the CPU
            for a meta target, a meta DTensor's mesh's device), JAX arrays stay
            JAX (target sharding), NumPy stays NumPy; objects with
            ``load_state_dict`` get their state loaded (meta modules with
            ``assign=True``) once every value is built, in tree order (a refusal then
            names those loaded before it), and are returned. A partial target, that
            part. Without a target: NumPy arrays and plain dicts/lists/tuples.
        items: key paths to load (``"model"``, ``"model/layers.0.weight"``; ``~1`` for ``/``
            in a key): top-level checkpointables, subtrees or leaves; others are not read, and
            levels above one come back as dicts of only what was selected. ``0`` names the key
            0 or ``"0"``; a dict with both refuses it (a target with the typed key picks one).
            A target module's entries load into it (strict=False); an optimizer's: refused.
        allow_pickle: which pickled leaves (saved with ``pickle_paths``) may be unpickled, which
            runs code: only for a checkpoint you trust. ``False`` (default): none; key paths
            (``["extra/tok"]``): the pickle leaves at or under them, as ``pickle_paths`` matches;
            ``True``: every pickle leaf. One not allowed raises before anything is read.
        in_place: write into the target's own tensors/arrays (DTensors' local shards) and
            return them, as DCP does: contiguous CPU ones of the saved dtype are read into
            (no extra memory; a load failing part-way leaves them partly written), others
            (strided, neg/conj views, another dtype, a GPU) get ``copy_()`` once all was
            read and checked; unwritable ones (read-only, JAX, meta) get new values; a
            DTensor whose local tensor is too small for its shard is refused. Tied
            weights get the later key's bytes; torch version counters move as ``copy_()``
            moves them. Without it, target arrays and tensors are never written.
        io, memory: thread count and request sizes; the host scratch budget (docs/async.md).
        progress: called as ``progress(bytes_done, bytes_total)`` while reading.
        collective: in a multi-process job every process loads (each reads
            only the bytes its target's shards need) and an error on any of
            them is raised on all, naming it. Defaults like :func:`save`; pass
            ``SingleProcess()`` to load on one process of a running job.
        max_arrays: refuse a manifest (a base's too) of more arrays (default: the format's 2^24).

    Returns the restored state.

    Raises:
        CheckpointNotFoundError: no committed checkpoint at ``path``.
        CheckpointCorruptError: a checksum, size or manifest check failed (named).
        MissingKeyError: the target or ``items`` names a key not saved, or two alike.
        TargetMismatchError: a shape or structure differs from the target (named).
        PickleNotAllowedError: a pickled leaf that ``allow_pickle`` does not allow.
        CheckpointError: more arrays than ``max_arrays``.

    Example:
        >>> import numpy as np, tempfile, os, statestream as ss
        >>> d = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> ss.save(d, {"params": {"w": np.ones(2)}, "opt": {"m": np.zeros(2)}})
        >>> ss.load(d, items=["params"])
        {'params': {'w': array([1., 1.])}}
    """
    coll = collective_option(collective) if collective is not None else default_collective()
    result: Any = None
    err: BaseException | None = None
    with gc_paused():
        try:
            result = _load(path, target, items, allow_pickle, bool_option(in_place, "in_place"),
                           io, memory, progress, max_arrays_option(max_arrays))
        except BaseException as exc:
            if coll.world_size == 1:
                raise
            err = exc
    agree(coll, "loading", err, outcome="no process returns a result")
    return result


def files_read(m: Manifest, target: Any = None, *, items: Sequence[str] | None = None,
               allow_pickle: AllowPickle = False, where: str = "the checkpoint"
               ) -> dict[str, set[int]]:
    """Which data files :func:`load` of ``m`` into ``target`` reads, found without
    reading anything: checkpoint -> indices of its manifest's ``files``.

    ``m`` is a manifest as stored (references not followed): ``""`` is the
    checkpoint itself; a base's name (a reference's ``base``) maps to indices into
    *that base's* files. The walk is :func:`load`'s on the manifest alone: it
    allocates the destinations (untouched, then dropped), maps and reads nothing.
    A target that does not match raises as :func:`load` would.
    """
    root, like = selected(m, target, items, where)
    job = _Job(pickles=_PickleTrust(allow_pickle), file_names=[f.name for f in m.files],
               manifest=m)
    _walk(root, like, (), m, job, "numpy", False)
    job.plan_wanted()
    out: dict[str, set[int]] = {}
    for p in job.plan.pieces.values():
        c = m.arrays[p.array].chunks[p.chunk]
        out.setdefault("" if c.ref is None else c.ref.base, set()).add(c.file)
    return out


def _open_loaded(path: str | os.PathLike[str], trust: _PickleTrust, max_arrays: int
                 ) -> tuple[CheckpointReader, Manifest]:
    """:func:`open_checkpoint` for a load; a checkpoint not there yet because the
    ``save_async`` in flight is still writing it is named as such."""
    try:
        return open_checkpoint(path, allow_pickle=trust.all, max_arrays=max_arrays)
    except CheckpointNotFoundError as exc:
        if not saving_to(storage_for(path)[1]):
            raise
        raise CheckpointNotFoundError(
            f"{exc}; a save_async to it is in flight in this process and has not "
            "committed yet: nothing was loaded (wait for its handle's result() first)"
        ) from exc


def _default_io(path: str | os.PathLike[str]) -> IOOptions:
    """Engine options when the caller gives none: the backend's read preferences."""
    caps = storage_for(path)[0].capabilities
    kw: dict[str, Any] = {}
    if caps.read_request_bytes:
        kw["max_request_bytes"] = caps.read_request_bytes
    if caps.read_threads:
        kw["num_threads"] = caps.read_threads
    return IOOptions(**kw)


def _load(
    path: str | os.PathLike[str],
    target: Any,
    items: Sequence[str] | None,
    allow_pickle: AllowPickle,
    in_place: bool,
    io: IOOptions | None,
    memory: MemoryOptions | None,
    progress: Progress | None,
    max_arrays: int,
) -> Any:
    path, items = path_arg(path, "path"), key_paths(items, "items")
    trust = _PickleTrust(allow_pickle)
    io = io_options(io) if io is not None else _default_io(path)
    memory, progress = memory_options(memory), progress_option(progress)
    reader, m = _open_loaded(path, trust, max_arrays)
    with naming_checkpoint(reader.location):  # a target that does not fit: where
        try:
            root, like = selected(m, target, items, reader.location)
            names = [f.name for f in m.files]
            local = reader if isinstance(reader, MappedReader) else None
            job = _Job(pickles=trust, in_place=in_place, reader=reader,
                       file_names=names, manifest=m, maps=io.map_files and local is not None,
                       # drop-behind lets go only of pages that were not cached before the
                       # load: it must see the cache as the walk left it
                       ahead=ReadAhead(local) if local is not None and not io.drop_behind
                       else None)
            try:
                build = _walk(root, like, (), m, job, "numpy", False)
            finally:
                if job.ahead is not None:
                    job.ahead.close()
            job.pickles.check(reader.location)  # every leaf seen; nothing read or unpickled
            job.plan_wanted()
            job.before_fill()  # torch: version counters move before a byte is written
            requests = job.plan.requests(max_request_bytes=io.max_request_bytes)
            skip_missing_checksums(reader, requests)

            def describe(p: ReadPiece) -> str:
                return f"array at key path '{format_keypath(job.paths.get(p.array, ()))}'"

            read_requests(reader, names, requests, options=io,
                          budget=read_budget(memory), describe=describe,
                          progress=progress)
            job.own.copy_back()  # in-place targets sharing memory: what was read apart
            run_cast_fills(job.casts, reader, m, names, io, memory, describe)
        finally:
            reader.close()
        out = build()
        run_state_loads(job.state_loads, in_place)  # every value is built: load_state_dict
    return out

