"""Node-local copies of one checkpoint, moved between nodes over the job's collective.

A node-local checkpoint (``save(..., node_local=True)``) has one copy per
node: the manifest and the data files of that node's processes. Two
collective operations move files between those copies over the collective's
point-to-point byte channel (torch.distributed gloo), never through a shared
file system or the persistent store:

- :func:`replicate_to_peers`: every process sends its own data files to the
  next node (its *peer*), which adds them to its copy, so a lost node's files
  survive on its peer;
- :func:`complete_copies`: every node fetches the files its copy lacks (all of
  the manifest's, or those its processes' load reads) from a node that holds
  them, writing a copy from scratch (manifest included) where a node has none,
  so each node can then load the checkpoint from its own disk.

Transfers run in one order known to every process (each involves two ranks,
so the earliest one not done always has both of its ranks at it: no
deadlock). Received files are written next to their final name and renamed
into place after an fsync, so a copy is never seen with a partial file;
checksums are verified by the load that follows (and by persistence).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Collection, Sequence
from typing import Any

from statestream.distributed import ByteChannel, Collective, agree, gather_each
from statestream.engine._copy import read_committed
from statestream.engine._nodelocal import NodeGroups
from statestream.errors import (
    CheckpointCorruptError,
    DistributedError,
    TruncatedFileError,
    storage_error,
)
from statestream.format import (
    COMMIT_NAME,
    DATA_DIR,
    MANIFEST_NAME,
    Manifest,
    decode_manifest,
    validate_file_name,
)
from statestream.storage import LocalStorage

__all__ = ["Transfer", "complete_copies", "describe_copy", "replicate_to_peers"]

_PIECE = 16 << 20

#: Which files of a manifest one process reads (indices into its ``files``; None: all).
WantedFiles = Callable[[Manifest], Collection[int] | None]


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One data file sent from rank ``src``'s node copy to rank ``dst``'s."""

    src: int
    dst: int
    name: str
    size: int


def _held(path: str) -> dict[str, int]:
    """Data files in the node's copy at ``path``: name -> size."""
    data = os.path.join(path, DATA_DIR)
    try:
        names = os.listdir(data)
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise storage_error(f"cannot list {data}: {exc}", exc) from exc
    out = {}
    for n in names:
        full = os.path.join(data, n)
        try:
            if not n.startswith(".") and os.path.isfile(full):
                out[f"{DATA_DIR}/{n}"] = os.path.getsize(full)
        except OSError as exc:
            raise storage_error(f"cannot read the size of {full}: {exc}", exc) from exc
    return out


def _send(channel: ByteChannel, path: str, t: Transfer) -> None:
    full = os.path.join(path, validate_file_name(t.name))
    buf = bytearray(min(_PIECE, t.size))
    try:
        with open(full, "rb", buffering=0) as f:
            pos = 0
            while pos < t.size:
                n = min(_PIECE, t.size - pos)
                view = memoryview(buf)[:n]
                got = f.readinto(view)
                if got != n:
                    raise TruncatedFileError(f"{full} ended at {pos + (got or 0)} of {t.size}")
                channel.send_bytes(view, t.dst)
                pos += n
    except OSError as exc:
        raise storage_error(f"cannot read {full} to send it to rank {t.dst}: {exc}",
                            exc) from exc


def _recv(channel: ByteChannel, path: str, t: Transfer) -> None:
    """Receive into ``path/data/.<name>.part``, fsync, rename into place."""
    final = os.path.join(path, validate_file_name(t.name))
    part = os.path.join(os.path.dirname(final), f".{os.path.basename(final)}.part")
    buf = bytearray(min(_PIECE, t.size))
    try:
        os.makedirs(os.path.dirname(final), exist_ok=True)
        with open(part, "wb", buffering=0) as f:
            pos = 0
            while pos < t.size:
                n = min(_PIECE, t.size - pos)
                view = memoryview(buf)[:n]
                channel.recv_bytes(view, t.src)
                f.write(view)
                pos += n
            os.fsync(f.fileno())
        os.replace(part, final)
        fd = os.open(os.path.dirname(final), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        raise storage_error(f"cannot write {final} received from rank {t.src}: {exc}",
                            exc) from exc


def _name(path: str) -> str:
    """The step directory's name: what the ranks compare of a node-local path in their
    agreements (its parent may differ by node)."""
    return os.path.basename(path.rstrip("/"))


def run_transfers(coll: Collective, channel: ByteChannel, transfers: Sequence[Transfer],
                  source: Callable[[int], str], sink: Callable[[int], str]) -> None:
    """Run ``transfers`` in order: this rank sends from ``source(src)``'s copy or
    receives into ``sink(dst)``'s; every rank agrees on the outcome."""
    err: BaseException | None = None
    me = coll.rank
    try:
        for t in transfers:
            if t.src == me and t.dst != me:
                _send(channel, source(me), t)
            elif t.dst == me and t.src != me:
                _recv(channel, sink(me), t)
    except BaseException as exc:
        err = exc
    agree(coll, "moving checkpoint files between nodes", err)


def _need_channel(coll: Collective, channel: ByteChannel | None) -> ByteChannel:
    if channel is None:
        raise DistributedError(
            "moving node-local checkpoint files between nodes needs a collective with a "
            f"byte channel (torch.distributed); {type(coll).__name__} has none")
    return channel


def replicate_to_peers(coll: Collective, channel: ByteChannel | None, groups: NodeGroups,
                       path: str) -> None:
    """Send every process's own data files of the node-local checkpoint ``path`` to its
    peer node (the next one, in rank order of the nodes' leaders); collective.

    Every node's copy must be committed. With one node there is nothing to do.
    """
    leaders = groups.leaders()
    if len(leaders) < 2:
        return
    everyone = gather_each(coll, f"listing the files of {path} to send to the peer node",
                           lambda: sorted((n, s) for n, s in _held(path).items()
                                          if n.startswith(f"{DATA_DIR}/r{coll.rank}-")),
                           check_as=f"listing the files of {_name(path)} to send")
    transfers = []
    for r, files in enumerate(everyone):
        node = leaders.index(groups.leader(r))
        peer = leaders[(node + 1) % len(leaders)]
        transfers += [Transfer(r, peer, n, int(s)) for n, s in files]
    if transfers:
        run_transfers(coll, _need_channel(coll, channel), transfers,
                      lambda _: path, lambda _: path)


def complete_copies(coll: Collective, channel: ByteChannel | None, groups: NodeGroups,
                    path: str, wanted: WantedFiles | None = None) -> bool:
    """Give every node the files of the node-local checkpoint ``path`` that its
    processes read; collective.

    ``wanted(manifest)``: the indices of the manifest's files this process reads
    (None, or no ``wanted``: all of them). A node fetches the files its processes
    want and its processes' own (``data/r<rank>-*``, which persistence uploads from
    it) that it lacks; a node with no committed copy writes one (manifest
    included) and commits it. A copy completed in part is like any node-local copy:
    committed, but whole only together with the other nodes' (a later call with
    other wants fetches the rest).

    Returns False on every rank, changing nothing, when some file of the
    manifest is held by no node, no node has a committed copy, or files
    would have to move and the collective has no byte channel.

    Raises:
        CheckpointCorruptError: on every rank, changing nothing, when a node's
            committed copy is damaged (its commit marker or manifest) or two nodes
            committed different saves of ``path`` (their markers differ).
    """

    def info() -> dict[str, Any] | None:
        return describe_copy(path) if groups.is_leader else None

    infos: list[Any] = gather_each(coll, f"listing the nodes' copies of {path}", info,
                                   check_as=f"listing the nodes' copies of {_name(path)}")
    src = _source(infos, path)
    if src is None:
        return False
    texts = None
    err: BaseException | None = None
    if coll.rank == src:
        try:
            reader = LocalStorage().open_read(path)
            try:
                marker, mbytes, _ = read_committed(reader)
            finally:
                reader.close()
            texts = (marker.decode("utf-8"), mbytes.decode("utf-8"))
        except BaseException as exc:
            err = exc
    agree(coll, f"reading the manifest of {path}", err,
          check_as=f"reading the manifest of {_name(path)}")
    marker_text, manifest_text = coll.broadcast_object(texts, src=src)
    m = decode_manifest(manifest_text, f"{path}/{MANIFEST_NAME}")
    sizes = {f.name: f.size for f in m.files}
    holders: dict[str, list[int]] = {}
    for r, i in enumerate(infos):
        if i is not None and i["committed"]:  # every committed copy is src's save (_source)
            for n, size in i["files"]:
                if sizes.get(n) == size:  # a short or stray file is no source
                    holders.setdefault(n, []).append(r)
    wants = coll.all_gather_object(_wanted_names(m, wanted))
    if any(not holders.get(n) for n in sizes):
        return False
    transfers = []
    for r, i in enumerate(infos):
        if i is None:
            continue
        have = dict(i["files"]) if i["committed"] else {}
        need = _node_needs(groups.members(r), wants, sizes)
        for n, size in sizes.items():
            if n in need and have.get(n) != size:
                hs = holders[n]
                transfers.append(Transfer(hs[r % len(hs)], r, n, size))
    fresh = any(i is not None and not i["committed"] for i in infos)
    if not transfers and not fresh:
        return True
    if channel is None:
        return False
    _complete(coll, channel, groups, path, transfers, infos, (marker_text, manifest_text))
    return True


def describe_copy(path: str) -> dict[str, Any]:
    """A node's copy of the node-local checkpoint ``path`` as its leader sees it:
    ``committed``; ``files``, its data files ``[name, size]``; when committed, its
    commit ``marker`` (the save's identity: the manifest's size and checksum) and
    the manifest's data files ``need`` ``[name, size]``, or ``damage``: why they
    cannot be read. JSON-able, to gather."""
    committed = LocalStorage().is_committed(path)
    out: dict[str, Any] = {"committed": committed, "files": sorted(_held(path).items()),
                           "marker": None, "need": [], "damage": None}
    if committed:
        try:
            reader = LocalStorage().open_read(path)
            try:
                marker, _, m = read_committed(reader)
            finally:
                reader.close()
            out["marker"] = marker.decode("utf-8")
            out["need"] = [(f.name, f.size) for f in m.files]
        except CheckpointCorruptError as exc:
            out["damage"] = str(exc)
    return out


def _source(infos: list[Any], path: str) -> int | None:
    """The rank whose node's copy the others complete from: the first committed one
    (None: none is). The same on every rank (``infos`` are gathered).

    Raises:
        CheckpointCorruptError: a node's committed copy is damaged (its marker or
            manifest), or two nodes' committed copies are of different saves (a
            save of it, e.g. ``force=True``, was interrupted between the nodes'
            commits): completing one from the other would mix them.
    """
    copies = [(r, i) for r, i in enumerate(infos) if i is not None and i["committed"]]
    name = os.path.basename(path)
    for r, i in copies:
        if i["damage"] is not None:  # names the file on that node
            raise CheckpointCorruptError(
                f"the copy of {name} on the node of rank {r} is damaged: {i['damage']}")
    for r, i in copies[1:]:
        if i["marker"] != copies[0][1]["marker"]:
            raise CheckpointCorruptError(
                f"the copies of {name} on the nodes of ranks {copies[0][0]} and {r} are "
                "different saves of it (a save was interrupted after some nodes committed "
                "their copy); neither can be completed from the other")
    return copies[0][0] if copies else None


def _wanted_names(m: Manifest, wanted: WantedFiles | None) -> list[str] | None:
    """The names of the files ``wanted`` picks in ``m``; None for all of them (also
    when ``wanted`` fails: the load that follows reports what is wrong)."""
    if wanted is None:
        return None
    try:
        picked = wanted(m)
    except Exception:  # noqa: BLE001 - the load that follows raises it, on every rank
        return None
    if picked is None:
        return None
    return sorted(m.files[i].name for i in picked if 0 <= i < len(m.files))


def _node_needs(members: list[int], wants: list[list[str] | None],
                sizes: dict[str, int]) -> set[str]:
    """The files a node's copy must hold: what its processes read, and their own."""
    need: set[str] = set()
    for r in members:
        w = wants[r]
        if w is None:
            return set(sizes)
        need.update(w)
        need.update(n for n in sizes if n.startswith(f"{DATA_DIR}/r{r}-"))
    return need


def _complete(coll: Collective, channel: ByteChannel, groups: NodeGroups, path: str,
              transfers: list[Transfer], infos: list[object],
              texts: tuple[str, str]) -> None:
    """Run the transfers; a node without a committed copy writes one and commits it."""
    mine = infos[coll.rank]
    fresh = isinstance(mine, dict) and not mine["committed"]
    stage = path
    txn = None
    err: BaseException | None = None
    if fresh:
        try:
            txn = LocalStorage().begin_write(path, overwrite=False)
            stage = txn.token  # the staging directory: files land there, then commit
        except BaseException as exc:
            err = exc
    agree(coll, f"preparing the copy of {path}", err,
          check_as=f"preparing the copy of {_name(path)}")
    try:
        run_transfers(coll, channel, transfers, lambda _: path, lambda _: stage)
        if txn is not None:
            try:
                txn.write_bytes(MANIFEST_NAME, texts[1].encode("utf-8"))
                txn.write_bytes(COMMIT_NAME, texts[0].encode("utf-8"))
                txn.commit()
            except BaseException as exc:
                err = exc
        agree(coll, f"committing the restored copy of {path}", err,
              check_as=f"committing the restored copy of {_name(path)}")
    except BaseException:
        if txn is not None:
            txn.abort()
        raise
