"""Tests for statestream.format._checksum (CRC-32C)."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from statestream.format import CHECKSUM_ALGORITHM, checksum


def test_algorithm_name() -> None:
    assert CHECKSUM_ALGORITHM == "crc32c"


def test_known_vector() -> None:
    # The CRC-32C check value (RFC 3720 / iSCSI).
    assert checksum(b"123456789") == 0xE3069283


def test_more_known_vectors() -> None:
    assert checksum(b"") == 0
    assert checksum(bytes(32)) == 0x8A9136AA  # RFC 3720 B.4: 32 bytes of zeros
    assert checksum(b"\xff" * 32) == 0x62A8AB43  # RFC 3720 B.4: 32 bytes of 0xff


def test_accepts_any_contiguous_buffer() -> None:
    data = b"statestream checksum"
    want = checksum(data)
    assert checksum(bytearray(data)) == want
    assert checksum(memoryview(data)) == want
    assert checksum(np.frombuffer(data, dtype=np.uint8)) == want
    arr = np.arange(10, dtype=np.float32)
    assert checksum(arr) == checksum(arr.tobytes())


def test_returns_plain_int_in_range() -> None:
    v = checksum(b"x")
    assert type(v) is int and 0 <= v <= 0xFFFFFFFF


@given(st.binary(max_size=300), st.integers(min_value=0, max_value=300))
def test_incremental_equals_one_shot(data: bytes, cut: int) -> None:
    cut = min(cut, len(data))
    assert checksum(data[cut:], checksum(data[:cut])) == checksum(data)


def test_incremental_over_many_pieces() -> None:
    data = bytes(range(256)) * 17
    v = 0
    for i in range(0, len(data), 13):
        v = checksum(data[i : i + 13], v)
    assert v == checksum(data)
