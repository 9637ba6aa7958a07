"""Which process uploads which data file when a node-local step is persisted.

A step committed node-locally lives as one copy per node: the manifest and the
data files of the processes that ran there when it was saved
(``data/r<rank>-*``), plus, with peer copies, the next node's. The processes
persisting it now may run elsewhere: a restart can place rank 0 on the node
that rank 1 saved on, or run another number of processes. So each data file
is uploaded by one process of a node whose copy holds it (at the manifest's
size): by the rank that wrote it when its node does (the layout of an
uninterrupted run), else by the members of such nodes in turn.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable

from statestream.distributed import Collective, gather_each
from statestream.engine import NodeGroups, read_manifest
from statestream.errors import TruncatedFileError, storage_error
from statestream.format import DATA_DIR
from statestream.storage import LocalStorage

__all__ = ["upload_filter"]

_WRITER = re.compile(r"data/r(\d+)-")


def upload_filter(coll: Collective, groups: NodeGroups, path: str,
                  step: int) -> Callable[[str], bool]:
    """The data files of the node-local checkpoint ``path`` this process uploads;
    collective (every process's copy of ``path`` is committed).

    Raises:
        TruncatedFileError: a data file is in no node's copy (on every process):
            the step cannot be persisted by this job.
        DistributedError: a node's copy could not be listed (on every process).
    """

    def mine() -> tuple[dict[str, int] | None, dict[str, int] | None]:
        held = _held(path) if groups.is_leader else None
        return held, (_wanted(path) if coll.rank == 0 else None)

    everyone = gather_each(coll, f"listing the nodes' copies of {path} to persist it", mine,
                           outcome=f"step {step} was not persisted",
                           check_as=f"listing the nodes' copies of step {step} to persist it")
    wanted = everyone[0][1]
    assert wanted is not None
    owners, lost = _assign(wanted, [h for h, _ in everyone], groups)
    if lost:
        raise TruncatedFileError(
            f"cannot persist step {step}: its data files {lost[:4]}"
            f"{' ...' if len(lost) > 4 else ''} are missing from every node's copy in the "
            f"local tier {os.path.dirname(path)} of this job's {len(groups.leaders())} "
            "node(s) (written on a node not in this job, or lost with its disk); the step "
            "stays unpersisted")
    me = coll.rank
    return lambda name: owners.get(name) == me


def _assign(wanted: dict[str, int], held: list[dict[str, int] | None],
            groups: NodeGroups) -> tuple[dict[str, int], list[str]]:
    """file -> the rank that uploads it, and the files no node holds."""
    owners: dict[str, int] = {}
    lost: list[str] = []
    turn = 0
    for name, size in sorted(wanted.items()):
        nodes = [r for r, h in enumerate(held) if h is not None and h.get(name) == size]
        m = _WRITER.match(name)
        writer = int(m.group(1)) if m else None
        if writer is not None and writer < len(held) and groups.leader(writer) in nodes:
            owners[name] = writer
        elif nodes:
            ranks = sorted(r for n in nodes for r in groups.members(n))
            owners[name] = ranks[turn % len(ranks)]
            turn += 1
        else:
            lost.append(name)
    return owners, lost


def _wanted(path: str) -> dict[str, int]:
    """The data files the manifest of ``path`` names: name -> size."""
    reader = LocalStorage().open_read(path)
    try:
        return {f.name: f.size for f in read_manifest(reader).files}
    finally:
        reader.close()


def _held(path: str) -> dict[str, int]:
    """The data files in this node's copy at ``path``: name -> size."""
    data = os.path.join(path, DATA_DIR)
    out: dict[str, int] = {}
    try:
        with os.scandir(data) as entries:
            for e in entries:
                if not e.name.startswith(".") and e.is_file():
                    out[f"{DATA_DIR}/{e.name}"] = e.stat().st_size
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise storage_error(f"cannot list {data}: {exc}", exc) from exc
    return out
