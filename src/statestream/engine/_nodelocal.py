"""Which processes share a node-local directory (a manager's local tier).

A local directory given by the same path on every process may be one
directory (processes of one node, or a shared file system) or several (each
node's own disk). The first process to look writes a random identity file
into it (created atomically, never overwritten); every process reads it back,
and processes that read the same identity share the directory. The lowest
rank of each group is its *leader*: it opens, commits and cleans that copy.
"""

from __future__ import annotations

import os
import uuid

from statestream.distributed import Collective, agree
from statestream.errors import storage_error

__all__ = ["NODE_ID_NAME", "NodeGroups", "node_groups"]

#: The identity file of a node-local directory.
NODE_ID_NAME = ".statestream-node"


class NodeGroups:
    """Every rank's group (an identity string) and the leaders, the same on every rank."""

    def __init__(self, ids: list[str], rank: int) -> None:
        self.ids = ids
        self.rank = rank

    def members(self, rank: int | None = None) -> list[int]:
        """The ranks sharing ``rank``'s directory (default: this rank's), ascending."""
        me = self.ids[self.rank if rank is None else rank]
        return [r for r, i in enumerate(self.ids) if i == me]

    def leader(self, rank: int | None = None) -> int:
        return self.members(rank)[0]

    @property
    def is_leader(self) -> bool:
        return self.leader() == self.rank

    def leaders(self) -> list[int]:
        """One rank per distinct directory, ascending."""
        return sorted({self.leader(r) for r in range(len(self.ids))})


def _identity(directory: str) -> str:
    path = os.path.join(directory, NODE_ID_NAME)
    try:
        os.makedirs(directory, exist_ok=True)
        if not os.path.exists(path):
            tmp = f"{path}.{uuid.uuid4().hex}"
            with open(tmp, "w") as f:
                f.write(uuid.uuid4().hex)
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, path)  # atomic, and never replaces another process's
            except FileExistsError:
                pass  # another process of this directory was first: use its identity
            finally:
                os.unlink(tmp)
        with open(path) as f:
            return f.read().strip()
    except OSError as exc:
        raise storage_error(f"cannot identify the node-local directory {directory}: {exc}",
                            exc) from exc


def node_groups(coll: Collective, directory: str) -> NodeGroups:
    """Group the processes by the copy of ``directory`` they see (collective)."""
    ident: str | None = None
    err: BaseException | None = None
    try:
        ident = _identity(directory)
    except BaseException as exc:
        err = exc
    agree(coll, f"identifying the node-local directory {directory}", err,
          check_as="identifying the node-local directory")  # its path may differ by node
    ids = coll.all_gather_object(ident) if coll.world_size > 1 else [ident]
    return NodeGroups([str(i) for i in ids], coll.rank)
