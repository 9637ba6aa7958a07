"""Format v2: chunk extensions (codec, shuffle, hash, ref), manifest-level bases, the
version a writer picks, and every check a reader makes of them (docs/format.md)."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import xxhash
import zstandard

import statestream.format._decode as decode_mod
from statestream.errors import CheckpointCorruptError, FormatVersionError, UnsafeCheckpointError
from statestream.format import (
    ArrayEntry,
    ChunkEntry,
    ChunkRef,
    FileEntry,
    Manifest,
    checksum,
    decode_commit,
    decode_manifest,
    encode_commit,
    encode_manifest,
    manifest_version,
    validate_base_name,
)
from statestream.tree import Node

WHERE = "/ckpt/manifest.json"
GOLDEN = pathlib.Path(__file__).resolve().parents[1] / "golden" / "v2"
H1, H2 = "00112233445566778899aabbccddeeff", "ffeeddccbbaa99887766554433221100"


def v2_manifest() -> Manifest:
    """Five arrays: compressed (shuffled and not), hashed, referenced, and one with enough
    chunks (6) for the vectorised checks."""
    d = bytes.fromhex(H1)
    many = tuple(ChunkEntry(1, 64 * k, 5, k, (2 * k,), (2,), codec="zstd") for k in range(6))
    arrays = [
        ArrayEntry("float32", (4, 4), (ChunkEntry(0, 0, 20, 1, (0, 0), (4, 4), codec="zstd",
                                                  shuffle=True, digest=d),)),
        ArrayEntry("int64", (3,), (ChunkEntry(0, 64, 24, 2, (0,), (3,), digest=d),)),
        ArrayEntry("float32", (8,), (ChunkEntry(3, 128, 32, 3, (0,), (8,), 2, (5, 6, 7, 8),
                                                digest=d, ref=ChunkRef("step-1", 3)),)),
        ArrayEntry("float32", (12,), many),
        ArrayEntry("uint8", (4,), (ChunkEntry(0, 128, 4, 4, (0,), (4,)),)),
    ]
    tree = Node("dict", keys=list("abcde"), children=[Node("array", array=i) for i in range(5)])
    return Manifest(tree=tree, arrays=arrays,
                    files=[FileEntry("data/r0-0.bin", 132), FileEntry("data/r0-1.bin", 330)])


def v2_doc() -> dict[str, Any]:
    return json.loads(encode_manifest(v2_manifest()))


@pytest.fixture(params=["small", "streamed"])
def parse_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run each check both through the C parser (small manifests) and the streaming one."""
    if request.param == "streamed":
        monkeypatch.setattr(decode_mod, "_SMALL_MANIFEST_BYTES", 0)
    return str(request.param)


def decode_doc(doc: Any) -> Manifest:
    return decode_manifest(json.dumps(doc, separators=(",", ":")).encode(), WHERE)


def refused(mutate: Callable[[dict[str, Any]], Any], match: str,
            exc: type[Exception] = CheckpointCorruptError) -> None:
    doc = v2_doc()
    mutate(doc)
    with pytest.raises(exc, match=match) as ei:
        decode_doc(doc)
    assert WHERE in str(ei.value) or exc is UnsafeCheckpointError


def chunk(doc: dict[str, Any], a: int, j: int = 0) -> list[Any]:
    return doc["arrays"][a]["chunks"][j]  # type: ignore[no-any-return]


# ----------------------------------------------------------------------------- writing


def test_v2_round_trips_exactly(parse_path: str) -> None:
    m = v2_manifest()
    data = encode_manifest(m)
    back = decode_manifest(data, WHERE)
    assert back.version == 2 and back.bases == ["step-1"]
    for a, b in zip(m.arrays, back.arrays):
        assert list(a.chunks) == list(b.chunks)
    assert encode_manifest(back) == data
    c = back.arrays[2].chunks[0]
    assert c.ref == ChunkRef("step-1", 3) and c.digest == bytes.fromhex(H1)
    assert (c.block_rows, c.block_checksums) == (2, (5, 6, 7, 8))


def test_chunk_json_forms() -> None:
    doc = v2_doc()
    assert list(doc) == ["format", "version", "checksum", "meta", "files", "bases", "arrays",
                         "tree"]
    assert chunk(doc, 0)[6:] == [None, {"codec": "zstd", "shuffle": True, "hash": H1}]
    assert chunk(doc, 1)[6:] == [None, {"hash": H1}]
    assert chunk(doc, 2)[6:] == [[2, [5, 6, 7, 8]], {"hash": H1, "ref": 0}]
    assert chunk(doc, 3, 1)[6:] == [None, {"codec": "zstd"}]
    assert len(chunk(doc, 4)) == 6  # a chunk without v2 fields keeps the v1 form


def test_a_writer_emits_v2_only_for_v2_features() -> None:
    m = v2_manifest()
    assert manifest_version(m) == 2
    plain = Manifest(tree=Node("array", array=0), files=[FileEntry("data/r0-0.bin", 4)],
                     arrays=[ArrayEntry("uint8", (4,), (ChunkEntry(0, 0, 4, 9, (0,), (4,)),))])
    assert manifest_version(plain) == 1
    data = encode_manifest(plain)
    assert data.startswith(b'{"format":"statestream","version":1,') and b"bases" not in data
    assert json.loads(encode_commit(data))["version"] == 1
    assert json.loads(encode_commit(encode_manifest(m)))["version"] == 2
    assert json.loads(encode_commit(b"{}", version=2))["version"] == 2
    assert decode_commit(encode_commit(encode_manifest(m)), "/c/COMMITTED")[0] > 0


def test_the_encoder_refuses_what_a_reader_would() -> None:
    m = v2_manifest()
    m.arrays[0] = ArrayEntry("float32", (4, 4), (ChunkEntry(0, 0, 20, 1, (0, 0), (4, 4),
                                                            codec="lz4"),))
    with pytest.raises(FormatVersionError, match="lz4"):
        encode_manifest(m)
    m = v2_manifest()
    m.bases = ["step-1", "step-0"]
    with pytest.raises(AssertionError, match="exactly the ones referenced"):
        encode_manifest(m)
    m.bases = ["../x"]
    with pytest.raises(UnsafeCheckpointError):
        encode_manifest(m)


# ----------------------------------------------------------------------------- reading


def test_v1_manifest_with_v2_fields_is_malformed(parse_path: str) -> None:
    def v1(doc: dict[str, Any]) -> None:
        doc["version"] = 1
        del doc["bases"]
        doc["arrays"][2]["chunks"] = [[1, 384, 32, 3, [0], [8]]]
        doc["files"][1][1] = 416
    refused(v1, "format v1 manifest has a format v2 field")

    def v1_bases(doc: dict[str, Any]) -> None:
        v1(doc)
        for a in doc["arrays"]:
            a["chunks"] = [c[:6] if len(c) == 8 and c[6] is None else c[:7] for c in a["chunks"]]
        doc["arrays"][0]["chunks"][0][2] = 64
        doc["arrays"][3]["chunks"] = [c[:2] + [8] + c[3:] for c in doc["arrays"][3]["chunks"]]
        doc["bases"] = []
    refused(v1_bases, r"format v2 field \(bases\)")


def test_unknown_codec_is_a_format_version_error(parse_path: str) -> None:
    refused(lambda d: chunk(d, 0)[7].update(codec="lz4"), "codec 'lz4'.*upgrade statestream",
            FormatVersionError)
    refused(lambda d: chunk(d, 3, 4)[7].update(codec="brotli"), "codec 'brotli'",
            FormatVersionError)
    refused(lambda d: chunk(d, 0)[7].update(codec=3), "its codec 3 is not a name")  # malformed


def test_a_future_version_is_a_format_version_error_even_if_its_chunks_are_new(
        parse_path: str) -> None:
    def v4(doc: dict[str, Any]) -> None:
        doc["version"] = 4
        chunk(doc, 1)[7]["delta"] = 1
        chunk(doc, 1).append("more")
    refused(v4, "format version 4.*upgrade", FormatVersionError)


@pytest.mark.parametrize(("mutate", "match"), [
    (lambda d: chunk(d, 1).__setitem__(7, {}), "malformed extension"),
    (lambda d: chunk(d, 1).__setitem__(7, [1]), "malformed extension"),
    (lambda d: chunk(d, 1)[7].update(delta=True), "unknown field 'delta'"),
    (lambda d: chunk(d, 0)[7].update(shuffle=False), "shuffle must be true"),
    (lambda d: chunk(d, 1)[7].update(shuffle=True), "shuffle must be true, with a codec"),
    (lambda d: chunk(d, 1)[7].update(hash=H1.upper()), "bad hash"),
    (lambda d: chunk(d, 1)[7].update(hash=H1[:30]), "bad hash"),
    (lambda d: chunk(d, 1)[7].update(hash=7), "bad hash"),
    (lambda d: chunk(d, 2)[7].pop("hash"), "refers to a base checkpoint without a hash"),
    (lambda d: chunk(d, 2)[7].update(ref=1), "refers to base 1, not one of the 1"),
    (lambda d: chunk(d, 2)[7].update(ref=-1), "refers to base -1"),
    (lambda d: chunk(d, 2)[7].update(ref="0"), "refers to base '0'"),
    (lambda d: chunk(d, 0).__setitem__(6, [4, [1]]), "compressed and has block checksums"),
    (lambda d: chunk(d, 1).__setitem__(6, [1, [1]]), "malformed block checksum table"),
    (lambda d: chunk(d, 0).__setitem__(2, 64), r"compressed to 64 bytes.*raw size 64"),
    (lambda d: chunk(d, 0).__setitem__(2, 0), "compressed to 0 bytes"),
    (lambda d: chunk(d, 3, 2).__setitem__(2, 8), r"chunk 2 is compressed to 8 bytes"),
    (lambda d: chunk(d, 3, 2).__setitem__(2, 0), r"chunk 2 is compressed to 0 bytes"),
    (lambda d: chunk(d, 1).__setitem__(2, 20), "is 20 bytes but its shape"),
    (lambda d: d["arrays"][0].update(shape=[1 << 16, 4])
     or chunk(d, 0).__setitem__(5, [1 << 16, 4]),
     r"claims 1048576 raw bytes from 20 compressed ones, more than 32768 times"),
    (lambda d: d["arrays"][3].update(shape=[12 + (1 << 18)]) or chunk(d, 3, 5).__setitem__(
        5, [2 + (1 << 18)]), r"chunk 5 claims 1048584 raw bytes from 5 compressed ones"),
    (lambda d: chunk(d, 2).__setitem__(2, 20), "is 20 bytes but its shape"),
    (lambda d: chunk(d, 0).__setitem__(1, 120), "which the manifest says has only 132"),
    (lambda d: chunk(d, 3, 5).__setitem__(1, 330), "which the manifest says has only 330"),
    (lambda d: chunk(d, 3, 5).__setitem__(0, 2), "refers to file 2, not one of 2"),
    (lambda d: chunk(d, 3, 5).__setitem__(1, 64 * 4 + 2), "share bytes of data/r0-1.bin"),
    (lambda d: d["bases"].append("step-2"), "base checkpoint step-2 is listed but no chunk"),
    (lambda d: d["bases"].append("step-1"), "base checkpoint step-1 is listed twice"),
    (lambda d: d.update(bases="step-1"), "bases must be a list"),
    (lambda d: d.pop("bases"), "refers to base 0, not one of the 0"),
    (lambda d: chunk(d, 1).append(None), "must be a list of 6, 7 or 8 fields"),
])
def test_malformed_v2_fields_are_refused(mutate: Any, match: str, parse_path: str) -> None:
    refused(mutate, match)


def test_bases_must_come_before_the_arrays(parse_path: str) -> None:
    doc = v2_doc()
    doc["bases"] = doc.pop("bases")
    with pytest.raises(CheckpointCorruptError, match="refers to base 0, not one of the 0"):
        decode_doc({k: doc[k] for k in ("format", "version", "checksum", "meta", "files",
                                        "arrays", "tree", "bases")})


@pytest.mark.parametrize("name", ["..", "../x", "a/b", ".hidden", "", "a\\b", "x" * 201, 7,
                                  "-step", "st..ep"])
def test_base_names_are_siblings_only(name: Any, parse_path: str) -> None:
    refused(lambda d: d.update(bases=[name]), "not a sibling directory", UnsafeCheckpointError)
    with pytest.raises(UnsafeCheckpointError):
        validate_base_name(name)


def test_references_are_not_checked_against_this_checkpoints_files(parse_path: str) -> None:
    # file 3 and bytes [128, 160) are the base's: this checkpoint has two files and its
    # own chunk of array 4 lies at [128, 132) of file 0; neither is a conflict
    m = decode_doc(v2_doc())
    assert m.arrays[2].chunks[0].file == 3 and len(m.files) == 2
    doc = v2_doc()
    chunk(doc, 2)[0] = 0  # same file index as array 4's chunk, overlapping bytes
    assert decode_doc(doc).arrays[2].chunks[0].ref == ChunkRef("step-1", 0)


# ----------------------------------------------------------------------------- goldens


def _golden_doc(name: str) -> bytes:
    return (GOLDEN / name / "manifest.json").read_bytes()


@pytest.mark.parametrize("name", ["compressed", "base", "incremental"])
def test_golden_v2_decode_and_reencode_byte_for_byte(name: str, parse_path: str) -> None:
    raw = _golden_doc(name)
    m = decode_manifest(raw, name)
    assert m.version == 2
    assert encode_manifest(m) == raw
    assert (GOLDEN / name / "COMMITTED").read_bytes() == encode_commit(raw)
    assert decode_commit((GOLDEN / name / "COMMITTED").read_bytes(), name) == (
        len(raw), checksum(raw))


def _golden_expected() -> dict[str, np.ndarray]:
    x = np.arange(2048, dtype=np.float32)
    return {
        "w": (np.round(x / 64.0) * 0.125).reshape(64, 32).astype(np.float32),
        "i": np.arange(1000, dtype=np.int64) * 3 - 7,
        "bf": (np.arange(256) % 17 - 8).astype(ml_dtypes.bfloat16),
        "noise": np.random.default_rng(2026).integers(0, 256, 300, dtype=np.uint8),
        "rows": np.arange(32, dtype=np.float32).reshape(8, 4) / 4,
        "zero_d": np.array(2.5, dtype=np.float64),
    }


def test_golden_compressed_chunks_hold_the_state() -> None:
    """Decode each golden chunk by hand (zstd, then un-shuffle) and compare with the
    state, rebuilt here independently of make_golden_v2.py."""
    m = decode_manifest(_golden_doc("compressed"), "compressed")
    blob = (GOLDEN / "compressed" / "data" / "r0-0.bin").read_bytes()
    keys = m.tree.keys or []
    expected = _golden_expected()
    codecs = {}
    for key, node in zip(keys, m.tree.children or []):
        if key not in expected:
            continue
        a = m.arrays[node.array or 0]
        (c,) = a.chunks
        stored = blob[c.offset:c.offset + c.nbytes]
        assert checksum(stored) == c.checksum
        raw = stored
        want = expected[str(key)]
        if c.codec == "zstd":
            raw = zstandard.ZstdDecompressor().decompress(stored, max_output_size=want.nbytes)
            if c.shuffle:
                raw = np.frombuffer(raw, np.uint8).reshape(want.itemsize, -1).T.tobytes()
        assert raw == want.tobytes(), key
        if c.digest is not None:
            assert c.digest == xxhash.xxh3_128(raw).digest()
        codecs[key] = (c.codec, c.shuffle, c.digest is not None, c.block_rows)
    assert codecs == {"w": ("zstd", True, False, 0), "i": ("zstd", False, False, 0),
                      "bf": ("zstd", True, False, 0), "noise": (None, False, True, 0),
                      "rows": (None, False, True, 2), "zero_d": (None, False, False, 0)}


def test_golden_incremental_refers_to_base_records() -> None:
    base = decode_manifest(_golden_doc("base"), "base")
    inc = decode_manifest(_golden_doc("incremental"), "incremental")
    assert inc.bases == ["base"] and base.bases == []
    for k in (0, 1):  # a, c: the base's own records, flattened
        r, b = inc.arrays[k].chunks[0], base.arrays[k].chunks[0]
        assert r.ref == ChunkRef("base", b.file)
        assert (r.file, r.offset, r.nbytes, r.checksum, r.codec, r.shuffle, r.digest) == (
            b.file, b.offset, b.nbytes, b.checksum, b.codec, b.shuffle, b.digest)
    own = inc.arrays[2].chunks[0]
    assert own.ref is None
    raw = (GOLDEN / "incremental" / "data" / "r0-0.bin").read_bytes()[own.offset:][:own.nbytes]
    assert raw == (np.arange(8, dtype=np.int32) * -2).tobytes()
    assert own.digest == xxhash.xxh3_128(raw).digest()
