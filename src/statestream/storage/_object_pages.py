"""Object stores: listings that end, even when the store's paging never does.

A store answers a listing in pages; each page but the last names a continuation token
to ask for the next one. A store (or a proxy in front of it) that answers a token it
answered before -- the same one again, or a cycle of them -- would be listed forever.

The client (obstore, over the Rust crate object_store) does the paging itself, for
``obstore.list`` and ``obstore.list_with_delimiter`` alike: the tokens never reach
Python, and object_store follows every token it is given, seen before or not. Measured
on moto behind a proxy that repeats the token (2026-12-07, obstore 0.12.1): a listing
whose pages hold objects hands us the same keys again (:func:`listed
<statestream.storage._object_list.listed>` stops at the first key listed twice), but a
listing whose repeated pages are *empty* never hands anything back to Python --
``next()`` of the stream does not return -- and ``list_with_delimiter``, which collects
every page before it returns, never returns at all. Both run about 250 requests a
second until the process ends.

What is ours to check is the time between answers. Here every listing runs through the
client's asynchronous calls, on one event loop thread of this module, under a bound:
:func:`stall_s` (twice the longest one request may take with its retries,
``timeout_s + retry_timeout_s``) for each batch of objects of a flat listing (a batch
of up to 1000 objects spans one or two pages, each of which a healthy store answers
well within that), and for the whole of a listing with a delimiter (it hands nothing
back before its end; its pages are one per 1000 direct children of a prefix, which a
store answers in milliseconds each). A listing that hands back nothing for that long
is a StorageError naming its URL; cancelling the call stops the client's requests
(measured: none after it).
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from statestream.errors import StorageError
from statestream.storage._object_fork import check as fork_check

if TYPE_CHECKING:
    from statestream.storage._object import ObjectStorage

__all__ = ["delimited", "pages", "stall_s"]

T = TypeVar("T")

_lock = threading.Lock()
#: the event loop the listings run on, its thread, and the process that started it (a
#: forked child has the loop object but not its thread: it starts its own)
_runner: tuple[asyncio.AbstractEventLoop, int] | None = None


def _forget() -> None:
    """In a forked child: a lock another thread of the parent held would never be
    released, and the loop's thread is not there."""
    global _lock, _runner
    _lock, _runner = threading.Lock(), None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget)


class _Stalled(Exception):
    """The call handed nothing back within its bound."""


def _loop() -> asyncio.AbstractEventLoop:
    global _runner
    with _lock:
        if _runner is None or _runner[1] != os.getpid():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="statestream-listing",
                             daemon=True).start()
            _runner = (loop, os.getpid())
        return _runner[0]


def _run(make: Callable[[], Awaitable[T]], limit: float) -> T:
    """The result of the awaitable ``make()`` returns, on the listing loop (its own
    thread: a caller inside a running event loop, as in a notebook, can wait on it);
    :class:`_Stalled` when it takes longer than ``limit`` seconds (it is then
    cancelled, which stops the client's requests). A StorageError in a process forked
    from one that ran the client: a listing begun before the fork does not go on."""
    fork_check()

    async def bounded() -> T:
        try:
            return await asyncio.wait_for(make(), limit)
        except asyncio.TimeoutError:
            raise _Stalled from None

    fut = asyncio.run_coroutine_threadsafe(bounded(), _loop())
    try:
        return fut.result()
    except BaseException:
        fut.cancel()  # an interrupt: stop the client's requests too
        raise


def stall_s(owner: ObjectStorage) -> float:
    """How long a listing may hand back nothing: twice the longest one request may take
    with its retries (``timeout_s + retry_timeout_s``, see the options)."""
    return 2 * (float(owner.options.timeout_s) + float(owner.options.retry_timeout_s))


def _stalled(owner: ObjectStorage, bucket: str, prefix: str, limit: float,
             what: str) -> StorageError:
    return StorageError(
        f"listing {owner._url(bucket, prefix)} failed: the store {what} for {limit:g} s "
        "(twice the longest one request may take with its retries, timeout_s + "
        "retry_timeout_s): it answers pages without end (a continuation token that "
        "repeats or loops, pages with nothing in them), which the client follows by "
        "itself; stopped instead of listing forever")


def pages(owner: ObjectStorage, bucket: str, prefix: str, **kw: Any) -> Iterator[Any]:
    """The batches of ``obstore.list`` of ``prefix`` (keyword arguments passed on), each
    within :func:`stall_s`, else a StorageError naming the listing."""
    import obstore

    stream = obstore.list(owner._store(bucket), prefix=prefix, **kw)
    limit = stall_s(owner)

    async def batch() -> Any:
        try:
            return await stream.__anext__()
        except StopAsyncIteration:
            return None

    while True:
        try:
            got = _run(batch, limit)
        except _Stalled:
            raise _stalled(owner, bucket, prefix, limit, "answered no object") from None
        if got is None:
            return
        yield got


def delimited(owner: ObjectStorage, bucket: str, prefix: str) -> Any:
    """``obstore.list_with_delimiter`` of ``prefix``, within :func:`stall_s`, else a
    StorageError naming the listing."""
    import obstore

    store = owner._store(bucket)
    limit = stall_s(owner)
    try:
        return _run(lambda: obstore.list_with_delimiter_async(store, prefix=prefix), limit)
    except _Stalled:
        raise _stalled(owner, bucket, prefix, limit, "did not finish its listing (with a "
                       "delimiter)") from None
