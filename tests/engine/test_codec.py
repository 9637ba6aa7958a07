"""The chunk codec (engine/_codec.py): byte planes as zstd frames, bounded decoding,
and the key-path policy."""

from __future__ import annotations

import numpy as np
import pytest
import zstandard

from statestream.engine._codec import CompressionPolicy, decode_chunk, encode_chunk
from statestream.errors import CheckpointCorruptError
from statestream.format import Compression


def _frames(stored: bytes) -> list[int]:
    """Decoded size of each concatenated zstd frame in ``stored``."""
    sizes, pos = [], 0
    while pos < len(stored):
        n = zstandard.frame_content_size(stored[pos:])
        d = zstandard.ZstdDecompressor().decompressobj()
        out = d.decompress(stored[pos:])
        sizes.append(len(out) if n == -1 else n)
        pos = len(stored) - len(d.unused_data)
    return sizes


def _roundtrip(a: np.ndarray, comp: Compression) -> bytes | None:
    stored = encode_chunk(a, a.itemsize, comp)
    if stored is not None:
        out = np.empty(a.nbytes, np.uint8)
        decode_chunk(np.frombuffer(stored, np.uint8), out, a.itemsize, "zstd",
                     bool(comp.shuffle))
        assert out.tobytes() == a.tobytes()
    return stored


def test_shuffled_chunk_is_one_frame_per_byte_plane() -> None:
    rng = np.random.default_rng(0)
    a = (rng.standard_normal(1 << 18).astype(np.float32) * 0.02)  # 1 MiB: probes run
    stored = _roundtrip(a, Compression(shuffle=True))
    assert stored is not None and _frames(stored) == [1 << 18] * 4
    assert len(stored) < 0.9 * a.nbytes
    plain = _roundtrip(np.arange(1 << 16, dtype=np.int64), Compression(shuffle=False))
    assert plain is not None and _frames(plain) == [1 << 19]


def test_noise_is_stored_raw_and_smooth_data_keeps_its_matches() -> None:
    rng = np.random.default_rng(1)
    assert _roundtrip(rng.integers(0, 256, 1 << 20, dtype=np.uint8),
                      Compression(shuffle=False)) is None
    assert _roundtrip(rng.integers(0, 1 << 32, 1 << 18, dtype=np.uint32),
                      Compression(shuffle=True)) is None
    smooth = np.sin(np.arange(1 << 18, dtype=np.float32) / 100)
    stored = _roundtrip(smooth, Compression(shuffle=True))
    level1 = len(zstandard.ZstdCompressor(level=1).compress(
        smooth.view(np.uint8).reshape(-1, 4).T.tobytes()))
    assert stored is not None and len(stored) <= 1.02 * level1  # the sample chose matches


def test_decoding_is_bounded_and_exact() -> None:
    out = np.empty(1000, np.uint8)
    # a window no larger than 1 KiB: decoded (to the chunk's size, not beyond)
    small = zstandard.ZstdCompressionParameters(window_log=10, compression_level=3,
                                                write_content_size=False)
    z = zstandard.ZstdCompressor(compression_params=small).compress(bytes(5000))
    with pytest.raises(CheckpointCorruptError, match="decodes to more bytes"):
        decode_chunk(np.frombuffer(z, np.uint8), out, 1, "zstd", False)
    two = zstandard.ZstdCompressor().compress(bytes(600)) * 2
    with pytest.raises(CheckpointCorruptError, match="declares|more"):
        decode_chunk(np.frombuffer(two, np.uint8), out, 1, "zstd", False)
    ok = zstandard.ZstdCompressor().compress(bytes(500)) * 2  # two frames, 1000 bytes
    decode_chunk(np.frombuffer(ok, np.uint8), out, 1, "zstd", False)
    assert not out.any()


def test_policy_resolves_shuffle_per_dtype() -> None:
    p = CompressionPolicy({"**": "zstd", "ids": Compression(shuffle=True), "raw/**": None})
    assert p.for_array(("w",), "float32", 4) == Compression("zstd", 1, True)
    assert p.for_array(("w",), "bfloat16", 2) == Compression("zstd", 1, True)
    assert p.for_array(("n",), "int64", 8) == Compression("zstd", 1, False)
    assert p.for_array(("b",), "float8_e4m3fn", 1) == Compression("zstd", 1, False)
    assert p.for_array(("ids", 3), "int32", 4) == Compression("zstd", 1, True)
    assert p.for_array(("raw", "x"), "float32", 4) is None
    assert not CompressionPolicy({"a": None}) and not CompressionPolicy(None)
