"""The plan of a multi-process save, kept for the next save of the same structure.

Agreeing on a multi-process save's plan costs every process work in the size
of the whole job: it decodes every process's tree, merges them into the
checkpoint's tree and assigns one writer to every distinct box (with N
processes of n arrays each, N n of each). A training job saves the same
structure again and again -- only the plain values (the step, the epoch) and
the bytes change -- so that plan is kept and reused:

1. Each process splits its tree into its **structure** (every plain value
   replaced by a placeholder of its kind) and its **values** (the plain leaves,
   in tree order), and digests the structure with its arrays' descriptions
   (key paths, dtypes, shapes, boxes).
2. One gather carries every process's digest and values. A process that kept
   a plan for exactly these digests (in rank order) has nothing more to agree
   on; the processes agree whether all of them did.
3. Otherwise every process's structure is gathered and merged as before, with
   each plain leaf pointing at the value it stands for (rank, position), and
   the plan is kept.
4. Either way, the merged tree gets this save's values.

So a save of an unchanged structure exchanges digests and values instead of
trees, and skips the merge and the writer assignment. The merged manifest is
still checked as a reader would before it is committed. :func:`agree_on_plan` is
the whole exchange, which a multi-process save job runs at its begin.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import math
import threading
from collections.abc import Sequence
from typing import Any

from statestream import _hooks
from statestream.distributed import Collective, agree, any_of
from statestream.errors import DistributedError, TargetMismatchError
from statestream.format import DTYPE_NAMES, decode_tree, encode_tree, itemsize_of
from statestream.plan import (
    ArrayDecl,
    MergedTree,
    RankTree,
    assign_writers,
    merge_trees,
)
from statestream.tree import Node

__all__ = ["KeptPlan", "agree_on_plan", "fill_values", "forget_plans", "kept_plan",
           "keep_plan", "plan_digest", "split_values", "total_bytes", "with_refs"]

_Box = tuple[tuple[int, ...], tuple[int, ...]]

#: A plain leaf's placeholder in a structure, by kind (what its value is replaced by).
_PLACEHOLDERS: dict[str, Any] = {"none": None, "bool": False, "int": 0, "float": 0.0, "str": ""}
#: Plans kept per process (a job that saves a few different states alternately).
KEEP = 4
#: ... holding at most this many arrays together, the newest plan aside (a kept plan
#: holds the merged tree: ~200 bytes per array).
KEEP_ARRAYS = 1 << 20

_LOCK = threading.Lock()
_KEPT: collections.OrderedDict[tuple[int, tuple[str, ...]], KeptPlan] = \
    collections.OrderedDict()


@dataclasses.dataclass(frozen=True, slots=True)
class _Ref:
    """Where a merged tree's plain leaf takes its value: that rank's value number."""

    rank: int
    index: int


@dataclasses.dataclass(frozen=True, slots=True)
class KeptPlan:
    """What a multi-process save agreed on, apart from the values.

    ``tree`` holds :class:`_Ref` placeholders in its plain leaves; ``mine``
    the boxes of each local array this process writes. Where rank 0 planned
    alone (the collective gathers to one rank), the other ranks keep only what
    they need: ``index`` for their own arrays, ``mine`` and ``total_bytes``
    (their ``tree`` is an empty placeholder and ``arrays`` is empty).
    """

    tree: Node
    arrays: list[Any]
    index: dict[str, int]
    mine: list[list[_Box]]
    #: raw bytes of every array of the checkpoint (the manifest's ``total_bytes``)
    total_bytes: int = 0


def split_values(tree: Node) -> tuple[Node, list[Node]]:
    """``tree``'s structure (plain values replaced by placeholders) and its plain
    leaves in tree order.

    Example:
        >>> t = Node("dict", keys=["w", "step"],
        ...          children=[Node("array", array=0), Node("int", value=7)])
        >>> s, v = split_values(t)
        >>> s.children[1].value, [x.value for x in v]
        (0, [7])
    """
    values: list[Node] = []

    def go(n: Node) -> Node:
        if n.children is not None:
            return Node(n.kind, n.keys, [go(c) for c in n.children], n.type_name, n.value,
                        n.array, n.attrs)
        if n.kind in _PLACEHOLDERS:
            values.append(n)
            return Node(n.kind, None, None, n.type_name, _PLACEHOLDERS[n.kind], None, n.attrs)
        return n

    return go(tree), values


def plan_digest(structure: Any, arrays: Any) -> str:
    """A digest of one process's encoded structure and array descriptions."""
    text = json.dumps([structure, arrays], separators=(",", ":"), default=repr)
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).hexdigest()


def with_refs(tree: Node, rank: int) -> Node:
    """``tree`` (a structure) with each plain leaf's value pointing at ``rank``'s
    value of the same position (tree order, as :func:`split_values` counts)."""
    count = 0

    def go(n: Node) -> Node:
        nonlocal count
        if n.children is not None:
            return Node(n.kind, n.keys, [go(c) for c in n.children], n.type_name, n.value,
                        n.array, n.attrs)
        if n.kind in _PLACEHOLDERS:
            count += 1
            return Node(n.kind, None, None, n.type_name, _Ref(rank, count - 1), None, n.attrs)
        return n

    return go(tree)


def fill_values(tree: Node, values: Sequence[Sequence[Node]]) -> Node:
    """``tree`` (from :func:`with_refs` trees, merged) with every placeholder replaced
    by the value it points at: ``values[rank][index]``.

    Raises:
        ValueError: a value is missing or of another kind (the structures
            digested alike but differ: never expected).
    """
    def go(n: Node) -> Node:
        if n.children is not None:
            return Node(n.kind, n.keys, [go(c) for c in n.children], n.type_name, n.value,
                        n.array, n.attrs)
        ref = n.value
        if isinstance(ref, _Ref):
            got = values[ref.rank][ref.index] if ref.index < len(values[ref.rank]) else None
            if got is None or got.kind != n.kind:
                raise ValueError(f"rank {ref.rank}'s value {ref.index} is not a {n.kind}")
            return Node(n.kind, None, None, n.type_name, got.value, None, n.attrs)
        return n

    return go(tree)


def kept_plan(rank: int, digests: tuple[str, ...]) -> KeptPlan | None:
    """The plan this process kept for exactly these digests (rank order), if any."""
    with _LOCK:
        plan = _KEPT.get((rank, digests))
        if plan is not None:
            _KEPT.move_to_end((rank, digests))
        return plan


def keep_plan(rank: int, digests: tuple[str, ...], plan: KeptPlan) -> None:
    """Keep ``plan`` for these digests; the oldest go while more than :data:`KEEP` are
    kept or, beside the newest, they hold more than :data:`KEEP_ARRAYS` arrays."""
    with _LOCK:
        _KEPT[(rank, digests)] = plan
        _KEPT.move_to_end((rank, digests))
        while len(_KEPT) > 1 and (len(_KEPT) > KEEP or
                                  sum(len(p.arrays) for p in _KEPT.values()) > KEEP_ARRAYS):
            _KEPT.popitem(last=False)


def forget_plans() -> None:
    """Drop every kept plan (the next save of each state agrees on it anew)."""
    with _LOCK:
        _KEPT.clear()


# ----------------------------------------------------------------------------- agreement


def agree_on_plan(coll: Collective, tree: Node, decls: Sequence[ArrayDecl],
                  boxes: Sequence[Sequence[_Box]]
                  ) -> tuple[MergedTree, list[list[_Box]], int]:
    """The checkpoint's merged tree, the boxes this process writes and the checkpoint's
    raw size (collective).

    The merged tree is whole on rank 0, which builds the manifest, with the plain
    values. The other ranks get only what they need: the global index of each of
    their own arrays (``index``), with an empty tree and array table where the
    collective can gather to rank 0 (then rank 0 alone merges and assigns the
    writers), else the whole tree with placeholders for the plain values.

    ``tree`` is this process's walked tree, ``decls`` its arrays and ``boxes`` the
    boxes it holds of each. The plan of an earlier save of the same structure is
    reused when every process kept it (see the module docstring).

    Raises:
        DistributedError: the processes' trees or arrays disagree (the same error on
            every process, naming what each holds at which key path).
    """
    arrays = [[d.key, d.dtype, list(d.shape), [[list(s), list(b)] for s, b in bx]]
              for d, bx in zip(decls, boxes)]
    structure, values = split_values(tree)
    encoded = encode_tree(structure)
    first = coll.all_gather_object({"d": plan_digest(encoded, arrays),
                                    "v": encode_tree(Node("list", children=values))})
    digests = tuple(str(g["d"]) for g in first)
    kept = kept_plan(coll.rank, digests)
    missed = any_of(coll, "reusing the save plan", kept is None)  # every process asks
    if missed or kept is None:
        plan = _plan_anew(coll, encoded, arrays, digests)
    else:
        plan = kept
        _hooks.fire("save.plan_reused")
    # Only rank 0 builds the manifest, so only rank 0 needs the values in the tree
    # (filling it elsewhere would be work in the size of the whole job again); on the
    # others the plain leaves keep their placeholders.
    tree_out = plan.tree
    if coll.rank == 0:
        tree_out = fill_values(plan.tree,
                               [decode_tree(g["v"], 0).children or [] for g in first])
    return MergedTree(tree_out, plan.arrays, plan.index), plan.mine, plan.total_bytes


def _plan_anew(coll: Collective, encoded: dict[str, Any], arrays: list[Any],
               digests: tuple[str, ...]) -> KeptPlan:
    """Merge every process's structure and assign the writers; keep the plan for the
    next save of these digests (collective).

    With ``gather_object`` the structures go to rank 0 alone, which merges them,
    assigns every writer and broadcasts every process's part of the plan (its
    arrays' global numbers and which of its boxes it writes: integers): the
    other processes decode and merge no trees and keep no merged tree. Otherwise every
    process gathers every structure and plans the same.
    """
    # the arrays this process holds no element of (empty shards): the merge lets the
    # processes that hold some say whether they are tied (plan/_manifest.py)
    unheld = [i for i, a in enumerate(arrays) if not any(math.prod(b) for _, b in a[3])]
    mine_only = {"tree": encoded, "arrays": arrays, "unheld": unheld}
    gather = getattr(coll, "gather_object", None)
    if gather is None:
        gathered = coll.all_gather_object(mine_only)
        plan: KeptPlan | None = None
        err = None
        try:
            plan = _plan_from(gathered, coll.rank)[0]
        except BaseException as exc:
            err = exc
        agree(coll, "planning", err)
        assert plan is not None
    else:
        plan = _plan_on_rank0(coll, gather(mine_only, 0), arrays)
    keep_plan(coll.rank, digests, plan)
    return plan


def _plan_from(gathered: list[Any], rank: int) -> tuple[KeptPlan, list[Any]]:
    """``rank``'s plan from every structure, and every rank's part of it: the global
    number of each of its arrays, per array the positions of the boxes it writes,
    and the checkpoint's raw size."""
    try:
        merged = _agree_on_tree(gathered)
        owners = _owners(gathered, merged.tied)
    except TargetMismatchError as exc:  # ``agree`` adds that nothing was committed
        raise DistributedError(f"planning failed: {exc}") from exc
    total = total_bytes(merged.arrays)
    # (an array tied to another, ``merged.tied``, has no box with an element to write)
    parts = [([merged.index[k] for k, _, _, _ in g["arrays"]],
              [[i for i, (s, b) in enumerate(bx) if owners.get((k, tuple(s), tuple(b))) == r]
               for k, _, _, bx in g["arrays"]], total)
             for r, g in enumerate(gathered)]
    plan = KeptPlan(merged.tree, list(merged.arrays), merged.index,
                    _boxes_at(gathered[rank]["arrays"], parts[rank][1]), total)
    return plan, parts


def _plan_on_rank0(coll: Collective, gathered: list[Any] | None, arrays: list[Any]
                   ) -> KeptPlan:
    """Rank 0 plans from every structure (``gathered``, there only) and broadcasts each
    process's part (see :func:`_plan_from`); the others keep only theirs."""
    plan: KeptPlan | None = None
    parts: list[Any] = []
    err: BaseException | None = None
    if coll.rank == 0:
        try:
            assert gathered is not None
            plan, parts = _plan_from(gathered, 0)
        except BaseException as exc:
            err = exc
    agree(coll, "planning", err)
    sent = coll.broadcast_object(parts if coll.rank == 0 else None, src=0)
    if plan is not None:
        return plan
    numbers, writes, total = sent[coll.rank]
    index = {k: int(n) for (k, _, _, _), n in zip(arrays, numbers)}
    return KeptPlan(Node("dict", keys=[], children=[]), [], index,
                    _boxes_at(arrays, writes), int(total))


def _boxes_at(arrays: list[Any], writes: list[list[int]]) -> list[list[_Box]]:
    """This process's boxes at the positions ``writes`` names, per array."""
    return [[(tuple(bx[i][0]), tuple(bx[i][1])) for i in w]
            for (_, _, _, bx), w in zip(arrays, writes)]


def total_bytes(arrays: Sequence[Any]) -> int:
    """Raw bytes of every array (``dtype``, ``shape``): a manifest's ``total_bytes``."""
    return sum(math.prod(a.shape) * itemsize_of(a.dtype) for a in arrays)


def _agree_on_tree(gathered: list[Any]) -> MergedTree:
    """The checkpoint's tree from every rank's structure (the same on every rank, so
    every rank raises the same error, naming what each rank holds where); its plain
    leaves point at the ranks' values."""
    ranks = [RankTree(with_refs(decode_tree(g["tree"], len(g["arrays"])), r),
                      [ArrayDecl(k, dt, tuple(sh)) for k, dt, sh, _ in g["arrays"]],
                      frozenset(g["unheld"]))
             for r, g in enumerate(gathered)]
    return merge_trees(ranks)


def _owners(gathered: list[Any], tied: dict[str, str]
            ) -> dict[tuple[str, tuple[int, ...], tuple[int, ...]], int]:
    """The writing rank of every distinct box of every array (whose distinct boxes must
    cover it exactly once), but for the arrays ``tied`` to another (stored as it)."""
    per_rank = [
        [(k, dt, tuple(sh), [(tuple(s), tuple(b)) for s, b in boxes])
         for k, dt, sh, boxes in g["arrays"] if not tied or k not in tied]
        for g in gathered
    ]
    return assign_writers(per_rank, {n: itemsize_of(n) for n in DTYPE_NAMES})
