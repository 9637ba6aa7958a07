"""Format v3: the array table and compact array leaves (docs/format.md, "Format v3").

A manifest of at least ``ARRAY_TABLE_MIN`` arrays writes them as one object of integer
columns, and its tree's containers may hold array leaves as bare indexes (``ak``). These
tests encode the same manifests both ways (table and list) and compare what decodes,
check that every refusal the list form makes is made of the table too (same messages),
that nothing but statestream's own errors escapes a hostile table, and that the public
API writes and reads version 3 end to end.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import pathlib
import re
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_format_v2 import v2_manifest  # (pytest puts this directory on sys.path)

import statestream as ss
import statestream.format as format_pkg
import statestream.format._decode as decode_mod
import statestream.format._manifest as manifest_mod
import statestream.format._table as table_mod
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
    encode_tree,
    manifest_version,
)
from statestream.format._dtypes import itemsize_of
from statestream.tree import Node

WHERE = "/ckpt/v3/manifest.json"
H1, H2 = "00112233445566778899aabbccddeeff", "ffeeddccbbaa99887766554433221100"
D1, D2 = bytes.fromhex(H1), bytes.fromhex(H2)
ERRORS = (CheckpointCorruptError, FormatVersionError, UnsafeCheckpointError)
Box = tuple[tuple[int, ...], tuple[int, ...]]
Doc = dict[str, Any]


# ----------------------------------------------------------------------------- helpers


def encode_with_min(m: Manifest, table_min: int) -> bytes:
    """``encode_manifest`` with ``ARRAY_TABLE_MIN`` set to ``table_min`` meanwhile."""
    old = manifest_mod.ARRAY_TABLE_MIN
    manifest_mod.ARRAY_TABLE_MIN = table_min
    try:
        return encode_manifest(m)
    finally:
        manifest_mod.ARRAY_TABLE_MIN = old


def encode_v3(m: Manifest) -> bytes:
    return encode_with_min(m, 0)


def encode_list(m: Manifest) -> bytes:
    return encode_with_min(m, 1 << 62)


def dumps(doc: Any) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode()


def decode_doc(doc: Any) -> Manifest:
    return decode_manifest(dumps(doc), WHERE)


def leaf(i: int, kind: str = "numpy", **extra: Any) -> Node:
    return Node("array", array=i, attrs={"kind": kind, **extra})


def tiles(shape: tuple[int, ...], tile: tuple[int, ...]) -> list[Box]:
    """The boxes of a regular grid of ``tile``-sized chunks (smaller at the far edges)."""
    starts = itertools.product(*(range(0, n, t) for n, t in zip(shape, tile)))
    return [(s, tuple(min(t, n - x) for x, t, n in zip(s, tile, shape))) for s in starts]


class Layout:
    """Arrays and the data files that hold their chunks, laid out back to back."""

    def __init__(self, nfiles: int) -> None:
        self.sizes = [0] * nfiles
        self.arrays: list[ArrayEntry] = []

    def chunk(self, dtype: str, box: Box, file: int = 0, nbytes: int | None = None,
              **kw: Any) -> ChunkEntry:
        start, shape = box
        nb = math.prod(shape) * itemsize_of(dtype) if nbytes is None else nbytes
        off = self.sizes[file]
        self.sizes[file] += nb + 3  # (a gap: offsets are not running sums)
        crc = (7919 * len(self.arrays) + 31 * off + 5) & 0xFFFFFFFF
        return ChunkEntry(file, off, nb, crc, start, shape, **kw)

    def add(self, dtype: str, shape: tuple[int, ...], boxes: list[Box] | None = None,
            **kw: Any) -> int:
        """An array tiled by ``boxes`` (default: one chunk, the whole array)."""
        if boxes is None:
            boxes = [((0,) * len(shape), shape)]
        return self.put(dtype, shape, tuple(self.chunk(dtype, b, **kw) for b in boxes))

    def put(self, dtype: str, shape: tuple[int, ...], chunks: tuple[ChunkEntry, ...]) -> int:
        self.arrays.append(ArrayEntry(dtype, shape, chunks))
        return len(self.arrays) - 1

    def files(self) -> list[FileEntry]:
        return [FileEntry(f"data/r0-{k}.bin", size) for k, size in enumerate(self.sizes)]


# ----------------------------------------------------------------------------- manifests


def v2_numpy_manifest() -> Manifest:
    """The same arrays, their leaves numpy ones (compact in v3), with meta."""
    m = v2_manifest()
    m.tree = Node("dict", keys=list("abcde"), children=[leaf(i) for i in range(5)])
    m.meta = {"step": 7, "note": "v3", "nested": {"x": [1, 2.5, None]}}
    return m


def _shapes_arrays(lay: Layout) -> dict[str, int]:
    """Every layout the table must describe: tiles, row blocks, 0-d, empty, codecs, refs."""
    tb = ((0,), (20,))
    return {
        "tile": lay.add("float32", (4, 6), tiles((4, 6), (2, 3))),
        "rows": lay.add("int16", (6, 4), tiles((6, 4), (2, 4)), block_rows=1,
                        block_checksums=(11, 12)),
        "grid": lay.add("float64", (6, 6), tiles((6, 6), (2, 2)), file=1),
        "cube": lay.add("int8", (2, 3, 4), tiles((2, 3, 4), (1, 3, 2))),
        "scalar": lay.add("float64", ()),
        "none": lay.put("float32", (0, 5), ()),
        "hollow": lay.add("int32", (3, 0)),
        "flags": lay.add("bool", (7,)),
        "cplx": lay.add("complex64", (2, 2)),
        "bf16": lay.add("bfloat16", (8,), tiles((8,), (4,)), file=2),
        "long": lay.add("uint16", (20,), tiles((20,), (2,)), file=2),
        "blob": lay.add("uint8", (5,)),
        "pick": lay.add("uint8", (9,)),
        "zstd": lay.add("float32", (64,), tiles((64,), (16,)), nbytes=9, codec="zstd",
                        shuffle=True, digest=D2),
        "zstd1": lay.add("int64", (30,), nbytes=17, codec="zstd"),
        "hashed": lay.add("int64", (3,), digest=D1),
        "ref": lay.put("float32", (20,), (ChunkEntry(4, 1000, 80, 5, *tb, digest=D2,
                                                     ref=ChunkRef("step-0", 4)),)),
        "ref2": lay.put("float32", (4, 4), (
            ChunkEntry(0, 0, 10, 6, (0, 0), (2, 4), codec="zstd", digest=D1,
                       ref=ChunkRef("step-1", 0)),
            lay.chunk("float32", ((2, 0), (2, 4)), digest=D2))),
    }


def shapes_manifest() -> Manifest:
    """Many layouts and dtypes under nested containers of every kind; mixed leaf kinds,
    extra attributes, an alias, bytes and pickle leaves, plain values."""
    lay = Layout(3)
    a = _shapes_arrays(lay)
    model = Node("dict", keys=["tile", "rows", "grid", "cube", "scalar"], children=[
        leaf(a["tile"]), leaf(a["rows"]), leaf(a["grid"]),
        leaf(a["cube"], "torch", dtensor=True), leaf(a["scalar"], "numpy", scalar=True)])
    state = Node("list", children=[leaf(a["none"], "torch"), leaf(a["hollow"], "torch"),
                                   leaf(a["flags"]), Node("alias", array=a["tile"],
                                                          attrs={"kind": "numpy"})])
    groups = Node("tuple", children=[Node("float", value=0.5), Node("int", value=-(1 << 70)),
                                     Node("none"), leaf(a["cplx"], "jax")])
    opt = Node("stateful", type_name="torch.optim.Adam", children=[
        Node("dict", keys=["state", "param_groups"], children=[state, groups])])
    misc = Node("list", children=[
        Node("bytes", array=a["blob"]), Node("pickle", array=a["pick"], attrs={"kind": "p"}),
        leaf(a["zstd"]), leaf(a["zstd1"]), leaf(a["hashed"], "torch"), leaf(a["ref"]),
        Node("str", value="x"), Node("bool", value=True),
        Node("array", array=a["long"], attrs={"kind": 3}), Node("array", array=a["ref2"])])
    pair = Node("namedtuple", keys=["a", "b"], type_name="pkg.Pair",
                children=[leaf(a["bf16"], "jax"), Node("dict", keys=[], children=[])])
    dc = Node("dataclass", keys=["one"], type_name="pkg.DC",
              children=[Node("stateful", type_name="pkg.S", children=[Node("none")])])
    tree = Node("dict", keys=["model", "opt", "misc", 7, "pair", "dc"],
                children=[model, opt, misc, Node("pytree", keys=["p"], type_name="jax.T",
                                                 children=[Node("int", value=3)]), pair, dc])
    return Manifest(tree=tree, arrays=lay.arrays, files=lay.files(), meta={"step": 3})


def shapes_bases_manifest() -> Manifest:
    """The same, its bases listed explicitly in an order other than first reference."""
    m = shapes_manifest()
    m.bases = ["step-1", "step-0"]
    return m


def many_manifest(n: int = 40) -> Manifest:
    """``n`` one-chunk arrays of a few dtypes, all numpy leaves (a typical v1 manifest)."""
    lay = Layout(2)
    dtypes = ("float32", "int64", "uint8", "float16")
    for i in range(n):
        lay.add(dtypes[i % 4], (i % 5 + 1, 2) if i % 3 else (i % 7,), file=i % 2)
    tree = Node("dict", keys=[f"w{i}" for i in range(n)], children=[leaf(i) for i in range(n)])
    return Manifest(tree=tree, arrays=lay.arrays, files=lay.files())


def empty_manifest() -> Manifest:
    """No arrays at all (a table of empty columns)."""
    return Manifest(tree=Node("dict", keys=["step", "lr"], children=[
        Node("int", value=4), Node("float", value=1e-3)]), arrays=[], files=[])


def hostile_manifest() -> Manifest:
    """The manifest the refusal tests change: seven arrays, 14 chunks at known places.

    chunk 0-3: array 0, float32 (4, 6) as (2, 3) tiles at [0, 96) of file 0; 4: array 1,
    int64 (3,) hashed at [96, 120); 5: array 2, float32 (8,) in base step-1 (file 3) with
    block checksums; 6-11: array 3, float32 (12,) as six zstd chunks of 5 bytes at 8k of
    file 1; 12: array 4, uint8 (4,) at [120, 124); 13: array 5, float64 () at [128, 136);
    array 6: float32 (0, 5), no chunk. Leaves: compact numpy ones, array 5 a torch one.
    """
    tiles4 = tuple(ChunkEntry(0, 24 * k, 24, k, (2 * (k // 2), 3 * (k % 2)), (2, 3))
                   for k in range(4))
    zstd = tuple(ChunkEntry(1, 8 * k, 5, 10 + k, (2 * k,), (2,), codec="zstd") for k in range(6))
    arrays = [
        ArrayEntry("float32", (4, 6), tiles4),
        ArrayEntry("int64", (3,), (ChunkEntry(0, 96, 24, 4, (0,), (3,), digest=D1),)),
        ArrayEntry("float32", (8,), (ChunkEntry(3, 128, 32, 5, (0,), (8,), 2, (5, 6, 7, 8),
                                                digest=D1, ref=ChunkRef("step-1", 3)),)),
        ArrayEntry("float32", (12,), zstd),
        ArrayEntry("uint8", (4,), (ChunkEntry(0, 120, 4, 16, (0,), (4,)),)),
        ArrayEntry("float64", (), (ChunkEntry(0, 128, 8, 17, (), ()),)),
        ArrayEntry("float32", (0, 5), ()),
    ]
    kids = [leaf(i, "torch" if i == 5 else "numpy") for i in range(7)]
    tree = Node("dict", keys=list("abcdefg"), children=kids)
    return Manifest(tree=tree, arrays=arrays,
                    files=[FileEntry("data/r0-0.bin", 136), FileEntry("data/r0-1.bin", 48)])


def hostile_doc() -> Doc:
    return json.loads(encode_v3(hostile_manifest()))  # type: ignore[no-any-return]


def col(doc: Doc, name: str) -> Any:
    return doc["arrays"][name]


BUILDERS: dict[str, Callable[[], Manifest]] = {
    "v2": v2_manifest, "v2-numpy": v2_numpy_manifest, "shapes": shapes_manifest,
    "shapes-bases": shapes_bases_manifest, "many": many_manifest, "empty": empty_manifest,
    "hostile": hostile_manifest,
}


def _used_bases(m: Manifest) -> list[str]:
    if m.bases:
        return list(m.bases)
    refs = (c.ref.base for a in m.arrays for c in a.chunks if c.ref is not None)
    return list(dict.fromkeys(refs))


def assert_same_manifest(got: Manifest, want: Manifest) -> None:
    assert len(got.arrays) == len(want.arrays)
    for i, (g, w) in enumerate(zip(got.arrays, want.arrays)):
        assert (g.dtype, g.shape) == (w.dtype, w.shape), i
        assert list(g.chunks) == list(w.chunks), i
        assert len(g.chunks) == len(w.chunks) and list(g.chunks[:]) == list(w.chunks), i
    assert got.tree == want.tree
    assert got.files == want.files
    assert got.meta == want.meta
    assert got.bases == _used_bases(want)


# ----------------------------------------------------------------------------- writing


@pytest.mark.parametrize("build", list(BUILDERS.values()), ids=list(BUILDERS))
def test_the_table_round_trips_and_matches_the_list_form(build: Callable[[], Manifest]) -> None:
    m = build()
    data = encode_v3(m)
    assert data.startswith(b'{"format":"statestream","version":3,')
    assert type(json.loads(data)["arrays"]) is dict
    back = decode_manifest(data, WHERE)
    assert back.version == 3
    assert_same_manifest(back, m)
    listed = encode_list(m)
    assert b'"version":3' not in listed and b'"ak"' not in listed
    old = decode_manifest(listed, WHERE)
    assert old.version == manifest_version(m) in (1, 2)
    assert_same_manifest(old, m)
    assert back.tree == old.tree and back.bases == old.bases
    # re-encoding what was decoded gives the same bytes, either way
    assert encode_v3(back) == data and encode_list(back) == listed
    assert encode_v3(old) == data and encode_list(old) == listed
    assert json.loads(encode_commit(data))["version"] == 3
    assert decode_commit(encode_commit(data), "/c/COMMITTED") == (len(data), checksum(data))


def test_the_table_is_the_documented_columns() -> None:
    doc = hostile_doc()
    assert list(doc) == ["format", "version", "checksum", "meta", "files", "bases", "arrays",
                         "tree"]
    assert doc["version"] == 3 and doc["bases"] == ["step-1"]
    assert doc["arrays"] == {
        "dtypes": ["float32", "int64", "uint8", "float64"],
        "dtype": [0, 1, 0, 0, 2, 3, 0],
        "ndim": [2, 1, 1, 1, 1, 0, 2],
        "shape": [4, 6, 3, 8, 12, 4, 0, 5],
        "nchunks": [4, 1, 1, 6, 1, 1, 0],
        "chunks": [0, 0, 24, 0, 0, 24, 24, 1, 0, 48, 24, 2, 0, 72, 24, 3,
                   0, 96, 24, 4, 3, 128, 32, 5]
                  + [x for k in range(6) for x in (1, 8 * k, 5, 10 + k)]
                  + [0, 120, 4, 16, 0, 128, 8, 17],
        "boxes": [0, 0, 2, 3, 0, 3, 2, 3, 2, 0, 2, 3, 2, 3, 2, 3, 0, 3, 0, 8]
                 + [x for k in range(6) for x in (2 * k, 2)] + [0, 4],
        "blocks": [[5, 2, [5, 6, 7, 8]]],
        "ext": [[4, {"hash": H1}], [5, {"hash": H1, "ref": 0}]]
               + [[g, {"codec": "zstd"}] for g in range(6, 12)],
    }
    assert doc["tree"] == {"t": "dict", "k": list("abcdefg"), "ak": "numpy",
                           "c": [0, 1, 2, 3, 4, {"t": "array", "a": 5, "x": {"kind": "torch"}},
                                 6]}


def _expected_table(m: Manifest) -> dict[str, Any]:
    """The table docs/format.md describes, built here from the manifest independently."""
    dtypes = list(dict.fromkeys(a.dtype for a in m.arrays))
    bases = _used_bases(m)
    chunks = [c for a in m.arrays for c in a.chunks]
    out: dict[str, Any] = {
        "dtypes": dtypes, "dtype": [dtypes.index(a.dtype) for a in m.arrays],
        "ndim": [len(a.shape) for a in m.arrays], "shape": [d for a in m.arrays for d in a.shape],
        "nchunks": [len(a.chunks) for a in m.arrays],
        "chunks": [x for c in chunks for x in (c.file, c.offset, c.nbytes, c.checksum)],
        "boxes": [x for c in chunks for x in (*c.start, *c.shape)]}
    blocks = [[g, c.block_rows, list(c.block_checksums)] for g, c in enumerate(chunks)
              if c.block_rows]
    ext = []
    for g, c in enumerate(chunks):
        e: dict[str, Any] = {}
        if c.codec is not None:
            e["codec"] = c.codec
        if c.shuffle:
            e["shuffle"] = True
        if c.digest is not None:
            e["hash"] = c.digest.hex()
        if c.ref is not None:
            e["ref"] = bases.index(c.ref.base)
        if e:
            ext.append([g, e])
    if blocks:
        out["blocks"] = blocks
    if ext:
        out["ext"] = ext
    return out


@pytest.mark.parametrize("build", list(BUILDERS.values()), ids=list(BUILDERS))
def test_every_table_has_the_documented_columns(build: Callable[[], Manifest]) -> None:
    m = build()
    doc = json.loads(encode_v3(m))
    assert doc["arrays"] == _expected_table(m)
    assert doc.get("bases", []) == _used_bases(m)


def test_compact_leaves_are_the_containers_most_common_plain_kind() -> None:
    doc = json.loads(encode_v3(shapes_manifest()))
    root = doc["tree"]
    assert "ak" not in root  # no array leaf directly under it
    model = root["c"][0]
    assert model["ak"] == "numpy"
    assert model["c"][:3] == [0, 1, 2]
    # extra attributes keep the object form
    assert model["c"][3] == {"t": "array", "a": 3, "x": {"kind": "torch", "dtensor": True}}
    assert model["c"][4] == {"t": "array", "a": 4, "x": {"kind": "numpy", "scalar": True}}
    state = root["c"][1]["c"][0]["c"][0]
    assert state["ak"] == "torch" and state["c"][:2] == [5, 6]
    assert state["c"][2] == {"t": "array", "a": 7, "x": {"kind": "numpy"}}
    assert state["c"][3]["t"] == "alias"
    groups = root["c"][1]["c"][0]["c"][1]
    assert groups["ak"] == "jax" and groups["c"][3] == 8
    misc = root["c"][2]
    assert misc["ak"] == "numpy"
    assert misc["c"][0] == {"t": "bytes", "a": 11}  # bytes/pickle leaves are never compact
    assert misc["c"][1] == {"t": "pickle", "a": 12, "x": {"kind": "p"}}
    assert misc["c"][2:4] == [13, 14] and misc["c"][5] == 16
    assert misc["c"][8] == {"t": "array", "a": 10, "x": {"kind": 3}}  # a kind not a string
    assert misc["c"][9] == {"t": "array", "a": 17}  # no attributes
    assert "ak" not in root["c"][5] and "ak" not in root["c"][5]["c"][0]
    assert doc["tree"]["c"][4]["ak"] == "jax" and doc["tree"]["c"][4]["c"][0] == 9


def test_compact_leaves_decode_to_kind_attributes() -> None:
    m = hostile_manifest()
    back = decode_manifest(encode_v3(m), WHERE)
    kids = back.tree.children or []
    assert kids[0] == Node("array", array=0, attrs={"kind": "numpy"})
    assert kids[5] == Node("array", array=5, attrs={"kind": "torch"})
    assert [k.array for k in kids] == list(range(7))
    # a hand-written container mixing compact leaves with objects, in every container kind
    doc = hostile_doc()
    doc["tree"] = {"t": "list", "ak": "jax", "c": [
        6, {"t": "tuple", "ak": "torch", "c": [5, {"t": "str", "v": "s"}]},
        {"t": "stateful", "n": "S", "ak": "np", "c": [4]},
        {"t": "namedtuple", "k": ["x", "y"], "n": "P", "ak": "a", "c": [3, 2]},
        {"t": "dataclass", "k": ["z"], "ak": "b", "c": [1]},
        {"t": "pytree", "k": ["w"], "n": "T", "ak": "", "c": [0]}]}
    t = decode_doc(doc).tree
    kids = t.children or []
    assert kids[0] == leaf(6, "jax")
    assert kids[1] == Node("tuple", children=[leaf(5, "torch"), Node("str", value="s")])
    assert kids[2] == Node("stateful", type_name="S", children=[leaf(4, "np")])
    assert kids[3] == Node("namedtuple", keys=["x", "y"], type_name="P",
                           children=[leaf(3, "a"), leaf(2, "a")])
    assert kids[4] == Node("dataclass", keys=["z"], children=[leaf(1, "b")])
    assert kids[5] == Node("pytree", keys=["w"], type_name="T", children=[leaf(0, "")])


def test_the_version_a_writer_picks(monkeypatch: pytest.MonkeyPatch) -> None:
    assert manifest_mod.ARRAY_TABLE_MIN == format_pkg.ARRAY_TABLE_MIN == 1024
    assert format_pkg.MAX_ARRAYS == manifest_mod.MAX_ARRAYS == 1 << 24
    assert manifest_version(many_manifest(1023)) == 1
    big = many_manifest(1024)
    assert manifest_version(big) == 3
    data = encode_manifest(big)
    assert data.startswith(b'{"format":"statestream","version":3,')
    assert_same_manifest(decode_manifest(data, WHERE), big)
    monkeypatch.setattr(manifest_mod, "ARRAY_TABLE_MIN", 5)
    assert manifest_version(many_manifest(4)) == 1
    assert manifest_version(many_manifest(5)) == 3
    assert manifest_version(hostile_manifest()) == 3
    monkeypatch.setattr(manifest_mod, "ARRAY_TABLE_MIN", 8)
    assert manifest_version(hostile_manifest()) == 2  # v2 features, 7 arrays
    assert b'"version":2,' in encode_manifest(hostile_manifest())


def test_the_table_is_much_smaller_than_the_list() -> None:
    m = many_manifest(300)
    assert len(encode_v3(m)) < 0.6 * len(encode_list(m))


def test_numpy_integers_are_written_as_integers() -> None:
    m = hostile_manifest()
    a = m.arrays[4]
    c = a.chunks[0]
    n: Any = np  # (a writer may hold NumPy integers where ints are declared)
    m.arrays[4] = ArrayEntry(a.dtype, (n.int64(4),), (dataclasses.replace(
        c, file=n.int64(0), offset=n.int32(120), nbytes=n.uint64(4), start=(n.int64(0),),
        shape=(n.int16(4),)),))
    assert encode_v3(m) == encode_v3(hostile_manifest())


def test_the_committed_marker_records_version_3() -> None:
    data = encode_v3(hostile_manifest())
    marker = encode_commit(data)
    assert json.loads(marker)["version"] == 3
    assert json.loads(encode_commit(data, version=3))["version"] == 3
    assert decode_commit(marker, "/c/COMMITTED")[0] == len(data)
    assert json.loads(encode_commit(encode_list(hostile_manifest())))["version"] == 2


def test_v3_fields_may_come_in_any_order() -> None:
    doc = hostile_doc()
    order = ["tree", "arrays", "bases", "meta", "checksum", "files", "version", "format"]
    m = decode_doc({k: doc[k] for k in order})
    assert_same_manifest(m, hostile_manifest())


def test_a_referenced_chunk_is_not_checked_against_own_files() -> None:
    doc = hostile_doc()
    col(doc, "chunks")[4 * 5] = 0  # file 0, bytes [128, 160): array 5's own [128, 136)
    m = decode_doc(doc)
    assert m.arrays[2].chunks[0].ref == ChunkRef("step-1", 0)
    col(doc, "chunks")[4 * 5] = 1 << 40  # any index: it is the base's file table's
    assert decode_doc(doc).arrays[2].chunks[0].file == 1 << 40


def test_block_checksums_on_a_single_chunk_array() -> None:
    doc = hostile_doc()
    col(doc, "blocks").append([12, 3, [1, 2]])
    c = decode_doc(doc).arrays[4].chunks[0]
    assert (c.block_rows, c.block_checksums) == (3, (1, 2))
    assert c == ChunkEntry(0, 120, 4, 16, (0,), (4,), 3, (1, 2))


# ----------------------------------------------------------------------------- the API


def _disk_doc(ck: pathlib.Path) -> Doc:
    return json.loads((ck / "manifest.json").read_bytes())  # type: ignore[no-any-return]


def _assert_v3_on_disk(ck: pathlib.Path) -> Doc:
    raw = (ck / "manifest.json").read_bytes()
    assert raw.startswith(b'{"format":"statestream","version":3,')
    marker = json.loads((ck / "COMMITTED").read_bytes())
    assert marker["version"] == 3 and marker["manifest_bytes"] == len(raw)
    doc = _disk_doc(ck)
    assert type(doc["arrays"]) is dict
    return doc


def _many_state(n: int = 1100) -> dict[str, Any]:
    dtypes = (np.float32, np.int64, np.uint8, np.float16, np.bool_, np.complex64)
    arrays = {f"w{i}": (np.arange(i % 7 + 1) * (i + 1)).astype(dtypes[i % len(dtypes)])
              for i in range(n)}
    return {"layers": arrays,
            "odd": {"mat": np.arange(24, dtype=np.float64).reshape(4, 6),
                    "empty": np.zeros((0, 3), np.float32), "zero_d": np.array(7, np.int32)},
            "step": 12, "name": "run"}


def _assert_tree_equal(got: Any, want: Any) -> None:
    if isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want)
        for k in want:
            _assert_tree_equal(got[k], want[k])
    elif isinstance(want, np.ndarray):
        assert isinstance(got, np.ndarray) and got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)
    else:
        assert got == want and type(got) is type(want)


def test_a_save_of_many_arrays_is_v3_and_loads_exactly(tmp_path: pathlib.Path) -> None:
    state = _many_state()
    ck = tmp_path / "c"
    ss.save(ck, state)  # the default threshold
    doc = _assert_v3_on_disk(ck)
    assert doc["tree"]["c"][0]["ak"] == "numpy" and doc["tree"]["c"][0]["c"][:3] == [0, 1, 2]
    _assert_tree_equal(ss.load(ck), state)
    report = ss.verify(ck)
    assert report.ok and report.checked_chunks == sum(doc["arrays"]["nchunks"])
    md = ss.metadata(ck)
    assert md.format_version == 3 and md.num_arrays == 1103
    assert md.total_bytes == sum(a.nbytes for a in state["layers"].values()) + 24 * 8 + 4
    w = md.tree["layers"]["w13"]
    assert (w.shape, w.dtype, w.nbytes, w.kind, w.num_chunks) == ((7,), "int64", 56, "numpy", 1)
    e = md.tree["odd"]["empty"]
    assert (e.shape, e.dtype, e.nbytes) == ((0, 3), "float32", 0)
    assert md.tree["step"] == 12 and md.tree["name"] == "run"
    part = ss.load(ck, items=["odd"])
    _assert_tree_equal(part["odd"], state["odd"])


def test_a_v3_save_of_multi_chunk_arrays(tmp_path: pathlib.Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(manifest_mod, "ARRAY_TABLE_MIN", 0)
    state = {"a": np.arange(100, dtype=np.float32).reshape(10, 10),
             "b": np.arange(60, dtype=np.int16).reshape(3, 4, 5), "c": np.zeros((0, 3)),
             "d": np.array(3.5), "e": np.arange(5, dtype=np.uint8)}
    ck = tmp_path / "c"
    ss.save(ck, state, io=ss.IOOptions(max_chunk_bytes=64))
    doc = _assert_v3_on_disk(ck)
    nchunks = doc["arrays"]["nchunks"]
    assert nchunks[0] > 1 and nchunks[1] > 1 and sum(nchunks) == len(doc["arrays"]["chunks"]) // 4
    _assert_tree_equal(ss.load(ck), state)
    assert ss.verify(ck).ok
    m = ss.metadata(ck)
    assert m.format_version == 3 and m.tree["a"].num_chunks == nchunks[0]
    # a damaged table in a sealed checkpoint is refused, naming the manifest
    doc["arrays"]["chunks"][2] += 1
    data = dumps(doc)
    (ck / "manifest.json").write_bytes(data)
    (ck / "COMMITTED").write_bytes(encode_commit(data))
    with pytest.raises(CheckpointCorruptError, match=r"manifest.json.*array 0 chunk 0 is"):
        ss.load(ck)


def test_a_v3_save_of_torch_tensors(tmp_path: pathlib.Path) -> None:
    torch = pytest.importorskip("torch")
    state = {"m": {f"p{i}": torch.arange(i % 5 + 1, dtype=torch.float32) * i
                   for i in range(1100)},
             "h": torch.ones(3, 4, dtype=torch.bfloat16), "step": 2}
    ck = tmp_path / "t"
    ss.save(ck, state)
    doc = _assert_v3_on_disk(ck)
    assert doc["tree"]["c"][0]["ak"] == "torch"
    out = ss.load(ck, target=state)
    for k, v in state["m"].items():
        assert torch.equal(out["m"][k], v) and out["m"][k].dtype == v.dtype
    assert torch.equal(out["h"], state["h"]) and out["h"].dtype == torch.bfloat16
    assert out["step"] == 2
    assert ss.verify(ck).ok
    md = ss.metadata(ck)
    assert md.format_version == 3 and md.tree["m"]["p7"].kind == "torch"
    assert md.tree["h"].dtype == "bfloat16"


def _compressible(seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {"w": (rng.integers(0, 4, (300, 70)) / 4).astype(np.float32),
            "i": rng.integers(0, 3, 2000).astype(np.int64),
            "noise": rng.integers(0, 256, 500, dtype=np.uint8), "step": seed}


def test_a_v3_compressed_save(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(manifest_mod, "ARRAY_TABLE_MIN", 0)
    state = _compressible(1)
    ck = tmp_path / "z"
    ss.save(ck, state, compression="zstd", io=ss.IOOptions(max_chunk_bytes=16 << 10))
    doc = _assert_v3_on_disk(ck)
    codecs = [e for _, e in doc["arrays"]["ext"] if e.get("codec") == "zstd"]
    assert len(codecs) >= 2 and doc["arrays"]["nchunks"][0] > 1
    _assert_tree_equal(ss.load(ck), state)
    assert ss.verify(ck).ok
    md = ss.metadata(ck)
    assert md.tree["w"].codec == "zstd" and md.tree["w"].stored_bytes < state["w"].nbytes


def test_a_v3_incremental_save(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(manifest_mod, "ARRAY_TABLE_MIN", 0)
    s1 = _compressible(2)
    ss.save(tmp_path / "s1", s1, hashes=True, compression="zstd")
    _assert_v3_on_disk(tmp_path / "s1")
    s2 = dict(s1, i=s1["i"] + 1, step=3)
    ss.save(tmp_path / "s2", s2, base=tmp_path / "s1")
    doc = _assert_v3_on_disk(tmp_path / "s2")
    assert doc["bases"] == ["s1"]
    refs = [g for g, e in doc["arrays"]["ext"] if e.get("ref") == 0]
    assert len(refs) == 2  # w and noise unchanged, i rewritten
    _assert_tree_equal(ss.load(tmp_path / "s2"), s2)
    _assert_tree_equal(ss.load(tmp_path / "s1"), s1)
    assert ss.verify(tmp_path / "s2").ok
    md = ss.metadata(tmp_path / "s2")
    assert md.format_version == 3 and md.bases == ["s1"]
    m1 = decode_manifest((tmp_path / "s1" / "manifest.json").read_bytes(), "s1")
    assert md.referenced_bytes == sum(c.nbytes for k in (0, 2) for c in m1.arrays[k].chunks)
    # and a list-form incremental save on top of the v3 one
    monkeypatch.setattr(manifest_mod, "ARRAY_TABLE_MIN", 1024)
    s3 = dict(s2, noise=s2["noise"] ^ 1, step=4)
    ss.save(tmp_path / "s3", s3, base=tmp_path / "s2")
    assert _disk_doc(tmp_path / "s3")["version"] == 2
    _assert_tree_equal(ss.load(tmp_path / "s3"), s3)


# ----------------------------------------------------------------------------- refusals


def refused(mutate: Callable[[Doc], Any], match: str,
            exc: type[Exception] = CheckpointCorruptError, doc: Doc | None = None) -> str:
    """Decoding the hostile manifest's v3 doc changed by ``mutate`` raises ``exc``."""
    doc = hostile_doc() if doc is None else doc
    mutate(doc)
    with pytest.raises(exc, match=match) as ei:
        decode_doc(doc)
    assert WHERE in str(ei.value) or exc is UnsafeCheckpointError
    return str(ei.value)


def put(name: str, i: int, value: Any) -> Callable[[Doc], None]:
    """Set ``arrays[name][i]``."""
    def mutate(doc: Doc) -> None:
        col(doc, name)[i] = value
    return mutate


def both(*fs: Callable[[Doc], Any]) -> Callable[[Doc], None]:
    def mutate(doc: Doc) -> None:
        for f in fs:
            f(doc)
    return mutate


def _list_form(doc: Doc) -> None:
    doc["arrays"] = json.loads(encode_list(hostile_manifest()))["arrays"]


def _in_version(version: int) -> Callable[[Doc], None]:
    """An otherwise valid table in a v1 or v2 manifest (its tree without ``ak``; without
    bases, which no chunk of a list would refer to)."""
    def mutate(doc: Doc) -> None:
        doc["version"] = version
        doc["tree"] = encode_tree(hostile_manifest().tree)
        del doc["bases"]
    return mutate


def test_the_hostile_doc_decodes() -> None:
    assert_same_manifest(decode_doc(hostile_doc()), hostile_manifest())


STRUCTURE_CASES = {
    "list-in-v3": (_list_form, "format v3 arrays must be a table"),
    "int-arrays": (lambda d: d.update(arrays=7), "format v3 arrays must be a table"),
    "null-arrays": (lambda d: d.update(arrays=None), "format v3 arrays must be a table"),
    "no-arrays": (lambda d: d.pop("arrays"), "format v3 arrays must be a table"),
    "table-in-v2": (_in_version(2), "arrays must be a list"),
    "table-in-v1": (_in_version(1), "arrays must be a list"),
    "unknown-column": (lambda d: d["arrays"].update(extra=[]), "unknown column 'extra'"),
    "unknown-columns": (lambda d: d["arrays"].update(zz=1, Dtype=[]),
                        "unknown column 'Dtype'"),
    "not-a-list-dtypes": (lambda d: d["arrays"].update(dtypes="float32"),
                          "column dtypes must be a list"),
    "not-a-list-ext": (lambda d: d["arrays"].update(ext={}), "column ext must be a list"),
    "not-a-list-blocks": (lambda d: d["arrays"].update(blocks=5), "column blocks must be a list"),
}


@pytest.mark.parametrize(("mutate", "match"), list(STRUCTURE_CASES.values()),
                         ids=list(STRUCTURE_CASES))
def test_malformed_tables_are_refused(mutate: Callable[[Doc], Any], match: str) -> None:
    refused(mutate, match)


def test_a_list_in_v3_is_refused_on_every_parse_path(monkeypatch: pytest.MonkeyPatch) -> None:
    def late_files(doc: Doc) -> None:  # arrays before files: not decoded while parsing
        _list_form(doc)
        doc["files"] = doc.pop("files")
    refused(late_files, "format v3 arrays must be a table")
    monkeypatch.setattr(decode_mod, "_SMALL_MANIFEST_BYTES", 0)  # streamed entry by entry
    refused(_list_form, "format v3 arrays must be a table")
    refused(late_files, "format v3 arrays must be a table")


@pytest.mark.parametrize("name", ["dtypes", "dtype", "ndim", "shape", "nchunks", "chunks",
                                  "boxes"])
def test_every_column_is_required(name: str) -> None:
    refused(lambda d: d["arrays"].pop(name), f"lacks column {name}")


@pytest.mark.parametrize("name", ["dtype", "ndim", "shape", "nchunks", "chunks", "boxes"])
@pytest.mark.parametrize("value", [{}, 3, "x", None], ids=repr)
def test_an_integer_column_must_be_a_list(name: str, value: Any) -> None:
    refused(lambda d: d["arrays"].update({name: value}), f"column {name} must be a list")
    refused(put(name, 0, [value]), rf"column {name} holds \[{value!r}\], not an integer")


#: an index into each integer column, whose value tests replace
INT_SLOTS = {"dtype": 1, "ndim": 0, "shape": 1, "nchunks": 3, "chunks": 4 * 12 + 1, "boxes": 5}


@pytest.mark.parametrize("name", list(INT_SLOTS))
@pytest.mark.parametrize(("value", "match"), [
    (True, "holds True, not an integer"), (False, "holds False, not an integer"),
    (1.0, "holds 1.0, not an integer"), ("1", "holds '1', not an integer"),
    (None, "holds None, not an integer"), (2**70, "holds an integer out of range"),
    (2**63, "holds an integer out of range"), (-(2**63) - 1, "holds an integer out of range"),
    (-1, r"column {name}\[{i}\] is -1, not in \[0, "),
    (2**63 - 1, r"column {name}\[{i}\] is 9223372036854775807, not in \[0, "),
], ids=["true", "false", "float", "str", "null", "2^70", "2^63", "-2^63-1", "-1", "2^63-1"])
def test_every_integer_column_refuses_what_is_not_an_integer_in_range(
        name: str, value: Any, match: str) -> None:
    i = INT_SLOTS[name]
    refused(put(name, i, value), match.format(name=name, i=i))


LENGTH_CASES = {
    "ndim-longer": (lambda d: col(d, "ndim").append(1), "column ndim has 8 values, not 7"),
    "dtype-longer": (lambda d: col(d, "dtype").append(0), "column ndim has 7 values, not 8"),
    "nchunks-shorter": (lambda d: col(d, "nchunks").pop(), "column nchunks has 6 values, not 7"),
    "shape-longer": (lambda d: col(d, "shape").append(1), "column shape has 9 values, not 8"),
    "shape-shorter": (lambda d: col(d, "shape").pop(), "column shape has 7 values, not 8"),
    "ndim-of-0d": (put("ndim", 5, 1), "column shape has 8 values, not 9"),
    "chunks-shorter": (lambda d: col(d, "chunks").pop(), "column chunks has 55 values, not 56"),
    "chunks-longer": (lambda d: col(d, "chunks").extend([0] * 4),
                      "column chunks has 60 values, not 56"),
    "nchunks-more": (put("nchunks", 6, 1), "column chunks has 56 values, not 60"),
    "boxes-shorter": (lambda d: col(d, "boxes").pop(), "column boxes has 33 values, not 34"),
    "boxes-longer": (lambda d: col(d, "boxes").extend([0, 0]),
                     "column boxes has 36 values, not 34"),
}


@pytest.mark.parametrize(("mutate", "match"), list(LENGTH_CASES.values()), ids=list(LENGTH_CASES))
def test_columns_of_the_wrong_length_are_refused(mutate: Callable[[Doc], Any], match: str) -> None:
    refused(mutate, match)


DTYPE_CASES = {
    "unknown": (put("dtypes", 1, "float128"), "names unknown dtype 'float128'"),
    "not-a-str": (put("dtypes", 1, 3), "names unknown dtype 3"),
    "case": (put("dtypes", 0, "Float32"), "names unknown dtype 'Float32'"),
    "twice": (put("dtypes", 2, "float32"), "lists a dtype twice"),
    "index-past": (put("dtype", 0, 4), r"column dtype\[0\] is 4, not in \[0, 3\]"),
    "none-listed": (lambda d: d["arrays"].update(dtypes=[]), r"dtype\[0\] is 0, not in \[0, -1\]"),
}


@pytest.mark.parametrize(("mutate", "match"), list(DTYPE_CASES.values()), ids=list(DTYPE_CASES))
def test_dtypes_are_refused(mutate: Callable[[Doc], Any], match: str) -> None:
    refused(mutate, match)


LIMIT_CASES = {
    "ndim>32": (put("ndim", 0, 33), r"column ndim\[0\] is 33, not in \[0, 32\]"),
    "dim>2^48": (put("shape", 0, 2**48 + 1),
                 r"column shape\[0\] is 281474976710657, not in \[0, 281474976710656\]"),
    "box>2^48": (put("boxes", 2, 2**48 + 1), r"column boxes\[2\] is 281474976710657"),
    # more chunks than a manifest can list (2^40 was allowed: see below)
    "nchunks>2^27": (put("nchunks", 3, 2**40),
                     r"column nchunks\[3\] is 1099511627776, not in \[0, 134217728\]"),
    "file>2^62": (put("chunks", 4 * 12, 2**62 + 1), r"column chunks\[48\] is 4611686018427387905"),
    "offset": (put("chunks", 4 * 4 + 1, 2**52 + 1), "array 1 chunk 0 has a bad offset"),
    "length": (put("chunks", 4 * 4 + 2, 2**48 + 1), "array 1 chunk 0 has a bad length"),
    "checksum": (put("chunks", 4 * 3 + 3, 2**32),
                 "array 0 chunk 3 has a bad checksum 4294967296"),
    "array-bytes": (put("shape", 6, 2**47),
                    r"array 6 is 2814749767106560 bytes \(limit 281474976710656\)"),
    "array-bytes-2d": (both(put("shape", 6, 2**40), put("shape", 7, 2**40)),
                       r"array 6 is \d+ bytes \(limit 281474976710656\)"),
    # a chunk box whose volume wraps int64 was named as one that "needs 0" bytes
    "chunk-bytes-wrap": (both(put("shape", 0, 2**48), put("shape", 1, 2**48),
                              put("boxes", 2, 2**48), put("boxes", 3, 2**48)),
                         r"array 0 chunk 0 of shape \(281474976710656, 281474976710656\) "
                         r"holds more than 281474976710656 bytes"),
}


@pytest.mark.parametrize(("mutate", "match"), list(LIMIT_CASES.values()), ids=list(LIMIT_CASES))
def test_limits_are_enforced(mutate: Callable[[Doc], Any], match: str) -> None:
    refused(mutate, match)


def test_the_chunk_counts_of_the_most_arrays_sum_exactly() -> None:
    # with 2^40 chunks allowed per array, 2^24 arrays of 2^40 wrapped the int64 sum of
    # nchunks to 0: an empty chunks column passed its length check, and np.repeat over
    # the counts crashed the interpreter
    assert manifest_mod.MAX_ARRAYS * table_mod._MAX_CHUNKS < 2**63
    assert manifest_mod.MAX_MANIFEST_BYTES < 8 * (table_mod._MAX_CHUNKS + 1)


CHUNK_CASES = {
    "outside-tile": (put("boxes", 13, 4),
                     r"array 0 chunk 3 lies outside the array's shape \(4, 6\)"),
    "outside-row": (put("boxes", 30, 11),
                    r"array 3 chunk 5 lies outside the array's shape \(12,\)"),
    "outside-size": (put("boxes", 7, 4), r"array 0 chunk 1 lies outside"),
    "nbytes": (put("chunks", 4 * 4 + 2, 20), r"array 1 chunk 0 is 20 bytes but its shape \(3,\) "
               r"x 8 bytes per element needs 24"),
    "nbytes-tile": (put("chunks", 4 * 2 + 2, 23), r"array 0 chunk 2 is 23 bytes but its shape "
                    r"\(2, 3\) x 4 bytes per element needs 24"),
    "nbytes-0d": (put("chunks", 4 * 13 + 2, 4), r"array 5 chunk 0 is 4 bytes but its shape \(\) "
                  r"x 8 bytes per element needs 8"),
    "nbytes-ref": (put("chunks", 4 * 5 + 2, 20), "array 2 chunk 0 is 20 bytes"),
    "codec-raw-size": (put("chunks", 4 * 8 + 2, 8), r"array 3 chunk 2 is compressed to 8 bytes, "
                       r"which is not between 1 and its raw size 8"),
    "codec-zero": (put("chunks", 4 * 11 + 2, 0), "array 3 chunk 5 is compressed to 0 bytes"),
    "codec-ratio": (both(put("shape", 4, 12 + 2**18), put("boxes", 31, 2 + 2**18)),
                    r"array 3 chunk 5 claims 1048584 raw bytes from 5 compressed ones, more "
                    r"than 32768 times"),
    "file-index": (put("chunks", 4 * 12, 2), "array 4 chunk 0 refers to file 2, not one of 2"),
    "file-span": (put("chunks", 4 * 12 + 1, 133), r"array 4 chunk 0 spans bytes \[133, 137\) of "
                  r"data/r0-0.bin, which the manifest says has only 136 bytes"),
    "file-size": (lambda d: d["files"][1].__setitem__(1, 44),
                  r"array 3 chunk 5 spans bytes \[40, 45\) of data/r0-1.bin"),
    "overlap-tile": (put("boxes", 5, 2), "array 0 has overlapping chunks"),
    "overlap-row": (put("boxes", 22, 0), "array 3 has overlapping chunks"),
    "cover": (both(put("boxes", 15, 2), put("chunks", 4 * 3 + 2, 16)),
              "array 0's chunks cover 22 of its 24 elements"),
    "cover-none": (put("shape", 6, 1), "array 6's chunks cover 0 of its 5 elements"),
    "cover-more": (both(put("boxes", 13, 2), put("boxes", 15, 4), put("chunks", 4 * 3 + 2, 32)),
                   "array 0's chunks cover 26 of its 24 elements"),
    "share": (put("chunks", 4 * 12 + 1, 100), r"two chunks share bytes of data/r0-0.bin \(one "
              r"spans \[96, 120\), the next starts at 100\)"),
    "share-file-1": (put("chunks", 4 * 7 + 1, 2), "two chunks share bytes of data/r0-1.bin"),
    "share-arrays": (put("chunks", 4 * 13 + 1, 64), "two chunks share bytes of data/r0-0.bin"),
}


@pytest.mark.parametrize(("mutate", "match"), list(CHUNK_CASES.values()), ids=list(CHUNK_CASES))
def test_chunks_are_checked_as_in_the_list_form(mutate: Callable[[Doc], Any], match: str) -> None:
    refused(mutate, match)


def _ext(k: int) -> Callable[[Doc], dict[str, Any]]:
    return lambda d: col(d, "ext")[k][1]


EXT_CASES = {
    "out-of-order": (lambda d: col(d, "ext").reverse(),
                     "column ext names chunk 10 out of order or out of range"),
    "twice": (lambda d: col(d, "ext").insert(1, col(d, "ext")[0]), "names chunk 4 out of order"),
    "past-the-end": (lambda d: col(d, "ext")[-1].__setitem__(0, 14), "names chunk 14 out of"),
    "negative": (lambda d: col(d, "ext")[0].__setitem__(0, -1), "names chunk -1 out of"),
    "row-width": (lambda d: col(d, "ext")[0].append(1), r"must hold \[chunk, \.\.\.\] rows of 2"),
    "row-not-list": (put("ext", 0, 4), r"column ext must hold \[chunk, \.\.\.\] rows of 2"),
    "row-bool": (lambda d: col(d, "ext")[0].__setitem__(0, True), "rows of 2"),
    "row-float": (lambda d: col(d, "ext")[0].__setitem__(0, 4.0), "rows of 2"),
    "empty": (lambda d: col(d, "ext")[0].__setitem__(1, {}),
              r"array 1 chunk 0 has a malformed extension \(must be a non-empty object\)"),
    "not-object": (lambda d: col(d, "ext")[0].__setitem__(1, [1]),
                   "array 1 chunk 0 has a malformed extension"),
    "unknown-field": (lambda d: _ext(0)(d).update(delta=1), "unknown field 'delta'"),
    "shuffle-no-codec": (lambda d: _ext(0)(d).update(shuffle=True),
                         "array 1 chunk 0: shuffle must be true, with a codec"),
    "shuffle-false": (lambda d: _ext(3)(d).update(shuffle=False),
                      "array 3 chunk 1: shuffle must be true"),
    "bad-hash": (lambda d: _ext(0)(d).update(hash=H1.upper()), "array 1 chunk 0 has a bad hash"),
    "short-hash": (lambda d: _ext(1)(d).update(hash=H1[:30]), "array 2 chunk 0 has a bad hash"),
    "ref-past": (lambda d: _ext(1)(d).update(ref=1),
                 "array 2 chunk 0 refers to base 1, not one of the 1 listed"),
    "ref-negative": (lambda d: _ext(1)(d).update(ref=-1), "refers to base -1"),
    "ref-str": (lambda d: _ext(1)(d).update(ref="0"), "refers to base '0'"),
    "ref-no-bases": (lambda d: d.pop("bases"),
                     "array 2 chunk 0 refers to base 0, not one of the 0"),
    "ref-no-hash": (lambda d: _ext(1)(d).pop("hash"),
                    "array 2 chunk 0 refers to a base checkpoint without a hash"),
    "base-unused": (lambda d: d["bases"].append("step-2"),
                    "base checkpoint step-2 is listed but no chunk refers to it"),
    "base-twice": (lambda d: d["bases"].append("step-1"), "base checkpoint step-1 is listed twice"),
    "no-ref": (lambda d: _ext(1)(d).pop("ref"), "array 2 chunk 0 refers to file 3, not one of 2"),
}


@pytest.mark.parametrize(("mutate", "match"), list(EXT_CASES.values()), ids=list(EXT_CASES))
def test_extension_rows_are_checked(mutate: Callable[[Doc], Any], match: str) -> None:
    refused(mutate, match)


@pytest.mark.parametrize(("k", "codec", "where"), [
    (2, "lz4", "array 3 chunk 0"), (7, "brotli", "array 3 chunk 5")])
def test_an_unknown_codec_is_a_format_version_error(k: int, codec: Any, where: str) -> None:
    msg = refused(lambda d: _ext(k)(d).update(codec=codec), f"{where} is encoded with codec "
                  f"{codec!r}.*upgrade statestream", FormatVersionError)
    assert "zstd" in msg


@pytest.mark.parametrize(("k", "codec", "where"), [
    (0, 3, "array 1 chunk 0"), (1, None, "array 2 chunk 0"), (2, ["zstd"], "array 3 chunk 0")])
def test_a_codec_that_is_not_a_name_is_malformed(k: int, codec: Any, where: str) -> None:
    # no newer statestream writes it: it was a FormatVersionError saying to upgrade
    refused(lambda d: _ext(k)(d).update(codec=codec),
            f"{where}: its codec {re.escape(repr(codec))} is not a name")


def test_unsafe_names_are_refused_in_v3() -> None:
    refused(lambda d: d["files"][0].__setitem__(0, "../x.bin"), "not a plain file",
            UnsafeCheckpointError)
    refused(lambda d: d.update(bases=["../up"]), "not a sibling directory", UnsafeCheckpointError)


def test_a_future_version_with_a_table_is_a_format_version_error() -> None:
    refused(lambda d: d.update(version=4), "format version 4.*upgrade", FormatVersionError)

    def future(doc: Doc) -> None:
        doc["version"] = 4
        doc["arrays"]["newcol"] = [1]
        doc["tree"]["zz"] = 1
    refused(future, "format version 4.*upgrade", FormatVersionError)


BLOCK_CASES = {
    "zero-rows": (lambda d: col(d, "blocks")[0].__setitem__(1, 0),
                  "array 2 chunk 0 has a malformed block checksum table"),
    "str-rows": (lambda d: col(d, "blocks")[0].__setitem__(1, "2"), "malformed block checksum"),
    "bool-rows": (lambda d: col(d, "blocks")[0].__setitem__(1, True), "malformed block checksum"),
    "few-crcs": (lambda d: col(d, "blocks")[0][2].pop(), "malformed block checksum"),
    "many-crcs": (lambda d: col(d, "blocks")[0][2].append(9), "malformed block checksum"),
    "big-crc": (lambda d: col(d, "blocks")[0][2].__setitem__(0, 2**32), "malformed block"),
    "neg-crc": (lambda d: col(d, "blocks")[0][2].__setitem__(0, -1), "malformed block"),
    "bool-crc": (lambda d: col(d, "blocks")[0][2].__setitem__(0, True), "malformed block"),
    "crcs-not-list": (lambda d: col(d, "blocks")[0].__setitem__(2, 5), "malformed block"),
    "row-width": (lambda d: col(d, "blocks")[0].pop(), r"column blocks must hold \[chunk, "
                  r"\.\.\.\] rows of 3"),
    "row-not-list": (put("blocks", 0, 5), "rows of 3"),
    "compressed": (lambda d: col(d, "blocks").append([6, 2, [1]]),
                   "array 3 chunk 0 is compressed and has block checksums"),
    "0-d": (lambda d: col(d, "blocks").append([13, 1, []]),
            "array 5 chunk 0 has a malformed block checksum table"),
    "out-of-order": (lambda d: col(d, "blocks").insert(0, [12, 4, [1]]),
                     "column blocks names chunk 5 out of order or out of range"),
    "past-the-end": (lambda d: col(d, "blocks").append([14, 1, [1, 2, 3, 4]]),
                     "column blocks names chunk 14 out of order or out of range"),
}


@pytest.mark.parametrize(("mutate", "match"), list(BLOCK_CASES.values()), ids=list(BLOCK_CASES))
def test_block_rows_are_checked(mutate: Callable[[Doc], Any], match: str) -> None:
    refused(mutate, match)


def _tree_kid(k: int, value: Any) -> Callable[[Doc], None]:
    return lambda d: d["tree"]["c"].__setitem__(k, value)


def _compact_in(version: int) -> Callable[[Doc], None]:
    """A list-form v1/v2 manifest whose tree has compact leaves."""
    def mutate(doc: Doc) -> None:
        m = hostile_manifest() if version == 2 else many_manifest(7)
        doc.clear()
        doc.update(json.loads(encode_list(m)))
        assert doc["version"] == version
        doc["tree"] = json.loads(encode_v3(m))["tree"]
        assert "ak" in doc["tree"]
    return mutate


TREE_CASES = {
    "ak-in-v1": (_compact_in(1), "a format v1 manifest has a format v3 field"),
    "ak-in-v2": (_compact_in(2), r"a format v2 manifest has a format v3 field \(compact array "),
    "ak-int": (lambda d: d["tree"].update(ak=1), "only a container's children may be compact"),
    "ak-null": (lambda d: d["tree"].update(ak=None), "only a container's children may be"),
    "ak-list": (lambda d: d["tree"].update(ak=["numpy"]), "only a container's children may be"),
    "ak-on-leaf": (lambda d: d["tree"]["c"][5].update(ak="numpy"),
                   "only a container's children may be compact array leaves"),
    "ak-on-value": (_tree_kid(5, {"t": "str", "v": "s", "ak": "numpy"}),
                    "only a container's children may be"),
    "ak-on-alias": (_tree_kid(5, {"t": "alias", "a": 0, "ak": "numpy"}),
                    "only a container's children may be"),
    "ak-no-children": (lambda d: d["tree"].pop("c"), "children must be a list"),
    "ak-children-obj": (lambda d: d["tree"].update(c={"0": 1}), "children must be a list"),
    "negative": (_tree_kid(0, -1), r"array index must be an integer in \[0, \d+\], got -1"),
    "huge": (_tree_kid(0, 2**70), "array index must be an integer in"),
    "true": (_tree_kid(0, True), "tree node must be an object"),
    "false": (_tree_kid(0, False), "tree node must be an object"),
    "float": (_tree_kid(0, 0.0), "tree node must be an object"),
    "string": (_tree_kid(0, "0"), "tree node must be an object"),
    "past-arrays": (_tree_kid(0, 7), r"array index must be an integer in \[0, 6\], got 7"),
    "twice": (_tree_kid(1, 0), "array 0 is referenced twice"),
    "twice-with-object": (_tree_kid(0, 5), "array 5 is referenced twice"),
    "no-ak": (lambda d: d["tree"].pop("ak"), "tree node must be an object"),
    "nested-no-ak": (_tree_kid(6, {"t": "list", "c": [6]}), "tree node must be an object"),
    "bytes-not-uint8": (lambda d: d["tree"]["c"].__setitem__(0, {"t": "bytes", "a": 0}),
                        "bytes leaf must be a 1-D uint8 blob"),
    "alias-of-nothing": (lambda d: d["tree"]["c"].append({"t": "alias", "a": 7}) or
                         d["tree"]["k"].append("h"), "alias's array index must be"),
}


@pytest.mark.parametrize(("mutate", "match"), list(TREE_CASES.values()), ids=list(TREE_CASES))
def test_compact_leaves_are_checked(mutate: Callable[[Doc], Any], match: str) -> None:
    refused(mutate, match)


def test_no_arrays_and_a_compact_leaf() -> None:
    doc = json.loads(encode_v3(empty_manifest()))
    assert doc["arrays"] == {"dtypes": [], "dtype": [], "ndim": [], "shape": [], "nchunks": [],
                             "chunks": [], "boxes": []}
    doc["tree"] = {"t": "list", "ak": "numpy", "c": [0]}
    refused(lambda d: None, "array index refers to an empty array table", doc=doc)


# ----------------------------------------------------------------------------- MAX_ARRAYS


def test_max_arrays_bounds_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(table_mod, "MAX_ARRAYS", 7)
    assert len(decode_doc(hostile_doc()).arrays) == 7  # at the limit
    monkeypatch.setattr(table_mod, "MAX_ARRAYS", 6)
    refused(lambda d: None, r"7 arrays \(limit 6\)")


@pytest.mark.parametrize("path", ["small", "streamed", "files-last"])
def test_max_arrays_bounds_the_list(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if path == "streamed":
        monkeypatch.setattr(decode_mod, "_SMALL_MANIFEST_BYTES", 0)
    doc = json.loads(encode_list(hostile_manifest()))
    if path == "files-last":
        doc["files"] = doc.pop("files")
    monkeypatch.setattr(decode_mod, "MAX_ARRAYS", 7)
    assert len(decode_doc(doc).arrays) == 7
    monkeypatch.setattr(decode_mod, "MAX_ARRAYS", 6)
    refused(lambda d: None, r"7 arrays \(limit 6\)|more than 6 arrays", doc=doc)


# ----------------------------------------------------------------------------- parity


def _outcome(data: bytes) -> tuple[str, str]:
    """What decoding gives: ("ok", the manifest's arrays and tree) or (error type, message)."""
    try:
        m = decode_manifest(data, WHERE)
    except ERRORS as exc:
        return type(exc).__name__, str(exc)
    arrays = [(a.dtype, a.shape, list(a.chunks)) for a in m.arrays]
    return "ok", repr((arrays, m.tree, m.files, m.bases))


def _set_chunk(a: int, j: int, **kw: Any) -> Callable[[Manifest], None]:
    def mutate(m: Manifest) -> None:
        e = m.arrays[a]
        chunks = list(e.chunks)
        chunks[j] = dataclasses.replace(chunks[j], **kw)
        m.arrays[a] = ArrayEntry(e.dtype, e.shape, tuple(chunks))
    return mutate


def _set_shape(a: int, shape: tuple[int, ...]) -> Callable[[Manifest], None]:
    def mutate(m: Manifest) -> None:
        m.arrays[a] = dataclasses.replace(m.arrays[a], shape=shape)
    return mutate


#: single defects of a Manifest (the encoder writes them), decoded from both forms
PARITY_CASES: dict[str, tuple[Callable[[], Manifest], Callable[[Manifest], None]]] = {
    "nbytes": (hostile_manifest, _set_chunk(1, 0, nbytes=20)),
    "file-index": (hostile_manifest, _set_chunk(4, 0, file=2)),
    "file-span": (hostile_manifest, _set_chunk(4, 0, offset=133)),
    "outside": (hostile_manifest, _set_chunk(0, 3, start=(2, 4))),
    "overlap-tiles": (hostile_manifest, _set_chunk(0, 1, start=(0, 2))),
    "cover": (hostile_manifest, _set_chunk(0, 3, shape=(2, 2), nbytes=16)),
    "codec-size": (hostile_manifest, _set_chunk(3, 2, nbytes=8)),
    "share": (hostile_manifest, _set_chunk(4, 0, offset=100)),
    "array-bytes": (hostile_manifest, _set_shape(6, (2**47, 5))),
    "crc": (hostile_manifest, _set_chunk(1, 0, checksum=2**32)),
    "offset": (hostile_manifest, _set_chunk(1, 0, offset=2**52 + 1)),
    "blocks": (hostile_manifest, _set_chunk(2, 0, block_checksums=(5, 6, 7))),
    "ref-own-bytes": (hostile_manifest, _set_chunk(2, 0, file=0, ref=ChunkRef("step-1", 0))),
    "shrunk": (hostile_manifest, _set_shape(0, (4, 5))),
    "grid-overlap": (shapes_manifest, _set_chunk(2, 8, start=(4, 3))),
    "grid-gap": (shapes_manifest, _set_chunk(2, 4, shape=(1, 2), nbytes=16)),
    "long-overlap": (shapes_manifest, _set_chunk(10, 3, start=(5,))),
    "cube-overlap": (shapes_manifest, _set_chunk(3, 1, start=(0, 0, 1))),
    "scalar-bytes": (shapes_manifest, _set_chunk(4, 0, nbytes=4)),
    "hollow-shape": (shapes_manifest, _set_chunk(6, 0, shape=(3, 1))),
    "hollow-moved": (shapes_manifest, _set_chunk(6, 0, start=(1, 0), shape=(2, 0))),
    "none-missing": (shapes_manifest, _set_shape(5, (1, 5))),
    "ref2-ratio": (shapes_manifest, _set_chunk(17, 0, nbytes=32)),
    "flags-file": (shapes_manifest, _set_chunk(7, 0, file=3)),
    "valid": (shapes_manifest, lambda m: None),
}


@pytest.mark.parametrize(("build", "mutate"), list(PARITY_CASES.values()),
                         ids=list(PARITY_CASES))
def test_the_table_and_the_list_refuse_alike(build: Callable[[], Manifest],
                                             mutate: Callable[[Manifest], None]) -> None:
    m = build()
    mutate(m)
    got, want = _outcome(encode_v3(m)), _outcome(encode_list(m))
    assert got == want


_INTERESTING = st.one_of(
    st.sampled_from([0, 1, 2, 3, 4, 5, 7, 8, 16, 24, 96, 136, 2**31, 2**32 - 1, 2**32,
                     2**47, 2**48, 2**48 + 1, 2**52, 2**62, 2**63 - 1, 2**63, 2**64, -1, -2]),
    st.integers(-3, 40))


def _fields(m: Manifest) -> list[tuple[int, int, str, int]]:
    """(array, chunk or -1 for the array's shape, field, axis) of every integer."""
    out = []
    for i, a in enumerate(m.arrays):
        out += [(i, -1, "shape", k) for k in range(len(a.shape))]
        for j, c in enumerate(a.chunks):
            out += [(i, j, f, 0) for f in ("file", "offset", "nbytes", "checksum")]
            out += [(i, j, f, k) for f in ("start", "shape") for k in range(len(c.start))]
    return out


def _change(m: Manifest, where: tuple[int, int, str, int], v: int) -> None:
    i, j, field, k = where
    a = m.arrays[i]
    if j < 0:
        m.arrays[i] = ArrayEntry(a.dtype, a.shape[:k] + (v,) + a.shape[k + 1:], a.chunks)
        return
    c = a.chunks[j]
    old = getattr(c, field)
    new = old[:k] + (v,) + old[k + 1:] if type(old) is tuple else v
    kw: dict[str, Any] = {field: new}
    if field == "file" and c.ref is not None:  # (a reference names its base's file)
        kw["ref"] = ChunkRef(c.ref.base, v)
    _set_chunk(i, j, **kw)(m)


_PARITY_FIELDS = _fields(hostile_manifest()) + [("s",) + f for f in _fields(shapes_manifest())]


@settings(max_examples=200, deadline=None, database=None)
@given(st.sampled_from(_PARITY_FIELDS), _INTERESTING, st.sampled_from([None, 0, 1]))
def test_any_changed_integer_decodes_alike_from_both_forms(where: tuple[Any, ...], v: int,
                                                           also: int | None) -> None:
    m = shapes_manifest() if where[0] == "s" else hostile_manifest()
    where = where[1:] if where[0] == "s" else where
    _change(m, where, v)
    if also is not None:  # and the same value in the next field, or its array's shape
        fields = _fields(m)
        nxt = fields[(fields.index(where) + 1) % len(fields)]
        _change(m, nxt, v + also)
    got, want = _outcome(encode_v3(m)), _outcome(encode_list(m))
    assert got[0] == want[0], (got, want)
    if got[0] == "ok":
        assert got == want


# ----------------------------------------------------------------------------- fuzzing


def _slots(x: Any, path: tuple[Any, ...]) -> Iterator[tuple[Any, ...]]:
    """The path of every value inside ``x`` (lists' items and objects' values)."""
    if type(x) is list:
        items: Any = enumerate(x)
    elif type(x) is dict:
        items = x.items()
    else:
        return
    for k, v in items:
        yield (*path, k)
        yield from _slots(v, (*path, k))


_BASE = hostile_doc()
_BASE_TEXT = json.dumps(_BASE)
_FUZZ_SLOTS = [p for key in ("arrays", "tree", "files", "bases")
               for p in _slots(_BASE[key], (key,))]
_VALUES = st.one_of(st.integers(-2**70, 2**70), st.booleans(), st.floats(), st.text(max_size=3),
                    st.none(), st.lists(st.integers(), max_size=2))


def _replace(doc: Doc, path: tuple[Any, ...], value: Any) -> None:
    x: Any = doc
    for k in path[:-1]:
        x = x[k]
    x[path[-1]] = value


@settings(max_examples=200, deadline=None, database=None)
@given(st.sampled_from(_FUZZ_SLOTS), _VALUES)
def test_no_foreign_exception_escapes_a_changed_table(path: tuple[Any, ...], value: Any) -> None:
    doc = json.loads(_BASE_TEXT)
    _replace(doc, path, value)
    try:
        decode_doc(doc)
    except ERRORS as exc:
        assert WHERE in str(exc) or isinstance(exc, UnsafeCheckpointError)


@settings(max_examples=200, deadline=None, database=None)
@given(st.sampled_from(["dtypes", "dtype", "ndim", "shape", "nchunks", "chunks", "boxes"]),
       st.integers(0, 200), _VALUES)
def test_no_foreign_exception_escapes_a_changed_column(name: str, index: int,
                                                       value: Any) -> None:
    doc = json.loads(_BASE_TEXT)
    column = col(doc, name)
    column[index % len(column)] = value
    try:
        decode_doc(doc)
    except ERRORS as exc:
        assert WHERE in str(exc) or isinstance(exc, UnsafeCheckpointError)


# ----------------------------------------------------------------------------- known bugs

_DUP_HEAD = ('{"format":"statestream","version":3,"checksum":"crc32c","meta":{},'
             '"files":[["data/r0-0.bin",%d]],')
_DUP_TABLE = ('{"dtypes":["uint8"],"dtype":[0],"ndim":[1],"shape":[4],"nchunks":[1],'
              '"chunks":[0,0,4,0],"boxes":[0,4]}')
_DUP_TREE = '{"t":"list","ak":"numpy","c":[0]}'


def _duplicate_arrays(first: str, size: int = 4) -> bytes:
    """A v3 manifest whose ``arrays`` key comes twice: ``first``, then a one-array table
    (as ``json.loads`` reads it, the table)."""
    return (_DUP_HEAD % size + '"arrays":' + first + ',"arrays":' + _DUP_TABLE + ',"tree":'
            + _DUP_TREE + "}").encode()


def test_a_duplicate_arrays_key_raises_only_statestream_errors() -> None:
    h = hostile_manifest()
    doc = json.loads(encode_list(h))
    head = {k: doc[k] for k in ("format", "version", "checksum", "meta", "files", "bases")}
    head["version"] = 3
    text = (json.dumps(head)[:-1] + ',"arrays":' + json.dumps(doc["arrays"]) + ',"arrays":'
            + json.dumps({"dtypes": ["uint8"], "dtype": [0], "ndim": [1], "shape": [4],
                          "nchunks": [1], "chunks": [0, 0, 4, 0], "boxes": [0, 4]})
            + ',"tree":' + _DUP_TREE + "}")
    with pytest.raises(CheckpointCorruptError, match="gives 'arrays' twice"):
        decode_manifest(text.encode(), WHERE)


def test_a_duplicate_arrays_key_does_not_leak_into_the_table() -> None:
    alone = decode_manifest(_DUP_HEAD % 4 + '"arrays":' + _DUP_TABLE + ',"tree":' + _DUP_TREE
                            + "}", WHERE)
    want = list(alone.arrays[0].chunks)
    assert want == [ChunkEntry(0, 0, 4, 0, (0,), (4,))]
    first = ('[{"dtype":"uint8","shape":[8],"chunks":[[0,0,4,0,[0],[8],null,'
             '{"codec":"zstd"}]]}]')
    data = _duplicate_arrays(first)
    assert json.loads(data)["arrays"] == json.loads(_DUP_TABLE)
    try:
        m = decode_manifest(data, WHERE)
    except ERRORS:
        return  # refusing a duplicate key is as good
    assert list(m.arrays[0].chunks) == want  # got codec='zstd' with nbytes == raw size
