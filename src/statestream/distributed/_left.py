"""Why a rank left: a short record in the job's key-value store.

A rank whose own code raised inside ``with CheckpointManager(...)`` leaves the
block; the other ranks wait for it in their next statestream collective until
its timeout (or until its sockets break). Before closing, the leaving rank
writes one bounded record ("its ``with CheckpointManager(...)`` block raised
ValueError: ...") under a key of its own in the collective's store
(torch.distributed's rendezvous store, JAX's coordination service). A rank
whose collective then fails reads the records of its peers at that moment and
names who left and why. A rank clears its record when it opens its next
manager, so a later manager does not read a stale one.

Diagnostics only: nothing here decides whether a collective failed, and a
collective without a store (one process) records nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["MAX_CHARS", "forget_left", "left_key", "left_notes", "left_text", "note_left",
           "with_notes"]

#: The longest record kept (characters); longer ones are cut.
MAX_CHARS = 500


def left_key(process: int) -> str:
    """The store key of global rank (JAX: process) ``process``'s record."""
    return f"statestream/left/{process}"


def left_text(error: BaseException, where: str) -> str:
    """What a rank records when ``where`` ends with ``error``, at most :data:`MAX_CHARS`.

    Example:
        >>> left_text(ValueError("bad batch"), "its with CheckpointManager('ck') block")
        "its with CheckpointManager('ck') block raised ValueError: bad batch"
    """
    first = str(error).strip().splitlines()
    what = type(error).__name__ + (f": {first[0]}" if first else "")
    text = f"{where} raised {what}"
    return text if len(text) <= MAX_CHARS else text[:MAX_CHARS - 3] + "..."


def note_left(coll: Any, error: BaseException, where: str) -> None:
    """Record on ``coll``'s store that this rank leaves ``where`` with ``error``
    (nothing if the collective has no store). Never raises."""
    note = getattr(coll, "note_left", None)
    if note is None or getattr(coll, "world_size", 1) <= 1:
        return
    try:
        note(left_text(error, where))
    except Exception:  # noqa: BLE001 - diagnostics only
        pass


def forget_left(coll: Any) -> None:
    """Clear this rank's record on ``coll``'s store (a new manager opens). Never raises."""
    forget = getattr(coll, "forget_left", None)
    if forget is None or getattr(coll, "world_size", 1) <= 1:
        return
    try:
        forget()
    except Exception:  # noqa: BLE001 - diagnostics only
        pass


def left_notes(read: Callable[[int], str | None], peers: Sequence[tuple[int, int]],
               word: str = "rank") -> str:
    """``rank 1 left first: its ... raised ValueError: ...`` for each peer
    ``(group rank, store key id)`` whose record ``read`` finds, joined by '; ';
    '' if none (or the store is gone)."""
    found = []
    for local, key_id in peers:
        try:
            text = read(key_id)
        except Exception:  # noqa: BLE001 - the store is gone: say nothing extra
            return ""
        if text:
            found.append(f"{word} {local} left first: {text[:MAX_CHARS]}")
    return "; ".join(found)


def with_notes(err: BaseException, notes: str) -> BaseException:
    """``err`` with ``notes`` (from :func:`left_notes`) as a last sentence, if any.

    Example:
        >>> str(with_notes(RuntimeError("timed out"), "rank 1 left first: its block raised E"))
        'timed out. Rank 1 left first: its block raised E'
    """
    if not notes:
        return err
    msg = str(err).rstrip()
    return type(err)(f"{msg}{'' if msg.endswith('.') else '.'} {notes[0].upper()}{notes[1:]}")
