"""Chunk codecs (format v2): zstd with optional byte shuffling, run by the engine's
writer and reader threads, and the save option that picks a codec per key path.

Encoding and decoding work chunk by chunk on contiguous byte buffers, so they
run in parallel in the threads that write and read the chunks (zstandard
releases the GIL). ``zstandard`` is imported on first use.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping
from typing import Any, Union

import numpy as np

from statestream._memory import fresh_bytes
from statestream.errors import (
    CheckpointCorruptError,
    CheckpointError,
    InvalidOptionError,
    InvalidOptionTypeError,
)
from statestream.format import Compression
from statestream.tree import KeyPath, match_keypath

__all__ = ["CompressionOption", "CompressionPolicy", "decode_chunk", "encode_chunk"]

#: ``save``'s ``compression``: a codec name, a :class:`Compression`, or a mapping of
#: key-path patterns to either (or ``None``: not compressed). A Union, not ``|``: a
#: runtime alias must work on Python 3.10.
CompressionOption = Union[  # noqa: UP007
    None, str, Compression, Mapping[str, Union[str, Compression, None]]]  # noqa: UP007

#: A chunk stays compressed only when that saves at least 1/32 of its bytes
#: (decoding a chunk that barely shrank costs more than it saves).
_MIN_SAVING = 32

_local = threading.local()


def _zstd() -> Any:
    try:
        import zstandard
    except ImportError as exc:  # pragma: no cover - a declared dependency
        raise CheckpointError(
            "zstd compression needs the zstandard package (a dependency of statestream); "
            f"it could not be imported: {exc}") from exc
    return zstandard


def _compressor(level: int, entropy: bool = False) -> Any:
    """This thread's zstd compressor for ``level`` (contexts are not thread-safe);
    ``entropy``: with a tiny match table (for byte planes whose bytes repeat in value
    but not in runs, e.g. float exponents: 3x faster than the level's own, and smaller)."""
    cache: dict[tuple[int, bool], Any] | None = getattr(_local, "cctx", None)
    if cache is None:
        cache = _local.cctx = {}
    c = cache.get((level, entropy))
    if c is None:
        zstd = _zstd()
        if entropy:
            params = zstd.ZstdCompressionParameters.from_level(level, min_match=7, hash_log=6)
            c = zstd.ZstdCompressor(compression_params=params)
        else:
            c = zstd.ZstdCompressor(level=level)
        cache[(level, entropy)] = c
    return c


def _decompressor(raw: int) -> Any:
    """This thread's decompressor for chunks of ``raw`` bytes: its window is bounded
    by the chunk's size (a power of two, at least 1 KiB), so a tiny hostile frame that
    declares zstd's largest default window (128 MiB) is refused instead of reserving
    that window for the life of the thread; statestream's own frames are written in
    one call with their content size, so their window never exceeds it."""
    log = max(10, (raw - 1).bit_length())
    cache = getattr(_local, "dctx", None)
    if cache is None:
        cache = _local.dctx = {}
    d = cache.get(log)
    if d is None:
        d = cache[log] = _zstd().ZstdDecompressor(max_window_size=1 << log)
    return d


#: Bytes of the sample (from the middle of a byte plane) that picks how to compress it.
_PROBE = 32 << 10
#: zstd's fastest level: for a plane the probe finds incompressible (random mantissa
#: bytes), which it frames faster than level 1 would, at the same size.
_FAST_LEVEL = -7


def _frame(plane: np.ndarray, level: int, shuffled: bool) -> bytes:
    """One zstd frame of ``plane``. A byte plane of shuffled data is first sampled: noise
    is framed at the fastest level; otherwise the level's own matcher or the entropy
    setting (:func:`_compressor`), whichever makes the sample smaller."""
    c = _compressor(level)
    if shuffled and len(plane) >= 4 * _PROBE:
        mid = len(plane) // 2 - _PROBE // 2
        probe = plane[mid:mid + _PROBE]
        own, ent = len(c.compress(probe)), len(_compressor(level, True).compress(probe))
        if min(own, ent) * 32 > _PROBE * 31:
            c = _compressor(min(level, _FAST_LEVEL))
        elif ent <= own:
            c = _compressor(level, True)
    out: bytes = c.compress(plane)
    return out


def encode_chunk(data: np.ndarray, itemsize: int, comp: Compression) -> bytes | None:
    """The stored bytes of a chunk (``data``: contiguous) under ``comp``, or None when
    compressing does not pay (the chunk is then stored raw).

    Shuffled, each byte plane (all first bytes of the elements, then all second
    bytes, ...) is its own zstd frame, the frames concatenated (docs/format.md):
    a plane of random mantissa bytes is framed at zstd's fastest level, and the
    sign/exponent planes with the setting a sample favours (see :func:`_frame`).
    """
    raw = data.reshape(-1).view(np.uint8)
    if comp.shuffle and itemsize > 1:
        cols = raw.reshape(-1, itemsize)
        plane = fresh_bytes(len(cols))
        parts = []
        for j in range(itemsize):
            plane[...] = cols[:, j]
            parts.append(_frame(plane, comp.level, True))
        del plane
        out = b"".join(parts)
        del parts
    else:
        out = _frame(raw, comp.level, False)
    if len(out) * _MIN_SAVING > len(raw) * (_MIN_SAVING - 1):
        return None
    return out


def decode_chunk(stored: np.ndarray, out: np.ndarray, itemsize: int, codec: str,
                 shuffle: bool) -> None:
    """Decode ``stored`` (a chunk's verified bytes) into ``out`` (1-D uint8 of exactly
    the chunk's raw size), never producing more than that many bytes.

    Raises:
        CheckpointCorruptError: the data is not a valid frame of ``codec``, or decodes to
            more or fewer bytes than ``out`` holds (the caller names the chunk).
    """
    if codec != "zstd":  # pragma: no cover - the manifest decoder refuses others
        raise CheckpointCorruptError(f"codec {codec!r} is not one this statestream decodes")
    zstd = _zstd()
    raw = len(out)
    try:
        declared = zstd.frame_content_size(stored)
    except zstd.ZstdError as exc:
        raise CheckpointCorruptError(f"it is not valid zstd data ({exc})") from None
    if declared > raw:  # refused before anything is decompressed
        raise CheckpointCorruptError(f"its zstd frame declares {declared} bytes, not {raw}")
    window = zstd.get_frame_parameters(stored).window_size
    if window > 1 << max(10, (raw - 1).bit_length()):  # see _decompressor
        raise CheckpointCorruptError(f"its zstd frame needs a {window}-byte window, more than "
                                     f"its {raw} bytes could")
    target = fresh_bytes(raw) if shuffle and itemsize > 1 else out
    view = target.data.cast("B")
    n = 0
    try:
        reader = _decompressor(raw).stream_reader(stored.data.cast("B"),
                                               read_across_frames=True)
        while n < raw:
            got = reader.readinto(view[n:])
            if not got:
                break
            n += got
        more = reader.read(1) if n == raw else b""
    except zstd.ZstdError as exc:
        raise CheckpointCorruptError(f"it is not valid zstd data ({exc})") from None
    if n != raw or more:
        raise CheckpointCorruptError(f"it decodes to {'more' if more else n} bytes, not {raw}")
    if target is not out:  # byte column by byte column: 4x faster than one strided copy
        cols, planes = out.reshape(-1, itemsize), target.reshape(itemsize, -1)
        for j in range(itemsize):
            cols[:, j] = planes[j]


def _is_float(dtype: str) -> bool:
    return dtype.startswith(("float", "bfloat", "complex"))


def _codec_value(v: Any, where: str) -> Compression | None:
    if v is None or isinstance(v, Compression):
        return v
    if isinstance(v, str):
        return Compression(v)
    raise InvalidOptionTypeError(
        f"{where} must be a codec name (\"zstd\"), an ss.Compression or None, not {v!r:.80}")


class CompressionPolicy:
    """Which codec each array of a save gets (``save(..., compression=...)``).

    A name or :class:`Compression` applies to every array; a mapping's keys
    are key-path patterns (:func:`~statestream.tree.match_keypath`: ``*``
    within a key, ``**`` across keys, each covering its subtree) and the last
    pattern that matches an array's key path decides (``None``: raw).
    """

    __slots__ = ("_any", "rules")

    def __init__(self, option: CompressionOption) -> None:
        self.rules: list[tuple[str, Compression | None]] = []
        self._any = False
        if option is None:
            return
        if isinstance(option, (str, Compression)):
            self.rules.append(("**", _codec_value(option, "compression")))
        elif isinstance(option, Mapping):
            for pattern, v in option.items():
                if not isinstance(pattern, str):
                    raise InvalidOptionTypeError(
                        f"compression patterns must be key paths (str), not {pattern!r:.80}")
                if not pattern:
                    raise InvalidOptionError("a compression pattern is empty (use \"**\")")
                self.rules.append((pattern, _codec_value(v, f"compression[{pattern!r}]")))
        else:
            raise InvalidOptionTypeError(
                "compression takes a codec name (\"zstd\"), an ss.Compression, or a dict of "
                f"key-path patterns to those (or None), not {option!r:.80}")
        self._any = any(c is not None for _, c in self.rules)

    def __bool__(self) -> bool:  # asked once per array: computed once
        return self._any

    def for_array(self, path: KeyPath, dtype: str, itemsize: int) -> Compression | None:
        """The codec of the array at ``path`` (shuffle decided for its dtype), or None."""
        chosen: Compression | None = None
        for pattern, comp in self.rules:
            if match_keypath(pattern, path):
                chosen = comp
        if chosen is None:
            return None
        shuffle = _is_float(dtype) if chosen.shuffle is None else chosen.shuffle
        return dataclasses.replace(chosen, shuffle=shuffle and itemsize > 1)
