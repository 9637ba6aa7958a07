"""Compression (format v2): ``save(..., compression=...)`` round trips, what is stored
raw, damage caught before decompression, bounded decoding, codec selection by key
path, partial loads, metadata and inspect, save_async and the manager."""

from __future__ import annotations

import json
import math
import pathlib
import shutil
import subprocess
import sys
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import zstandard

import statestream as ss
import statestream.engine._read as read_mod
from statestream.api._open import open_checkpoint
from statestream.engine import ByteBudget, IOOptions, read_requests
from statestream.format import checksum, encode_commit
from statestream.plan import Wanted, plan_load
from statestream.testing import assert_tree_equal

GOLDEN = pathlib.Path(__file__).resolve().parents[1] / "golden" / "v2"

_DTYPES = [np.dtype(n) for n in (
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "complex64", "complex128")] + [
    np.dtype(getattr(ml_dtypes, n)) for n in (
        "bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
        "float8_e4m3b11fnuz", "float8_e3m4", "float8_e4m3", "float8_e8m0fnu", "float6_e2m3fn",
        "float6_e3m2fn", "float4_e2m1fn", "int2", "int4", "uint2", "uint4")
    if hasattr(ml_dtypes, n)]


def _compressible(dtype: np.dtype, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Values with structure (few distinct ones, repeated), so every chunk shrinks."""
    n = math.prod(shape)
    rng = np.random.default_rng(seed)
    if dtype == np.bool_:
        return (np.arange(n) % 3 == 0).reshape(shape)
    small = rng.integers(0, 4, n)
    if dtype.kind == "c":
        return (small + 1j * small[::-1]).astype(dtype).reshape(shape)
    return small.astype(np.float32).astype(dtype).reshape(shape)


def _doc(c: pathlib.Path) -> dict[str, Any]:
    return json.loads((c / "manifest.json").read_bytes())  # type: ignore[no-any-return]


def _write_doc(c: pathlib.Path, doc: dict[str, Any]) -> None:
    data = json.dumps(doc, separators=(",", ":")).encode()
    (c / "manifest.json").write_bytes(data)
    (c / "COMMITTED").write_bytes(encode_commit(data))


def _chunks_of(doc: dict[str, Any], key: str) -> list[Any]:
    node = doc["tree"]
    for k in key.split("/"):
        node = node["c"][node["k"].index(k) if "k" in node else int(k)]
    return doc["arrays"][node["a"]]["chunks"]  # type: ignore[no-any-return]


def _data_bytes(c: pathlib.Path) -> int:
    return sum(f.stat().st_size for f in (c / "data").iterdir())


# ----------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("shuffle", [None, True, False])
@pytest.mark.parametrize("dtype", _DTYPES, ids=str)
def test_every_dtype_round_trips_compressed(tmp_path: pathlib.Path, dtype: np.dtype,
                                            shuffle: bool | None) -> None:
    a = _compressible(dtype, (300, 70))  # 3 chunks of 8 KiB with max_chunk_bytes
    p = tmp_path / "c"
    ss.save(p, {"x": a, "zero_d": a[0, 0].copy()}, io=IOOptions(max_chunk_bytes=8 << 10),
            compression=ss.Compression("zstd", level=3, shuffle=shuffle))
    out = ss.load(p)
    assert out["x"].dtype == dtype and out["x"].tobytes() == a.tobytes()
    assert out["zero_d"].tobytes() == a[0, 0].tobytes()
    chunks = _chunks_of(_doc(p), "x")
    assert len(chunks) > 1 and all(c[7]["codec"] == "zstd" for c in chunks)
    expect_shuffle = dtype.itemsize > 1 and (
        shuffle or (shuffle is None and dtype.kind in "fcV" and dtype.name != "bool"))
    assert all(c[7].get("shuffle", False) == expect_shuffle for c in chunks), chunks[0]
    assert ss.verify(p).ok


def test_compressed_state_round_trips_with_every_kind_of_leaf(tmp_path: pathlib.Path) -> None:
    state = {
        "params": {"w": _compressible(np.dtype("float32"), (512, 256)),
                   "b": np.zeros(256, np.float32)},
        "opt": {"m": np.zeros((512, 256), np.float32), "step": np.array(7)},
        "blob": b"\x00" * 10000, "empty": np.zeros((0, 4), np.float32), "n": 3, "s": "x",
    }
    p = tmp_path / "c"
    ss.save(p, state, compression="zstd")
    assert_tree_equal(ss.load(p), state)
    assert _data_bytes(p) < 0.2 * (512 * 256 * 8)
    assert _doc(p)["version"] == 2 and json.loads((p / "COMMITTED").read_bytes())["version"] == 2


def test_without_compression_the_checkpoint_stays_v1(tmp_path: pathlib.Path) -> None:
    state = {"w": np.zeros(1000, np.float32), "i": np.arange(10)}
    ss.save(tmp_path / "none", state)
    ss.save(tmp_path / "nomatch", state, compression={"opt/**": "zstd"})
    ss.save(tmp_path / "off", state, compression={"**": None})
    raw = [(tmp_path / n / "manifest.json").read_bytes() for n in ("none", "nomatch", "off")]
    docs = [json.loads(r) for r in raw]
    assert all(d["version"] == 1 for d in docs)
    assert docs[0]["arrays"] == docs[1]["arrays"] == docs[2]["arrays"]
    for n in ("nomatch", "off"):
        assert (tmp_path / n / "data" / "r0-0.bin").read_bytes() == (
            tmp_path / "none" / "data" / "r0-0.bin").read_bytes()


def test_incompressible_data_is_stored_raw_and_grows_at_most_2_percent(
        tmp_path: pathlib.Path) -> None:
    rng = np.random.default_rng(1)
    state = {"u8": rng.integers(0, 256, 3 << 20, dtype=np.uint8),
             "f32": rng.standard_normal(1 << 20).astype(np.float32).view(np.uint32)
             ^ rng.integers(0, 1 << 23, 1 << 20, dtype=np.uint32),
             "tiny": rng.integers(0, 256, 17, dtype=np.uint8)}
    state["f32"] = state["f32"].view(np.float32)
    ss.save(tmp_path / "raw", state)
    ss.save(tmp_path / "z", state, compression=ss.Compression(level=19, shuffle=True))
    raw, z = _data_bytes(tmp_path / "raw"), _data_bytes(tmp_path / "z")
    total = sum(a.nbytes for a in state.values())
    assert z <= 1.02 * total and z <= 1.02 * raw
    doc = _doc(tmp_path / "z")
    for key in ("u8", "tiny"):
        assert all(len(c) == 6 for c in _chunks_of(doc, key)), key  # raw, v1 form
    assert_tree_equal(ss.load(tmp_path / "z"), state)
    md = ss.metadata(tmp_path / "z")
    assert md.tree["u8"].codec is None and md.tree["u8"].stored_bytes == 3 << 20


# ----------------------------------------------------------------------------- selection


def test_codec_by_key_path_pattern_last_match_wins(tmp_path: pathlib.Path) -> None:
    def z() -> np.ndarray:  # a new array per key (one array under two keys is stored once)
        return np.zeros((64, 64), np.float32)

    state = {"params": {"embed": z(), "layers": [{"w": z(), "bias": z()},
                                                 {"w": z(), "bias": z()}]},
             "opt": {"m": z(), "v": z().astype(np.int32)}}
    p = tmp_path / "c"
    ss.save(p, state, compression={
        "**": "zstd", "params/**": None, "**/bias": ss.Compression(level=5, shuffle=False),
        "opt/v": ss.Compression(shuffle=True)})
    md = ss.metadata(p)
    got = {k: (leaf.codec, leaf.stored_bytes < leaf.nbytes) for k, leaf in md.leaves()}
    assert got == {"params/embed": (None, False), "params/layers/0/w": (None, False),
                   "params/layers/1/w": (None, False), "params/layers/0/bias": ("zstd", True),
                   "params/layers/1/bias": ("zstd", True), "opt/m": ("zstd", True),
                   "opt/v": ("zstd", True)}
    doc = _doc(p)
    assert _chunks_of(doc, "opt/m")[0][7] == {"codec": "zstd", "shuffle": True}  # float: auto
    assert _chunks_of(doc, "opt/v")[0][7] == {"codec": "zstd", "shuffle": True}  # asked for
    assert _chunks_of(doc, "params/layers/0/bias")[0][7] == {"codec": "zstd"}
    assert_tree_equal(ss.load(p), state)


@pytest.mark.parametrize(("option", "exc", "match"), [
    ("lz4", ss.InvalidOptionError, "unknown codec 'lz4'"),
    (3, ss.InvalidOptionTypeError, "compression takes a codec name"),
    ({"a": 3}, ss.InvalidOptionTypeError, r"compression\['a'\] must be"),
    ({1: "zstd"}, ss.InvalidOptionTypeError, "patterns must be key paths"),
    ({"": "zstd"}, ss.InvalidOptionError, "pattern is empty"),
])
def test_bad_compression_options_fail_before_anything_is_written(
        tmp_path: pathlib.Path, option: Any, exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=match):
        ss.save(tmp_path / "c", {"w": np.zeros(3)}, compression=option)
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize(("kw", "exc"), [
    ({"codec": "gzip"}, ss.InvalidOptionError), ({"level": 99}, ss.InvalidOptionError),
    ({"level": 1.5}, ss.InvalidOptionTypeError), ({"shuffle": "yes"}, ss.InvalidOptionTypeError),
])
def test_compression_record_is_validated(kw: dict[str, Any], exc: type[Exception]) -> None:
    with pytest.raises(exc):
        ss.Compression(**kw)


# ----------------------------------------------------------------------------- damage


@pytest.fixture
def zckpt(tmp_path: pathlib.Path) -> pathlib.Path:
    p = tmp_path / "z"
    ss.save(p, {"w": _compressible(np.dtype("float32"), (256, 64)), "ok": np.arange(100)},
            compression="zstd")
    return p


def test_a_damaged_compressed_chunk_is_caught_before_decompression(
        zckpt: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f, off, nb = _chunks_of(_doc(zckpt), "w")[0][:3]
    path = zckpt / "data" / _doc(zckpt)["files"][f][0].split("/")[1]
    data = bytearray(path.read_bytes())
    data[off + nb // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    damaged = bytes(data[off:off + nb])
    real = read_mod.decode_chunk

    def decode(stored: np.ndarray, *a: Any, **k: Any) -> None:
        assert stored.tobytes() != damaged, "decoded a chunk whose checksum did not match"
        real(stored, *a, **k)

    monkeypatch.setattr(read_mod, "decode_chunk", decode)
    with pytest.raises(ss.ChecksumMismatchError, match="key path 'w'"):
        ss.load(zckpt)
    rep = ss.verify(zckpt)
    assert not rep.ok and len(rep.problems) == 1 and "key path 'w'" in rep.problems[0]


def _replace_chunk(c: pathlib.Path, key: str, stored: bytes, **chunk_kw: Any) -> None:
    """Put ``stored`` as the (only) chunk of ``key`` at the end of its file."""
    doc = _doc(c)
    ch = _chunks_of(doc, key)[0]
    fname = doc["files"][ch[0]][0]
    path = c / fname
    off = path.stat().st_size
    with path.open("ab") as fh:
        fh.write(stored)
    doc["files"][ch[0]][1] = off + len(stored)
    ch[1], ch[2], ch[3] = off, len(stored), checksum(stored)
    for k, v in chunk_kw.items():
        ch[7][k] = v
    _write_doc(c, doc)


@pytest.mark.parametrize("content_size", [True, False])
def test_a_chunk_that_decodes_to_more_bytes_is_refused_bounded(
        tmp_path: pathlib.Path, content_size: bool) -> None:
    p = tmp_path / "z"
    ss.save(p, {"w": np.zeros(4096, np.float32)}, compression="zstd")  # 16 KiB raw
    # a "zip bomb": 64 MiB of zeros in a few KiB (within the format's ratio limit of 16 KiB)
    bomb = zstandard.ZstdCompressor(write_content_size=content_size).compress(bytes(64 << 20))
    assert len(bomb) < 16 << 10
    _replace_chunk(p, "w", bomb)
    with pytest.raises(ss.CheckpointCorruptError, match=(
            "declares 67108864 bytes, not 16384" if content_size
            else r"needs a \d+-byte window, more than its 16384 bytes could")):
        ss.load(p)
    rep = ss.verify(p)
    assert not rep.ok and "does not decode to its 16384 bytes" in rep.problems[0]
    # the same bomb in frames of a small window: decoded to the chunk's size, no further
    small = zstandard.ZstdCompressionParameters(window_log=10, compression_level=3,
                                                write_content_size=False)
    bomb = zstandard.ZstdCompressor(compression_params=small).compress(bytes(1 << 20))
    assert len(bomb) < 16 << 10  # within the format's ratio limit
    _replace_chunk(p, "w", bomb)
    with pytest.raises(ss.CheckpointCorruptError, match="decodes to more bytes"):
        ss.load(p)


def test_a_tiny_frame_with_a_huge_window_reserves_nothing(tmp_path: pathlib.Path) -> None:
    # 10 bytes declaring zstd's largest default window (128 MiB), no content size: the
    # decoder reserved the window for the life of the thread (per reader thread)
    p = tmp_path / "z"
    ss.save(p, {"blob": np.full(500, 7, np.uint8)}, compression="zstd")
    frame = (b"\x28\xb5\x2f\xfd" + bytes([0x00, 17 << 3])
             + ((500 << 3) | 2 | 1).to_bytes(3, "little") + b"\x07")
    _replace_chunk(p, "blob", frame)
    with pytest.raises(ss.CheckpointCorruptError,
                       match="needs a 134217728-byte window, more than its 500 bytes"):
        ss.load(p)


def test_a_chunk_that_decodes_to_fewer_bytes_or_garbage_is_refused(tmp_path: pathlib.Path) -> None:
    p = tmp_path / "z"
    ss.save(p, {"w": np.zeros(4096, np.float32), "v": np.zeros(4096, np.float32)},
            compression="zstd")
    short = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(1000))
    _replace_chunk(p, "w", short)
    with pytest.raises(ss.CheckpointCorruptError, match="decodes to 1000 bytes, not 16384"):
        ss.load(p, items=["w"])
    _replace_chunk(p, "v", b"not a zstd frame at all" * 8)
    with pytest.raises(ss.CheckpointCorruptError, match="not valid zstd data"):
        ss.load(p, items=["v"])
    assert len(ss.verify(p).problems) == 2


def test_unknown_codec_is_a_format_version_error(zckpt: pathlib.Path) -> None:
    doc = _doc(zckpt)
    _chunks_of(doc, "w")[0][7]["codec"] = "zfuture"
    _write_doc(zckpt, doc)
    # verify too: a codec this statestream does not know is not damage (upgrade it)
    for fn in (ss.load, ss.metadata, ss.verify):
        with pytest.raises(ss.FormatVersionError, match="codec 'zfuture'.*upgrade"):
            fn(zckpt)


@pytest.mark.parametrize("codec", [5, None, ["zstd"]])
def test_a_codec_that_is_not_a_name_is_malformed(zckpt: pathlib.Path, codec: object) -> None:
    # it was a FormatVersionError saying to upgrade statestream
    doc = _doc(zckpt)
    _chunks_of(doc, "w")[0][7]["codec"] = codec
    _write_doc(zckpt, doc)
    with pytest.raises(ss.CheckpointCorruptError, match="its codec .* is not a name"):
        ss.load(zckpt)


# ----------------------------------------------------------------------------- partial


def test_partial_and_box_loads_read_only_the_chunks_they_need(tmp_path: pathlib.Path) -> None:
    a = _compressible(np.dtype("float32"), (1000, 64), seed=3)
    p = tmp_path / "z"
    ss.save(p, {"w": a, "other": np.zeros((500, 64), np.float32)},
            io=IOOptions(max_chunk_bytes=64 << 10), compression="zstd")  # 250 rows a chunk
    assert ss.load(p, items=["other"]) == {"other": pytest.approx(np.zeros((500, 64)))}
    reader, m = open_checkpoint(p)
    try:
        wi = m.tree.keys.index("w")  # type: ignore[union-attr]
        ai = m.tree.children[wi].array  # type: ignore[index]
        assert ai is not None and len(m.arrays[ai].chunks) == 4
        dest = np.zeros((100, 32), np.float32)
        reqs = plan_load(m.arrays, [Wanted(ai, (480, 16), dest)])
        assert sorted(pc.chunk for r in reqs for pc in r.pieces) == [1, 2]  # rows 250..749
        assert sum(r.nbytes for r in reqs) < 0.6 * a.nbytes / 2
        read_requests(reader, [f.name for f in m.files], reqs, options=IOOptions(),
                      budget=ByteBudget(1 << 30), describe=lambda pc: "w")
    finally:
        reader.close()
    np.testing.assert_array_equal(dest, a[480:580, 16:48])


# ----------------------------------------------------------------------------- surfaces


def test_metadata_and_inspect_show_codec_and_sizes(zckpt: pathlib.Path) -> None:
    w = ss.metadata(zckpt).tree["w"]
    assert w.codec == "zstd" and 0 < w.stored_bytes < w.nbytes == 256 * 64 * 4
    out = subprocess.run([sys.executable, "-m", "statestream", "inspect", str(zckpt)],
                         capture_output=True, text=True, check=True).stdout
    assert "stored" in out and "codec" in out and "statestream v2" in out
    row = next(line for line in out.splitlines() if line.startswith("w "))
    assert "zstd" in row
    js = subprocess.run([sys.executable, "-m", "statestream", "inspect", "--json", str(zckpt)],
                        capture_output=True, text=True, check=True).stdout
    leaves = {leaf["key"]: leaf for leaf in json.loads(js)["leaves"]}
    assert leaves["w"]["codec"] == "zstd" and leaves["w"]["stored_bytes"] == w.stored_bytes
    assert leaves["ok"]["codec"] is None or leaves["ok"]["stored_bytes"] < 800


def test_save_async_and_manager_compress(tmp_path: pathlib.Path) -> None:
    state = {"w": _compressible(np.dtype("float32"), (512, 128))}
    h = ss.save_async(tmp_path / "a", state, compression="zstd")
    h.result()
    h = ss.save_async(tmp_path / "lazy", state, lazy=True, compression="zstd",
                      memory=ss.MemoryOptions(memory_budget_bytes=64 << 10))
    h.result()
    tiny = ss.MemoryOptions(memory_budget_bytes=64 << 10)  # smaller than one chunk
    ss.save(tmp_path / "tiny", state, compression="zstd", memory=tiny,
            io=IOOptions(max_chunk_bytes=128 << 10))
    assert_tree_equal(ss.load(tmp_path / "tiny", memory=tiny), state)
    for n in ("a", "lazy", "tiny"):
        assert ss.metadata(tmp_path / n).tree["w"].codec == "zstd"
        assert_tree_equal(ss.load(tmp_path / n), state)
    with ss.CheckpointManager(tmp_path / "m", compression={"w": "zstd"}) as mgr:
        mgr.save(1, state)
        mgr.wait()
        assert ss.metadata(mgr.step_path(1)).tree["w"].codec == "zstd"
        assert_tree_equal(mgr.load(), state)
    with pytest.raises(ss.InvalidOptionError):
        ss.CheckpointManager(tmp_path / "m2", compression="nope")


def test_golden_v2_compressed_loads_and_verifies(tmp_path: pathlib.Path) -> None:
    dst = tmp_path / "compressed"
    shutil.copytree(GOLDEN / "compressed", dst)
    out = ss.load(dst)
    x = np.arange(2048, dtype=np.float32)
    expected = {
        "w": (np.round(x / 64.0) * 0.125).reshape(64, 32).astype(np.float32),
        "i": np.arange(1000, dtype=np.int64) * 3 - 7,
        "bf": (np.arange(256) % 17 - 8).astype(ml_dtypes.bfloat16),
        "noise": np.random.default_rng(2026).integers(0, 256, 300, dtype=np.uint8),
        "rows": np.arange(32, dtype=np.float32).reshape(8, 4) / 4,
        "zero_d": np.array(2.5, dtype=np.float64),
        "empty": np.zeros((0, 3), dtype=np.float32),
        "plain": {"s": "v2", "n": 3},
    }
    assert_tree_equal(out, expected)
    rep = ss.verify(dst)
    assert rep.ok and rep.checked_chunks == 6
    md = ss.metadata(dst)
    assert md.format_version == 2 and md.tree["w"].codec == "zstd"
    assert md.tree["rows"].codec is None and md.tree["w"].stored_bytes == 115


def test_all_zero_chunks_stay_within_the_format_ratio_limit(tmp_path: pathlib.Path) -> None:
    # zstd's best case (a 4 MiB chunk of zeros: ~28000x) is still under the decoder's
    # 32768x limit; a whole 16 MiB zero array round trips
    state = {"u8": np.zeros(16 << 20, np.uint8), "f32": np.zeros(4 << 20, np.float32)}
    p = tmp_path / "z"
    ss.save(p, state, compression="zstd", io=IOOptions(max_chunk_bytes=1 << 30))
    doc = _doc(p)
    for key in ("u8", "f32"):
        chunks = _chunks_of(doc, key)
        assert len(chunks) == 4 and all(c[7]["codec"] == "zstd" for c in chunks)
        assert all(c[2] * 10000 < 4 << 20 for c in chunks), [c[2] for c in chunks]
    assert _data_bytes(p) < 64 << 10
    assert_tree_equal(ss.load(p), state)
