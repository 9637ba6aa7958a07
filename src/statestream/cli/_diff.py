"""``statestream diff``: added, removed and changed keys of two checkpoints, any formats.

Streams: the trees come from metadata; arrays are read one leaf at a time
(``items=`` naming that leaf), so at most one array of each side is in memory.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

import numpy as np

import statestream as ss
from statestream.cli._main import _json_default, safe
from statestream.cli._progress import progress_bar
from statestream.tree import parse_keypath

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


def _leaf(path: str, key: str, allow_pickle: bool) -> np.ndarray[Any, Any]:
    tree: Any = ss.load(path, items=[key], allow_pickle=allow_pickle)
    for k in parse_keypath(key):
        tree = tree[int(k)] if isinstance(tree, (list, tuple)) else tree[k]
    if hasattr(tree, "detach"):  # a torch tensor (duck-typed: cli/ imports no framework)
        t = tree.detach().cpu()
        try:
            return np.asarray(t.numpy())
        except TypeError:  # bfloat16 / float8: NumPy has no such dtype; compare as float32
            return np.asarray(t.float().numpy())
    return _numeric(np.asarray(tree))


def _largest(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any],
             atol: float, rtol: float) -> tuple[bool, float | None]:
    """(equal within tolerance, largest absolute difference or None if not numeric)."""
    if a.dtype.kind in "fciub" and b.dtype.kind in "fciub":
        x, y = a.astype(np.float64) if a.dtype.kind != "c" else a, \
            b.astype(np.float64) if b.dtype.kind != "c" else b
        d = np.abs(x - y)
        both_nan = np.isnan(x) & np.isnan(y) if a.dtype.kind in "fc" else False
        d = np.where(both_nan, 0.0, d)
        big = float(np.nanmax(d)) if d.size else 0.0
        if np.isnan(d).any():
            big = math.nan
        ok = bool(np.all(both_nan | (np.abs(x - y) <= atol + rtol * np.abs(y)))) if d.size \
            else True
        return ok, big
    return bool(np.array_equal(a, b)), None


def _describe(leaf: Any) -> dict[str, Any]:
    if isinstance(leaf, ss.ArrayMetadata):
        return {"dtype": leaf.dtype, "shape": list(leaf.shape)}
    return {"dtype": type(leaf).__name__, "shape": None, "value": safe(repr(leaf))[:200]}


def _compare(a: str, b: str, key: str, la: Any, lb: Any, opts: argparse.Namespace
             ) -> dict[str, Any] | None:
    ea, eb = isinstance(la, ss.ArrayMetadata), isinstance(lb, ss.ArrayMetadata)
    change: dict[str, Any] = {"key": key, "a": _describe(la), "b": _describe(lb),
                              "max_abs_diff": None}
    if ea != eb:
        return change
    if not ea:
        return None if type(la) is type(lb) and la == lb else change
    if tuple(la.shape) != tuple(lb.shape):
        return change
    xa, xb = _leaf(a, key, opts.allow_pickle), _leaf(b, key, opts.allow_pickle)
    ok, big = _largest(xa, xb, opts.atol, opts.rtol)
    change["max_abs_diff"] = big
    same_dtype = la.dtype == lb.dtype
    return None if ok and same_dtype else change


def diff(a: str, b: str, opts: argparse.Namespace) -> dict[str, Any]:
    """The report ``statestream diff --json`` prints (schema: docs/cli.md)."""
    ma, mb = ss.metadata(a), ss.metadata(b)
    la, lb = dict(ma.leaves()), dict(mb.leaves())
    common = [k for k in la if k in lb]
    total = sum(la[k].nbytes + lb[k].nbytes for k in common
                if isinstance(la[k], ss.ArrayMetadata) and isinstance(lb[k], ss.ArrayMetadata))
    changed: list[dict[str, Any]] = []
    done = 0
    with progress_bar("diff", total=total) as cb:
        for k in common:
            c = _compare(a, b, k, la[k], lb[k], opts)
            if c is not None:
                changed.append(c)
            if isinstance(la[k], ss.ArrayMetadata) and isinstance(lb[k], ss.ArrayMetadata):
                done += la[k].nbytes + lb[k].nbytes
                if cb is not None:
                    cb(done, total)
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
        print(json.dumps(out, indent=2, ensure_ascii=True, default=_json_default))
        return 0 if out["equal"] else 1
    for e in out["added"]:
        print(f"+ {safe(e['key'])}  {_side(e)}")
    for e in out["removed"]:
        print(f"- {safe(e['key'])}  {_side(e)}")
    for e in out["changed"]:
        big = "" if e["max_abs_diff"] is None else f"  max |a-b| = {e['max_abs_diff']:.6g}"
        print(f"~ {safe(e['key'])}  {_side(e['a'])} -> {_side(e['b'])}{big}")
    if out["equal"]:
        print("equal")
    else:
        print(f"{len(out['added'])} added, {len(out['removed'])} removed, "
              f"{len(out['changed'])} changed")
    return 0 if out["equal"] else 1


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("diff", help="added, removed and changed keys of two checkpoints",
                       epilog=EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--atol", type=float, default=0.0, help="absolute tolerance (default 0)")
    p.add_argument("--rtol", type=float, default=0.0, help="relative tolerance (default 0)")
    p.add_argument("--allow-pickle", action="store_true",
                   help="admit arbitrary pickle (only for checkpoints you trust)")
    p.set_defaults(fn=_cmd)
