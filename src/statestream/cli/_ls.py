"""``statestream ls``: the steps of a manager directory, or the checkpoints under a directory.

Read-only: lists through the storage (and the manager's own step naming), never
takes the manager's lease, never removes anything.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from typing import Any

import statestream as ss
from statestream.cli._main import _human, add_max_arrays, json_text, path_arg, safe
from statestream.format import over_max_arrays
from statestream.manager._retention import decode_metrics
from statestream.manager._steps import StepDirectory, parse_step
from statestream.storage import storage_for
from statestream.storage._hints import trainer_hint

__all__ = ["add_parser", "list_directory"]

EXAMPLE = """examples:
  statestream ls ckpts/
  statestream ls ckpts/ --json | jq '.entries[] | select(.state == "committed") | .step'
"""


def _seconds(*candidates: Any) -> float | int | None:
    """The first candidate that is a time: a finite number of Unix seconds (a bool, a
    string, NaN, an infinity or an int beyond float's range, from a hostile manifest or
    odd user metadata, is none)."""
    for t in candidates:
        if isinstance(t, bool) or not isinstance(t, (int, float)):
            continue
        try:
            if math.isfinite(float(t)):
                return t
        except OverflowError:
            continue
    return None


def _missing_bases(storage: Any, path: str, bases: list[str]) -> list[str]:
    """The bases of the incremental checkpoint at ``path`` that are not committed
    checkpoints beside it (removed by hand, not synced, ...): ls listed such a step as
    ``committed``, though its chunks stored there cannot be read."""
    parent = path.rstrip("/").rpartition("/")[0]
    return [b for b in bases if not storage.is_committed(f"{parent}/{b}")]


def _entry(storage: Any, path: str, name: str, step: int | None,
           max_arrays: int | None = None) -> dict[str, Any]:
    e: dict[str, Any] = {"name": name, "path": path, "step": step, "state": "committed",
                         "format": None, "time": None, "nbytes": None, "disk_bytes": None,
                         "metrics": {}, "error": None, "bases": []}
    try:
        md = ss.metadata(path, max_arrays=max_arrays)
    except ss.CheckpointError as exc:
        if over_max_arrays(exc):
            raise  # the caller's bound refused it: not damage, nothing was decoded
        e["state"] = "damaged" if storage.is_committed(path) else "uncommitted"
        if e["state"] == "damaged":
            e["error"] = str(exc)
        return e
    user = md.meta.get("user", {}) if isinstance(md.meta.get("user"), dict) else {}
    e["format"] = md.format
    e["time"] = _seconds(user.get("time"), md.meta.get("created_unix"))
    e["nbytes"] = md.total_bytes
    # its own data files: less than nbytes when compressed, or incremental (the rest
    # lies in its bases)
    e["disk_bytes"] = sum(size for _, size in md.files)
    e["bases"] = list(md.bases)
    missing = _missing_bases(storage, path, md.bases)
    if missing:  # it reads as committed, but loading it fails: damaged, as verify says
        e["state"] = "damaged"
        e["error"] = (f"it refers to {', '.join(missing)}, which is not a committed "
                      "checkpoint beside it: it cannot be loaded")
    try:
        e["metrics"] = decode_metrics(user.get("metrics", {}))
    except (TypeError, ValueError, AttributeError):
        e["metrics"] = {}
    return e


def list_directory(directory: str, max_arrays: int | None = None) -> dict[str, Any]:
    """Every checkpoint (or manager step) under ``directory``, and unfinished saves.

    ``max_arrays``: each checkpoint's metadata is read with it (``ss.metadata``'s): one
    whose manifest declares more arrays raises the refusal rather than be listed.

    ``state`` is ``committed``, ``uncommitted`` (a step directory without its
    commit marker), ``damaged`` (committed but unreadable) or ``leftover`` (the
    staging area of an unfinished save).
    """
    storage, path = storage_for(directory)
    if "://" not in directory and not os.path.isdir(path):
        raise ss.CheckpointNotFoundError(f"no directory at {directory}")
    if storage.is_committed(path):  # a checkpoint itself: list it alone
        parent, _, name = path.rstrip("/").rpartition("/")
        return {"directory": directory, "kind": "checkpoint",
                "entries": [_entry(storage, path, name, parse_step(name), max_arrays)]}
    steps = StepDirectory(storage, path)
    leftovers = storage.leftovers(path)
    # a save killed after its commit marker was written but before the rename leaves a
    # committed staging directory: it is a leftover, not a checkpoint of its own
    staging = {lo.path.rstrip("/").rpartition("/")[2] for lo in leftovers}
    # on an object store a killed save's leftover is a root inside the checkpoint's own
    # prefix, which is no more than that leftover: listed once, as the leftover
    holds_leftover = {lo.path.rstrip("/").rpartition("/")[0] for lo in leftovers}
    names = sorted(n for n in storage.list(path) if n not in staging)
    is_manager = any(parse_step(n) is not None for n in names)
    entries: list[dict[str, Any]] = []
    for name in names:
        step = parse_step(name)
        if is_manager and step is None:
            continue
        child = steps.path(step) if step is not None else f"{path}/{name}"
        if step is None and not storage.is_committed(child):
            continue  # a plain directory: only checkpoints
        e = _entry(storage, child, name, step, max_arrays)
        if not (e["state"] == "uncommitted" and child in holds_leftover):
            entries.append(e)
    for lo in leftovers:
        entries.append({"name": lo.target, "path": lo.path, "step": parse_step(lo.target),
                         "state": "leftover", "format": None, "time": lo.modified,
                         "nbytes": None, "disk_bytes": None, "metrics": {}, "error": None,
                         "bases": []})
    entries.sort(key=lambda e: (e["step"] is None, e["step"] or 0, e["name"], e["state"]))
    return {"directory": directory, "kind": "manager" if is_manager else "directory",
            "entries": entries}


def _when(t: Any) -> str:
    """``t`` (Unix seconds) as UTC, or ``-`` when it is none or out of range: ``ls`` of
    a checkpoint saved with ``meta={"time": 1e300}`` ended in an OverflowError traceback."""
    if _seconds(t) is None:
        return "-"
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(float(t)))
    except (OverflowError, OSError, ValueError):  # beyond time_t or the platform's years
        return "-"


def _metrics_text(m: dict[str, Any]) -> str:
    return safe(" ".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}"
                         for k, v in m.items()))[:60]


def _bases_text(bases: list[str]) -> str:
    """What an incremental checkpoint depends on (its bases must be kept with it)."""
    if not bases:
        return ""
    shown = ", ".join(safe(b) for b in bases[:4]) + (" ..." if len(bases) > 4 else "")
    return f"  depends on {shown}"


def _cmd(args: argparse.Namespace) -> int:
    out = list_directory(args.directory, args.max_arrays)
    if args.json:
        print(json_text(out))
        return 0
    rows = out["entries"]
    w = min(60, max([4] + [len(safe(e["name"])) for e in rows]))
    print(f"{'name':<{w}}  {'step':>10}  {'state':<11} {'time (UTC)':<19}  {'size':>10}  "
          f"{'on disk':>10}  metrics")
    for e in rows:
        step = "" if e["step"] is None else str(e["step"])
        size = "" if e["nbytes"] is None else _human(e["nbytes"])
        disk = "" if e["disk_bytes"] is None else _human(e["disk_bytes"])
        print(f"{safe(e['name']):<{w}}  {step:>10}  {e['state']:<11} {_when(e['time']):<19}  "
              f"{size:>10}  {disk:>10}  {_metrics_text(e['metrics'])}{_bases_text(e['bases'])}")
    n = sum(1 for e in rows if e["state"] == "committed")
    print(f"{n} committed checkpoint{'s' if n != 1 else ''}, {len(rows) - n} other")
    if not rows:
        _trainer_hint(args.directory)
        _foreign_hint(args.directory)
    return 0


def _trainer_hint(directory: str) -> None:
    """Say where the checkpoints are when ``directory`` is a transformers Trainer output
    directory of StatestreamTrainer's (``checkpoint-<N>/statestream``), as ``inspect``
    does: ``ls`` showed an empty table there."""
    try:
        storage, spath = storage_for(directory)
    except ss.CheckpointError:
        return
    hint = trainer_hint(storage, spath)
    if hint is not None:
        print(safe(hint))


def _foreign_hint(directory: str) -> None:
    """Say so when a local directory without statestream checkpoints holds checkpoints of
    another format (an Orbax CheckpointManager's steps, DCP directories, ...), which
    ``ls`` does not list but ``inspect``, ``verify``, ``diff`` and ``convert`` (and
    ``load``) read by path."""
    if "://" in directory:
        return
    from statestream.interop import detect_format

    found: dict[str, list[str]] = {}
    try:
        names = sorted(os.listdir(directory))[:10_000]
    except OSError:
        return
    for name in names:
        try:
            fmt = detect_format(os.path.join(directory, name))
        except ss.CheckpointError:
            continue
        if fmt is not None:
            found.setdefault(fmt, []).append(name)
    for fmt, hits in found.items():
        shown = ", ".join(safe(h) for h in hits[:4]) + (" ..." if len(hits) > 4 else "")
        print(f"{len(hits)} {fmt} checkpoint{'s' if len(hits) != 1 else ''} here ({shown}): "
              "ls lists statestream's; inspect, verify, diff and convert read these by path")


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("ls", help="list the steps of a manager directory (or its checkpoints)",
                       epilog=EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("directory", type=path_arg)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    add_max_arrays(p, bases=False)
    p.set_defaults(fn=_cmd)
