"""Quieting what orbax abandons: tensorstore operations that finish after the event
loop orbax awaited them on was closed (see :func:`quiet_late_loop_callbacks`), and
coroutines it made and never awaited (:func:`drop_abandoned`)."""

from __future__ import annotations

import sys
import threading
import traceback
import warnings
from typing import Any

__all__ = ["drop_abandoned", "quiet_late_loop_callbacks"]

_QUIET_LOCK = threading.Lock()
_quiet_installed = False


def _is_late_loop_callback(u: Any) -> bool:
    """An unraisable ``RuntimeError('Event loop is closed')`` raised by asyncio's
    ``call_soon_threadsafe``: a tensorstore operation finishing after the event
    loop that awaited it was closed."""
    exc, tb = u.exc_value, u.exc_traceback
    if type(exc) is not RuntimeError or str(exc) != "Event loop is closed":
        return False
    names = []
    while tb is not None:
        names.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    return "call_soon_threadsafe" in names


def quiet_late_loop_callbacks() -> None:
    """Keep the operations a failed orbax call abandons from printing.

    orbax runs a restore or ``metadata()`` as a coroutine over many tensorstore
    operations on an event loop of its own; when one fails, it closes that loop
    while the others are still running, and each of those, finishing, calls
    ``call_soon_threadsafe`` on the closed loop from a tensorstore thread, which
    reports the ``RuntimeError`` through ``sys.unraisablehook``: a traceback per
    array on stderr, after the error the caller got. This wraps the hook (once in
    the process, when an Orbax checkpoint is first opened: an abandoned operation
    may finish before the failure reaches the caller) so that exactly those
    reports are dropped; every other goes to the hook that was there.
    """
    global _quiet_installed
    with _QUIET_LOCK:
        if _quiet_installed:
            return
        previous = sys.unraisablehook

        def hook(u: Any) -> None:
            if not _is_late_loop_callback(u):
                previous(u)

        sys.unraisablehook = hook
        _quiet_installed = True


def drop_abandoned(exc: BaseException) -> None:
    """Free the locals of the frames ``exc`` went through, quietly: orbax makes each
    type handler's ``metadata()`` coroutine before awaiting them, and one failing (an
    unknown value type in _METADATA) left the others never awaited, each printing a
    RuntimeWarning when the caller's error was freed, at the caller's line."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        traceback.clear_frames(exc.__traceback__)
        for e in (exc.__cause__, exc.__context__):
            if e is not None:
                traceback.clear_frames(e.__traceback__)
