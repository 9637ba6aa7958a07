"""Chunk checksums: CRC-32C (Castagnoli), hardware-accelerated, GIL released."""

from __future__ import annotations

from typing import Any

import crc32c as _crc32c

__all__ = ["CHECKSUM_ALGORITHM", "checksum"]

#: Name recorded in every manifest; readers refuse any other.
CHECKSUM_ALGORITHM = "crc32c"


def checksum(data: Any, value: int = 0) -> int:
    """Return the CRC-32C of ``data`` (any contiguous buffer), continuing from ``value``.

    Example:
        >>> checksum(b"123456789")
        3808858755
    """
    return int(_crc32c.crc32c(data, value))

