"""Chunk checksums: CRC-32C (Castagnoli), hardware-accelerated, GIL released."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import crc32c as _crc32c

__all__ = ["CHECKSUM_ALGORITHM", "checksum", "checksum_of_blocks"]

#: Name recorded in every manifest; readers refuse any other.
CHECKSUM_ALGORITHM = "crc32c"


def checksum(data: Any, value: int = 0) -> int:
    """Return the CRC-32C of ``data`` (any contiguous buffer), continuing from ``value``.

    Example:
        >>> checksum(b"123456789")
        3808858755
    """
    try:
        n = data.nbytes
    except AttributeError:
        n = len(data)
    # Small buffers keep the GIL: hashing 32 KiB takes ~4 us, while taking the GIL
    # back after releasing it can wait a whole switch interval (5 ms) behind a
    # thread running Python (the walk of a 20,000-tensor save); large ones let
    # other threads run.
    return int(_crc32c.crc32c(data, value, 0 if n < _RELEASE_GIL_BYTES else 1))


#: buffers at least this large are hashed with the GIL released
_RELEASE_GIL_BYTES = 1 << 20


def checksum_of_blocks(blocks: Sequence[int]) -> int:
    """The CRC-32C of a chunk's block checksums as little-endian uint32s: what
    statestream records as the checksum of a chunk with block checksums, so that its
    bytes are hashed once (docs/format.md; other writers may record the CRC-32C of its
    bytes there instead, which a reader then checks when it reads the whole chunk).

    Example:
        >>> checksum_of_blocks([1, 2]) == checksum(bytes([1, 0, 0, 0, 2, 0, 0, 0]))
        True
    """
    return checksum(struct.pack(f"<{len(blocks)}I", *blocks))
