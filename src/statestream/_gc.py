"""Pause the cyclic garbage collector while a save or load builds many objects.

Walking a state of 20,000 tensors allocates hundreds of thousands of small
objects; each allocation burst triggers full collections that traverse the
whole heap (including every framework object), which measured ~2x the CPU
time of the walk itself. Nothing we allocate forms cycles (checked by
tests/engine/test_no_cycles.py), so everything is freed by reference
counting and collection is deferred to the end of the call. Nested and
concurrent pauses are counted; the collector is re-enabled only if it was
enabled before the first one.

An asynchronous save pauses it from its start until its outcome is known
(:func:`pause`, released by the save's background thread): the objects the walk
made live until the commit, and collections set off while they did traversed
them again and again, and then the whole heap (0.4-0.5 s for 20,000 tensors,
holding the interpreter lock the training thread needs). ``gc.collect()`` still
runs when called.

A child forked meanwhile (a data loader's workers, started while a save runs in
the background) has none of the parent's saves: it gets the collector back at once,
and the parent's pauses end there without it.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
from collections.abc import Callable, Iterator

__all__ = ["gc_paused", "pause"]

_lock = threading.Lock()
_depth = 0
_was_enabled = False
#: bumped in a forked child: pauses taken before the fork end without it there
_generation = 0


def pause() -> Callable[[], None]:
    """Disable ``gc`` until the returned call (which does nothing the second time)."""
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
        generation = _generation
    done = [False]

    def resume() -> None:
        global _depth
        with _lock:
            if done[0] or generation != _generation:
                done[0] = True
                return
            done[0] = True
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()

    return resume


def _resume_in_child() -> None:
    global _lock, _depth, _generation
    _lock = threading.Lock()  # a thread that held it is not in the child
    if _depth and _was_enabled:
        gc.enable()
    _depth = 0
    _generation += 1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_resume_in_child)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Disable ``gc`` for the duration of the block (re-entrant, thread-safe)."""
    resume = pause()
    try:
        yield
    finally:
        resume()
