"""``statestream diff``: added, removed and changed keys of two checkpoints, any formats.

Streams: the trees come from metadata; arrays are read in small batches
(``items=`` naming them, at most :data:`BATCH_BYTES` or one array per side),
never the whole state, and compared :data:`BLOCK_ELEMENTS` elements at a time.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

import numpy as np

import statestream as ss
from statestream.api._inspect import leaf_paths
from statestream.cli._main import (
    add_max_arrays,
    add_memory_budget,
    int_text,
    json_text,
    memory_options,
    nonnegative,
    path_arg,
    safe,
)
from statestream.cli._progress import progress_bar
from statestream.tree import KeyPath, format_keypath, parse_keypath

__all__ = ["add_parser", "diff"]

EXAMPLE = """examples:
  statestream diff ckpts/step_0000001000 ckpts/step_0000002000
  statestream diff model.safetensors ckpts/step_0000001000 --atol 1e-6 --json
exit status: 0 equal, 1 different, 2 error
"""


def _numeric(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """ml_dtypes arrays (bfloat16, float8_*: NumPy kind 'V') as float32, to subtract."""
    if x.dtype.kind == "V" and x.dtype.names is None:
        try:
            return x.astype(np.float32)
        except (TypeError, ValueError):
            return x
    return x


def _dig(tree: Any, path: tuple[Any, ...]) -> Any:
    """The leaf at ``path`` (its keys as saved: ``""`` and ``"<root>"`` are keys, not the
    root, as they are in a key path parsed back)."""
    for k in path:
        if isinstance(tree, (list, tuple)):
            tree = tree[int(k)]
        else:  # items= returns a list's selected elements as a dict keyed by index
            tree = tree[k] if k in tree else tree[int(k)]
    return tree


def _as_numpy(leaf: Any) -> np.ndarray[Any, Any]:
    if hasattr(leaf, "detach"):  # a torch tensor (duck-typed: cli/ imports no framework)
        t = leaf.detach().cpu()
        try:
            return np.asarray(t.numpy())
        except TypeError:  # bfloat16 / float8: NumPy has no such dtype; compare as float32
            return np.asarray(t.float().numpy())
    return np.asarray(leaf)  # ml_dtypes arrays go to float32 block by block (_largest)


#: Arrays of one side read together in one ``load`` (one array alone may be larger).
BATCH_BYTES = 64 << 20


class _Side:
    """Serves one checkpoint's arrays in the order they are asked for, reading them in
    batches of at most :data:`BATCH_BYTES` (or one array) and dropping each batch after."""

    def __init__(self, path: str, order: list[tuple[str, int]], allow_pickle: bool,
                 batch_bytes: int = BATCH_BYTES,
                 memory: ss.MemoryOptions | None = None,
                 keys: dict[str, KeyPath] | None = None,
                 max_arrays: int | None = None) -> None:
        self.path, self.order, self.allow_pickle = path, order, allow_pickle
        self.max_arrays = max_arrays  # each read's bound, as its metadata's
        self.keys = keys or {}  # key path -> its keys (else parsed from the key path)
        self.batch_bytes, self.memory = batch_bytes, memory
        self.pos = 0
        self.batch: dict[str, np.ndarray[Any, Any]] = {}

    def get(self, key: str) -> np.ndarray[Any, Any]:
        if key not in self.batch:
            self.batch = {}  # free the previous batch before reading the next
            keys: list[str] = []
            size = 0
            while self.pos < len(self.order):
                k, n = self.order[self.pos]
                if keys and size + n > self.batch_bytes:
                    break
                keys.append(k)
                size += n
                self.pos += 1
            paths = {k: self.keys.get(k) or parse_keypath(k) for k in keys}
            # a top-level key such as "/" has the key path "~1", which items= reads as
            # the top-level key "~1" where there is one: such a key is read by a target
            alone = [p for k, p in paths.items() if len(p) == 1 and p[0] != k]
            named = [k for k in keys if paths[k] and paths[k] not in alone]
            tree: dict[Any, Any] = {}
            if named:
                tree.update(ss.load(self.path, items=named,
                                    allow_pickle=self.allow_pickle, memory=self.memory,
                                    max_arrays=self.max_arrays))
            if alone:
                tree.update(ss.load(self.path, target={p[0]: None for p in alone},
                                    allow_pickle=self.allow_pickle, memory=self.memory,
                                    max_arrays=self.max_arrays))
            if any(not p for p in paths.values()):  # the root is the one array (a lone
                # array saved): no items= names it (it was an error, "empty key path")
                whole = ss.load(self.path, allow_pickle=self.allow_pickle, memory=self.memory,
                                max_arrays=self.max_arrays)
            self.batch = {k: _as_numpy(_dig(tree, paths[k]) if paths[k] else whole)
                          for k in keys}
        return self.batch.pop(key)


def _int_distance(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """``|a - b|`` of two integer arrays of one dtype, exact (as uint64): float64 holds
    integers exactly only up to 2**53, so two int64 ids 2**60 and 2**60 + 1 would
    compare equal, and ``a - b`` in the arrays' own dtype can overflow. The difference
    of the larger and the smaller lies in [0, 2**64), which uint64 arithmetic (modulo
    2**64) gives exactly."""
    if a.dtype.kind == "b":
        a, b = a.astype(np.uint8), b.astype(np.uint8)
    hi, lo = np.maximum(a, b), np.minimum(a, b)
    d: np.ndarray[Any, Any] = hi.astype(np.uint64) - lo.astype(np.uint64)
    return d


def _largest_int(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any],
                 atol: float, rtol: float) -> tuple[bool, float | None]:
    """:func:`_largest` of two integer arrays of one dtype, exactly."""
    d = _int_distance(a, b)
    if not d.size:
        return True, 0.0
    bound = atol + rtol * np.abs(b.astype(np.float64))
    ok = bool(np.all((d == 0) | (d.astype(np.float64) <= bound)))
    return ok, float(d.max())


def _largest_block(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any],
                   atol: float, rtol: float) -> tuple[bool, float | None]:
    """(equal within tolerance, largest absolute difference or None if not numeric)."""
    if a.dtype == b.dtype and a.dtype.kind in "iub":
        return _largest_int(a, b, atol, rtol)
    if a.dtype.kind in "fciub" and b.dtype.kind in "fciub":
        x, y = a.astype(np.float64) if a.dtype.kind != "c" else a, \
            b.astype(np.float64) if b.dtype.kind != "c" else b
        # equal elements (an infinity on both sides too: inf - inf is NaN) and NaN
        # on both sides are distance 0
        same = (x == y) | (np.isnan(x) & np.isnan(y))
        with np.errstate(invalid="ignore", over="ignore"):  # inf - inf, 0 * inf
            d = np.where(same, 0.0, np.abs(x - y))
            # an infinity is within no tolerance of a finite value
            close = same | (np.isfinite(d) & (d <= atol + rtol * np.abs(y)))
        if not d.size:
            return True, 0.0
        big = math.nan if np.isnan(d).any() else float(d.max())
        return bool(np.all(close)), big
    return bool(np.array_equal(a, b)), None


#: Elements of two arrays compared at once: the float64 temporaries of one block take
#: a few tens of MiB, whatever the arrays' size (comparing whole arrays took about ten
#: times the two arrays: 5.5 GB of peak RSS for two 512 MiB float32 arrays).
BLOCK_ELEMENTS = 1 << 20


def _largest(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any], atol: float, rtol: float,
             on_block: Callable[[int, int], None] | None = None) -> tuple[bool, float | None]:
    """(equal within tolerance, largest absolute difference or None if not numeric), of
    two arrays of one shape, compared block by block; ``on_block(done, size)`` after each
    block, in elements."""
    fa, fb = a.reshape(-1), b.reshape(-1)
    ok, big = True, None
    size = fa.size
    for s in range(0, max(size, 1), BLOCK_ELEMENTS):
        e = min(size, s + BLOCK_ELEMENTS)
        o, m = _largest_block(_numeric(fa[s:e]), _numeric(fb[s:e]), atol, rtol)
        ok = ok and o
        if m is not None:  # NaN anywhere makes the largest difference NaN
            big = m if big is None or math.isnan(m) else big if math.isnan(big) else max(big, m)
        if on_block is not None:
            on_block(e, size)
    return ok, big


def _describe(leaf: Any) -> dict[str, Any]:
    if isinstance(leaf, ss.ArrayMetadata):
        return {"dtype": leaf.dtype, "shape": list(leaf.shape)}
    # an int past 4,300 digits has no repr (Python refuses): its size and hex ends
    text = int_text(leaf) if type(leaf) is int else safe(repr(leaf))
    return {"dtype": type(leaf).__name__, "shape": None, "value": text[:200]}


def _same_value(a: Any, b: Any) -> bool:
    """Equal plain values of one type; a NaN equals a NaN (a ``best_loss`` saved as NaN
    twice is no change)."""
    if type(a) is not type(b):
        return False
    return bool(a == b) or (type(a) is float and math.isnan(a) and math.isnan(b))


def _arrays_to_read(la: Any, lb: Any) -> bool:
    return (isinstance(la, ss.ArrayMetadata) and isinstance(lb, ss.ArrayMetadata)
            and tuple(la.shape) == tuple(lb.shape))


def _compare(sa: _Side, sb: _Side, key: str, la: Any, lb: Any, opts: argparse.Namespace,
             tick: Callable[[int], None]) -> dict[str, Any] | None:
    """The change at ``key``, or None; ``tick(n)``: n more bytes (of both sides) compared."""
    ea, eb = isinstance(la, ss.ArrayMetadata), isinstance(lb, ss.ArrayMetadata)
    change: dict[str, Any] = {"key": key, "a": _describe(la), "b": _describe(lb),
                              "max_abs_diff": None}
    if ea != eb:
        return change
    if not ea:
        return None if _same_value(la, lb) else change
    if tuple(la.shape) != tuple(lb.shape):
        return change
    nbytes, told = la.nbytes + lb.nbytes, [0]

    def on_block(done: int, size: int) -> None:  # a large array's bar moves as it goes
        now = nbytes * done // size if size else nbytes
        tick(now - told[0])
        told[0] = now

    ok, big = _largest(sa.get(key), sb.get(key), opts.atol, opts.rtol, on_block)
    change["max_abs_diff"] = big if big is None or math.isfinite(big) else str(big)
    same_dtype = la.dtype == lb.dtype
    return None if ok and same_dtype else change


def _leaves(md: ss.CheckpointMetadata
            ) -> tuple[dict[str, Any], dict[str, list[str]], dict[str, KeyPath]]:
    """Key path -> leaf, key path -> the types of its keys (``{5: x}`` and
    ``{"5": x}`` share the key path ``5``: a change of key type is a change), and key
    path -> its keys, refusing a checkpoint with two leaves at one key path.

    An int key and a str key of the same digits (``{5: x, "5": y}``) share the key path
    ``5``. A dict of the leaves kept one of them, so a change in the other went unseen
    (``equal``, exit 0). diff names, reads (``items=``) and reports leaves by key path
    and cannot tell such leaves apart, so it says it cannot compare them (exit 2)
    rather than name a change nobody could place.
    """
    out: dict[str, Any] = {}
    types: dict[str, list[str]] = {}
    paths: dict[str, KeyPath] = {}
    for p, leaf in leaf_paths(md.tree):
        k = format_keypath(p)
        if k in out:
            raise ss.CheckpointError(
                f"{md.path} holds more than one leaf at key path {k!r} (keys of different "
                "types, such as 5 and '5'): diff compares leaves by key path and cannot "
                "tell them apart")
        out[k] = leaf
        types[k] = [type(key).__name__ for key in p]
        paths[k] = p
    return out, types, paths


def diff(a: str, b: str, opts: argparse.Namespace) -> dict[str, Any]:
    """The report ``statestream diff --json`` prints (schema: docs/cli.md)."""
    limit = getattr(opts, "max_arrays", None)  # both checkpoints are bounded by it
    ma = ss.metadata(a, allow_pickle=opts.allow_pickle, max_arrays=limit)
    mb = ss.metadata(b, allow_pickle=opts.allow_pickle, max_arrays=limit)
    (la, ta, pa), (lb, tb, pb) = _leaves(ma), _leaves(mb)
    common = [k for k in la if k in lb]
    retyped = [k for k in common if ta[k] != tb[k]]
    read = [k for k in common if _arrays_to_read(la[k], lb[k])]
    # Each side's batch holds its arrays; with a budget, half of it per side.
    mem = memory_options(opts)
    batch = BATCH_BYTES if mem is None else max(1, mem.resolved() // 2)
    sa = _Side(a, [(k, la[k].nbytes) for k in read], opts.allow_pickle, batch, mem, pa, limit)
    sb = _Side(b, [(k, lb[k].nbytes) for k in read], opts.allow_pickle, batch, mem, pb, limit)
    total = sum(la[k].nbytes + lb[k].nbytes for k in read)
    changed: list[dict[str, Any]] = []
    done = [0]
    with progress_bar("diff", total=total) as cb:

        def tick(n: int) -> None:
            done[0] += n
            if cb is not None:
                cb(done[0], total)

        for k in common:
            c = _compare(sa, sb, k, la[k], lb[k], opts, tick)
            if k in retyped:  # ({5: x} against {"5": x}: another key, whatever the value)
                c = c or {"key": k, "a": _describe(la[k]), "b": _describe(lb[k]),
                          "max_abs_diff": None}
                c["key_types"] = {"a": ta[k], "b": tb[k]}
            if c is not None:
                changed.append(c)
    return {
        "a": {"path": ma.path, "format": ma.format},
        "b": {"path": mb.path, "format": mb.format},
        "equal": not changed and la.keys() == lb.keys(),
        "added": [{"key": k, **_describe(lb[k])} for k in lb if k not in la],
        "removed": [{"key": k, **_describe(la[k])} for k in la if k not in lb],
        "changed": changed,
    }


def _side(d: dict[str, Any]) -> str:
    if d["shape"] is None:
        return f"{safe(d['dtype'])} {d.get('value', '')}"
    return f"{safe(d['dtype'])}{tuple(d['shape'])}"


def _cmd(args: argparse.Namespace) -> int:
    out = diff(args.a, args.b, args)
    if args.json:
        print(json_text(out))
        return 0 if out["equal"] else 1
    for e in out["added"]:
        print(f"+ {safe(e['key'])}  {_side(e)}")
    for e in out["removed"]:
        print(f"- {safe(e['key'])}  {_side(e)}")
    for e in out["changed"]:
        m = e["max_abs_diff"]
        big = "" if m is None else f"  max |a-b| = {m:.6g}" if isinstance(m, float) \
            else f"  max |a-b| = {m}"
        kt = e.get("key_types")
        keys = "" if kt is None else f"  key types {'/'.join(kt['a'])} -> {'/'.join(kt['b'])}"
        print(f"~ {safe(e['key'])}  {_side(e['a'])} -> {_side(e['b'])}{big}{keys}")
    if out["equal"]:
        print("equal")
    else:
        print(f"{len(out['added'])} added, {len(out['removed'])} removed, "
              f"{len(out['changed'])} changed")
    return 0 if out["equal"] else 1


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("diff", help="added, removed and changed keys of two checkpoints",
                       epilog=EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("a", type=path_arg)
    p.add_argument("b", type=path_arg)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--atol", type=nonnegative("a tolerance"), default=0.0,
                   help="absolute tolerance (default 0)")
    p.add_argument("--rtol", type=nonnegative("a tolerance"), default=0.0,
                   help="relative tolerance (default 0)")
    p.add_argument("--allow-pickle", action="store_true",
                   help="admit arbitrary pickle (only for checkpoints you trust)")
    # without the option its batches are BATCH_BYTES a side, not the library's default
    # budget (25% of RAM), which --help said
    add_memory_budget(p, help="host memory for the arrays compared at once, half of it per "
                              "side (one array alone may be larger), e.g. 512MiB (default: "
                              f"{BATCH_BYTES >> 20} MiB per side)")
    add_max_arrays(p)
    p.set_defaults(fn=_cmd)
