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
still checked as a reader would before it is committed.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import threading
from collections.abc import Sequence
from typing import Any

from statestream.tree import Node

__all__ = ["KeptPlan", "fill_values", "forget_plans", "kept_plan", "keep_plan",
           "plan_digest", "split_values", "with_refs"]

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
    the boxes of each local array this process writes.
    """

    tree: Node
    arrays: list[Any]
    index: dict[str, int]
    mine: list[list[tuple[tuple[int, ...], tuple[int, ...]]]]


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
