"""Read pipeline: coalesced requests on worker threads, every chunk verified."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from statestream._memory import fresh_bytes
from statestream.engine._codec import decode_chunk
from statestream.engine._core import (
    ByteBudget,
    IOOptions,
    Progress,
    _Progress,
    _read_threads,
    _run_all,
)
from statestream.engine._refs import chunk_digest, digest_hasher
from statestream.errors import (
    CheckpointCorruptError,
    CheckpointGoneError,
    ChecksumMismatchError,
    TruncatedFileError,
)
from statestream.format import checksum
from statestream.plan import ReadPiece, ReadRequest
from statestream.storage import CheckpointReader, MappedReader, file_where

__all__ = ["read_requests"]
# ----------------------------------------------------------------------------- read


def read_requests(
    reader: CheckpointReader,
    file_names: Sequence[str],
    requests: Sequence[ReadRequest],
    *,
    options: IOOptions,
    budget: ByteBudget,
    describe: Callable[[ReadPiece], str],
    progress: Progress | None = None,
    collect: list[CheckpointCorruptError] | None = None,
) -> None:
    """Execute read requests on worker threads, verifying every chunk's CRC-32C.

    Pieces with a ``direct`` destination are read in place; the rest go
    through scratch buffers charged to ``budget`` and are scattered. Mapped
    pieces (``direct`` maps their own file bytes) are only verified: the
    checksum pass reads their pages in (the kernel's fault readahead; an explicit
    ``MADV_WILLNEED`` measured slower), on the worker threads in parallel.

    With ``collect``, corruption is appended there and reading goes on
    (``verify``); otherwise the first problem is raised. A checkpoint overwritten
    or deleted while being read is raised either way (``CheckpointGoneError``).

    Raises:
        ChecksumMismatchError: naming the array (via ``describe``) and file.
        TruncatedFileError: a file ends early or is missing.
    """
    local = isinstance(reader, MappedReader)  # a read is a syscall, not a request
    # lets the page cache drop what the reads bring in (storage/_pagecache.py)
    dropper = (_DropBehind(reader) if isinstance(reader, MappedReader) and options.drop_behind
               else None)
    requests = split_checked(split_streamed(reader, list(requests)))
    prog = _Progress(sum(r.nbytes for r in requests), progress)
    lock = threading.Lock()
    n = max(1, min(_read_threads(options), len(requests)))
    queue = fit_requests(requests, max(1, budget.capacity // n))
    queue.reverse()

    def next_request() -> ReadRequest | None:
        with lock:
            return queue.pop() if queue else None

    def worker() -> None:
        while True:
            req = next_request()
            if req is None:
                return
            if collect is None:
                _read_one(req)
                continue
            try:
                _read_one(req)
            except CheckpointGoneError:
                raise  # overwritten or deleted meanwhile: not damage
            except CheckpointCorruptError as exc:
                with lock:
                    collect.append(exc)

    def _read_one(req: ReadRequest) -> None:
        _check_supply(reader, file_names[req.file], req, describe)
        name = file_names[req.file]
        held = budget.acquire(_scratch_bytes(req) + _decode_bytes(reader, name, req))
        try:
            _read_request(reader, file_names[req.file], req, describe, collect, lock,
                          local=local, dropper=dropper)
            prog.add(req.nbytes)
        finally:
            budget.release(held)

    try:
        _run_all(n, [worker for _ in range(n)])
    finally:
        if dropper is not None:
            dropper.finish()


def _read_request(reader: CheckpointReader, name: str, req: ReadRequest,
                  describe: Callable[[ReadPiece], str],
                  collect: list[CheckpointCorruptError] | None, lock: threading.Lock, *,
                  local: bool, dropper: _DropBehind | None) -> None:
    """Read, verify and place one request's pieces (its scratch already granted)."""
    if dropper is not None:
        dropper.note(name)
    if local and all(_streamable(p) for p in req.pieces):
        for p in req.pieces:
            _record(_read_checked(reader, name, p, describe, dropper), collect, lock)
        return
    if len(req.pieces) == 1 and _checked_in_steps(req.pieces[0]):
        p = req.pieces[0]
        _record(_check_in_steps(reader, name, p, describe, _SLICE if local else _CHECK_STEP),
                collect, lock)
        if dropper is not None:
            dropper.drop(name, p.offset, p.offset + p.nbytes)
        return
    mapped = req.pieces[0].mapped
    if mapped:  # the bytes are mapped: touching them reads them
        views = [p.direct for p in req.pieces if p.direct is not None]
    else:
        views = _read_span(reader, name, req, describe)
    for p, buf in zip(req.pieces, views):
        _finish_piece(reader, name, p, buf, describe, collect, lock)
    if dropper is not None and not mapped:  # copied and checked: let them go
        dropper.drop(name, req.offset, req.offset + req.nbytes)


#: Local pieces at least this large, read in place, are read and checksummed in slices
#: of this size, each checked while it is still in the CPU's caches (one pass over
#: memory instead of two).
_SLICE = 1 << 20
_STREAM_MIN = 4 * _SLICE
#: a streamed piece lets the page cache drop what it read every this many bytes
_DROP_STEP = 8 * _SLICE


def _streamable(p: ReadPiece) -> bool:
    """A large raw piece read straight into its destination."""
    return (p.direct is not None and p.codec is None and not p.mapped and not p.scatter
            and p.nbytes >= _STREAM_MIN)


def split_streamed(reader: CheckpointReader, requests: list[ReadRequest]) -> list[ReadRequest]:
    """``requests`` with each streamable piece of a local file in a request of its own,
    read slice by slice (:func:`_read_checked`); small pieces stay coalesced around it,
    so a state mixing large and small arrays in one file still streams the large ones.
    Object stores keep whole requests (a read there is an HTTP request)."""
    if not isinstance(reader, MappedReader):
        return requests
    return _split_out(requests, _streamable)


#: A piece read only to check it (``verify``: no destination, no codec) larger than
#: this is read through one scratch buffer of at most this size, not whole: a 64 MiB
#: chunk took 64 MiB of scratch (two reader threads: 128 MiB), whatever the budget.
_CHECK_STEP = 8 << 20


def _checked_in_steps(p: ReadPiece) -> bool:
    return p.direct is None and p.codec is None and not p.scatter and p.nbytes > _CHECK_STEP


def split_checked(requests: list[ReadRequest]) -> list[ReadRequest]:
    """``requests`` with each piece read only to be checked, larger than
    :data:`_CHECK_STEP`, in a request of its own (:func:`_check_in_steps`)."""
    return _split_out(requests, _checked_in_steps)


def _split_out(requests: list[ReadRequest], alone: Callable[[ReadPiece], bool]
               ) -> list[ReadRequest]:
    """``requests`` with each piece for which ``alone`` holds in a request of its own;
    the pieces between them stay coalesced."""
    out: list[ReadRequest] = []
    for r in requests:
        if len(r.pieces) == 1 or not any(alone(p) for p in r.pieces):
            out.append(r)
            continue
        run: list[ReadPiece] = []
        for p in [*r.pieces, None]:
            if p is None or alone(p):
                if run:
                    end = run[-1].offset + run[-1].nbytes
                    out.append(ReadRequest(r.file, run[0].offset, end - run[0].offset, run))
                    run = []
                if p is not None:
                    out.append(ReadRequest(r.file, p.offset, p.nbytes, [p]))
            else:
                run.append(p)
    return out


def _check_in_steps(reader: CheckpointReader, name: str, p: ReadPiece,
                    describe: Callable[[ReadPiece], str], step: int
                    ) -> ChecksumMismatchError | None:
    """Read piece ``p`` (no destination) through one scratch buffer of ``step`` bytes,
    each read spanning as many consecutive checksum blocks as fit (:func:`_steps`),
    checksumming each block inside it; the first mismatch, or None. A piece without
    checksums (a foreign format's) is still read through, as a whole read would."""
    checks: list[tuple[int, int, int | None]] = [*p.checks()] or [(0, p.nbytes, None)]
    buf = fresh_bytes(min(step, p.nbytes))
    hasher = digest_hasher() if p.digest is not None else None
    k, got = 0, 0  # the block being checked, its CRC so far
    for s, e in _steps(checks, step):
        view = buf[:e - s]
        try:
            reader.read_into(name, p.offset + s, [view])
        except CheckpointCorruptError as exc:  # missing, truncated, symlinked file
            raise type(exc)(f"{exc} (affects {describe(p)})") from None
        if hasher is not None:
            hasher.update(view.data)
        while k < len(checks) and checks[k][0] < e:
            a, b, want = checks[k]
            got = checksum(view[max(a, s) - s:min(b, e) - s], got)
            if b > e:
                break  # the block goes on in the next read
            if want is not None and got != want:
                return _mismatch(reader, name, p, a, b, got, want, describe)
            k, got = k + 1, 0
    if hasher is not None and bytes(hasher.digest()) != p.digest:
        return _digest_mismatch(reader, name, p, bytes(hasher.digest()), describe)
    return None


def _steps(checks: Sequence[tuple[int, int, int | None]], step: int) -> Iterator[tuple[int, int]]:
    """The reads ``[s, e)`` of at most ``step`` bytes that cover ``checks`` in order:
    consecutive blocks share one (a read per ~1 MiB block took an object store 256
    requests for 256 MiB); a block is cut only where it alone exceeds ``step``."""
    lo = hi = -1  # the run of whole blocks not read yet
    for a, b, _ in checks:
        if lo >= 0 and (a != hi or b - lo > step):
            yield lo, hi
            lo = -1
        if b - a > step:
            yield from ((x, min(b, x + step)) for x in range(a, b, step))
            continue
        if lo < 0:
            lo = a
        hi = b
    if lo >= 0:
        yield lo, hi


def _read_checked(reader: CheckpointReader, name: str, p: ReadPiece,
                  describe: Callable[[ReadPiece], str],
                  dropper: _DropBehind | None = None) -> ChecksumMismatchError | None:
    """Read piece ``p`` into its destination in slices, checksumming each slice as it
    lands; the first mismatch, or None. ``dropper``: every :data:`_DROP_STEP` bytes,
    let the page cache drop the pages the read brought in."""
    assert p.direct is not None
    checks = p.checks()
    kept = checks[0][0] if checks else 0  # bytes [kept, s) are read and checked, not dropped
    end = checks[-1][1] if checks else 0
    for a, b, want in checks:
        got = 0
        for s in range(a, b, _SLICE):
            e = min(b, s + _SLICE)
            view = p.direct[s:e]
            try:
                reader.read_into(name, p.offset + s, [view])
            except CheckpointCorruptError as exc:  # missing, truncated, symlinked file
                raise type(exc)(f"{exc} (affects {describe(p)})") from None
            got = checksum(view, got)
            # every _DROP_STEP bytes, across block checksums (~1 MiB each): an
            # fadvise per block made a cold in-place load of 3 GB 1.3x slower
            if dropper is not None and (e - kept >= _DROP_STEP or e == end):
                dropper.drop(name, p.offset + kept, p.offset + e)
                kept = e
        if got != want:
            return _mismatch(reader, name, p, a, b, got, want, describe)
    return None


class _DropBehind:
    """Lets the page cache drop the pages a load read in (``IOOptions.drop_behind``):
    those of each file that were not cached when the load first came to it. One map
    per file, made before anything of it is read, so pages that the kernel's
    readahead brings in for the next request count as the load's own."""

    def __init__(self, reader: MappedReader) -> None:
        self._reader = reader
        self._cold: dict[str, list[tuple[int, int]]] = {}
        self._lock = threading.Lock()

    def note(self, name: str) -> None:
        """Call before reading from ``name``."""
        if name in self._cold:
            return
        with self._lock:
            if name not in self._cold:
                self._cold[name] = self._reader.cold_ranges(name, 0, self._reader.file_size(name))

    def drop(self, name: str, lo: int, hi: int) -> None:
        """Bytes ``[lo, hi)`` of ``name`` are copied and checked: let their pages go."""
        cold = self._cold.get(name)
        if cold:
            self._reader.drop_cached(name, cold, lo, hi)

    def finish(self) -> None:
        """Reading is over: once more, let go of every page that was not cached before
        (the kernel's readahead for one request may have brought back pages that a
        request on another thread had already let go)."""
        for name, cold in self._cold.items():
            if cold:
                self._reader.drop_cached(name, cold, 0, cold[-1][1])


def _record(err: CheckpointCorruptError | None, collect: list[CheckpointCorruptError] | None,
            lock: threading.Lock) -> None:
    """Raise ``err``, or add it to ``collect`` (``verify``)."""
    if err is None:
        return
    if collect is None:
        raise err
    with lock:
        collect.append(err)


def _scratch_bytes(req: ReadRequest) -> int:
    """Memory reading ``req`` takes beyond its destinations: its pieces' scratch and
    decoding buffers, and the gaps between them (read and dropped)."""
    if len(req.pieces) == 1 and _checked_in_steps(req.pieces[0]):
        return _CHECK_STEP  # read through one buffer of at most this
    need = sum(p.staging_bytes for p in req.pieces)
    if not req.pieces[0].mapped:  # mapped requests read nothing into buffers
        need += req.nbytes - sum(p.nbytes for p in req.pieces)
    return need


def _decode_bytes(reader: CheckpointReader, name: str, req: ReadRequest) -> int:
    """Memory the reader itself holds to read ``req``'s pieces, beyond their scratch: a
    foreign format that decodes a whole storage chunk to serve part of it (Orbax) says so
    through ``decode_bytes``, so that the budget lets one such read through at a time."""
    fn = getattr(reader, "decode_bytes", None)
    if fn is None:
        return 0
    return max((int(fn(name, p.offset, p.nbytes)) for p in req.pieces), default=0)


def fit_requests(requests: Sequence[ReadRequest], limit: int) -> list[ReadRequest]:
    """``requests``, those whose scratch (:func:`_scratch_bytes`) exceeds ``limit``
    split at piece boundaries, so every reader thread can hold one within the budget
    (``limit``: its share). A single piece larger than ``limit`` stays a request of its
    own: the budget lets it through when nothing else is held."""
    out: list[ReadRequest] = []
    for r in requests:
        if _scratch_bytes(r) <= limit:
            out.append(r)
            continue
        cur: ReadRequest | None = None
        held = 0
        for p in r.pieces:
            need = p.staging_bytes
            if cur is not None:
                need += p.offset - (cur.offset + cur.nbytes)  # the gap before it
                if held + need <= limit:
                    cur.pieces.append(p)
                    cur.nbytes = p.offset + p.nbytes - cur.offset
                    held += need
                    continue
            cur = ReadRequest(r.file, p.offset, p.nbytes, [p])
            held = p.staging_bytes
            out.append(cur)
    return out


def _finish_piece(reader: CheckpointReader, name: str, p: ReadPiece, buf: np.ndarray,
                  describe: Callable[[ReadPiece], str],
                  collect: list[CheckpointCorruptError] | None, lock: threading.Lock) -> None:
    """Verify one piece's bytes, decode them (a codec), scatter them to their views."""
    err = _verify_piece(reader, name, p, buf, describe)
    if err is not None:
        _record(err, collect, lock)
        return
    if p.codec is not None:
        raw = _decode_piece(reader, name, p, buf, describe, collect, lock)
        if raw is None:
            return
        buf = raw
    if p.digest is not None and chunk_digest(buf) != p.digest:
        _record(_digest_mismatch(reader, name, p, chunk_digest(buf), describe), collect, lock)
        return
    if p.scatter:
        src = buf.view(p.dtype).reshape(p.chunk_shape)
        for dview, csl in p.scatter:
            dview[...] = src[csl] if csl else src


def _read_span(reader: CheckpointReader, name: str, req: ReadRequest,
               describe: Callable[[ReadPiece], str]) -> list[np.ndarray]:
    """Read ``req``'s byte span in one call; the buffer of each piece, in order.

    Gaps between pieces go to throw-away buffers; a piece with a ``direct``
    destination is read in place.
    """
    bufs: list[Any] = []
    views: list[np.ndarray] = []
    pos = req.offset
    gap: np.ndarray | None = None  # one throw-away buffer serves every gap (64-byte padding)
    for p in req.pieces:
        if p.offset > pos:
            n = p.offset - pos
            if gap is None or gap.nbytes < n:
                gap = np.empty(max(n, 4096), dtype=np.uint8)
            bufs.append(gap[:n])
        buf = (p.direct if p.direct is not None and p.codec is None
               else fresh_bytes(p.nbytes))
        bufs.append(buf)
        views.append(buf)
        pos = p.offset + p.nbytes
    try:
        reader.read_into(name, req.offset, bufs)
    except CheckpointCorruptError as exc:  # missing, truncated, symlinked file
        names = "; ".join(sorted({describe(p) for p in req.pieces})[:5])
        raise type(exc)(f"{exc} (affects {names})") from None
    return views


def _decode_piece(reader: CheckpointReader, name: str, p: ReadPiece, stored: np.ndarray,
                  describe: Callable[[ReadPiece], str],
                  collect: list[CheckpointCorruptError] | None,
                  lock: threading.Lock) -> np.ndarray | None:
    """Decode a verified compressed piece into its destination (or scratch, returned
    for scattering); None when it is corrupt and ``collect`` took the error."""
    assert p.codec is not None
    out = p.direct if p.direct is not None else fresh_bytes(p.raw_nbytes)
    try:
        decode_chunk(stored, out, p.dtype.itemsize, p.codec, p.shuffle)
    except CheckpointCorruptError as exc:
        err = CheckpointCorruptError(
            f"compressed chunk {p.chunk} of the {describe(p)} (bytes [{p.offset}, "
            f"{p.offset + p.nbytes}) of {file_where(reader, name)}, CRC-32C correct) does not "
            f"decode to its {p.raw_nbytes} bytes: {exc}; the checkpoint is corrupt or was "
            "written by a faulty writer")
        if collect is None:
            raise err from None
        with lock:
            collect.append(err)
        return None
    return out


def _verify_piece(reader: CheckpointReader, name: str, p: ReadPiece, buf: np.ndarray,
                  describe: Callable[[ReadPiece], str]) -> ChecksumMismatchError | None:
    """The first checksum mismatch in piece ``p`` (read into ``buf``), or None."""
    for a, b, want in p.checks():
        got = checksum(buf[a:b])
        if got != want:
            return _mismatch(reader, name, p, a, b, got, want, describe)
    return None


def _mismatch(reader: CheckpointReader, name: str, p: ReadPiece, a: int, b: int, got: int,
              want: int, describe: Callable[[ReadPiece], str]) -> ChecksumMismatchError:
    return ChecksumMismatchError(
        f"checksum mismatch in {describe(p)}: chunk {p.chunk}, bytes "
        f"[{p.offset + a}, {p.offset + b}) of "
        f"{file_where(reader, name)} have CRC-32C {got:08x}, "
        f"the manifest says {want:08x}; the checkpoint is corrupt, "
        "restore it from another copy"
    )


def _digest_mismatch(reader: CheckpointReader, name: str, p: ReadPiece, got: bytes,
                     describe: Callable[[ReadPiece], str]) -> ChecksumMismatchError:
    """A chunk whose CRC-32C is right but whose raw bytes do not have the XXH3-128 its
    record gives (the hash an incremental save matched it by): the record was changed,
    or a save referred to a base chunk whose record lied, and loads it silently."""
    assert p.digest is not None
    return ChecksumMismatchError(
        f"hash mismatch in {describe(p)}: chunk {p.chunk} (bytes [{p.offset}, "
        f"{p.offset + p.nbytes}) of {file_where(reader, name)}, CRC-32C correct) has "
        f"XXH3-128 {got.hex()}, the manifest says {p.digest.hex()}; its record was altered "
        "(here, or in the base checkpoint a save matched it in): the checkpoint does not "
        "hold what was saved")


def _check_supply(reader: CheckpointReader, name: str, req: ReadRequest,
                  describe: Callable[[ReadPiece], str]) -> None:
    """Refuse a request the file cannot supply, before any scratch memory is allocated
    for it (a manifest may claim terabytes in a file of a few bytes)."""
    try:
        size = reader.file_size(name)
    except CheckpointCorruptError as exc:
        names = "; ".join(sorted({describe(p) for p in req.pieces})[:5])
        raise type(exc)(f"{exc} (affects {names})") from None
    end = req.offset + req.nbytes
    if end > size:
        bad = [p for p in req.pieces if p.offset + p.nbytes > size]
        names = "; ".join(sorted({describe(p) for p in bad})[:5])
        raise TruncatedFileError(
            f"data file {file_where(reader, name)} is {size} bytes, but the manifest puts "
            f"data up to byte {max(p.offset + p.nbytes for p in bad)} in it; it is "
            f"truncated (affects {names})"
        )
