"""Tests for statestream.format._manifest: encoding, decoding and every limit."""

from __future__ import annotations

import copy
import json
import math
import struct
from collections.abc import Callable
from typing import Any

import pytest

import statestream.format._decode as decode_mod
import statestream.format._decode_arrays as arrays_mod
import statestream.format._decode_tree as decode_tree_mod
import statestream.format._tiles as tiles_mod
from statestream.errors import (
    CheckpointCorruptError,
    CheckpointError,
    FormatVersionError,
    UnsafeCheckpointError,
)
from statestream.format import (
    COMMIT_NAME,
    DATA_DIR,
    FORMAT_NAME,
    FORMAT_VERSION,
    FORMAT_VERSIONS,
    MANIFEST_NAME,
    MAX_ARRAY_BYTES,
    MAX_COMMIT_BYTES,
    MAX_DIM,
    MAX_NDIM,
    ArrayEntry,
    ChunkEntry,
    FileEntry,
    Manifest,
    checksum,
    decode_commit,
    decode_manifest,
    decode_tree,
    encode_commit,
    encode_manifest,
    validate_file_name,
)
from statestream.tree import MAX_TREE_DEPTH, Node

WHERE = "/ckpt/manifest.json"


def test_constants() -> None:
    assert (FORMAT_NAME, FORMAT_VERSION, FORMAT_VERSIONS) == ("statestream", 3, (1, 2, 3))
    assert (MANIFEST_NAME, COMMIT_NAME, DATA_DIR) == ("manifest.json", "COMMITTED", "data")


def make_manifest() -> Manifest:
    """A small valid manifest: two arrays in two files, every node kind."""
    w = ArrayEntry(
        "float32", (4, 4),
        (ChunkEntry(0, 0, 32, 11, (0, 0), (2, 4)), ChunkEntry(0, 64, 32, 22, (2, 0), (2, 4))),
    )
    scalar = ArrayEntry("int64", (), (ChunkEntry(1, 0, 8, 33, (), ()),))
    empty = ArrayEntry("float16", (0, 3), ())
    blob = ArrayEntry("uint8", (5,), (ChunkEntry(1, 64, 5, 44, (0,), (5,)),))
    tree = Node(
        "dict",
        keys=["w", "s", "e", "b", 7, "nested"],
        children=[
            Node("array", array=0, attrs={"kind": "numpy"}),
            Node("array", array=1, attrs={"kind": "torch", "scalar": True}),
            Node("array", array=2),
            Node("bytes", array=3),
            Node("none"),
            Node("list", children=[
                Node("bool", value=True),
                Node("int", value=-(2**80) + 5),
                Node("float", value=0.1),
                Node("str", value="héllo\u2603"),
                Node("tuple", children=[]),
                Node("namedtuple", keys=["a"], children=[Node("int", value=1)],
                     type_name="m.P"),
                Node("dataclass", keys=["f"], children=[Node("none")], type_name="m.D"),
                Node("pytree", keys=["0"], children=[Node("none")], type_name="m.T"),
                Node("stateful", type_name="m.S",
                     children=[Node("dict", keys=[], children=[])]),
            ]),
        ],
    )
    return Manifest(
        tree=tree,
        arrays=[w, scalar, empty, blob],
        files=[FileEntry("data/r0-0.bin", 96), FileEntry("data/r0-1.bin", 69)],
        meta={"library": "statestream test", "n": 1},
    )


def valid_doc() -> dict[str, Any]:
    return json.loads(encode_manifest(make_manifest()))


def decode_doc(doc: Any) -> Manifest:
    return decode_manifest(json.dumps(doc).encode(), WHERE)


def corrupt(mutate: Callable[[dict[str, Any]], Any], match: str,
            exc: type[Exception] = CheckpointCorruptError) -> CheckpointError:
    doc = valid_doc()
    mutate(doc)
    with pytest.raises(exc, match=match) as ei:
        decode_doc(doc)
    assert WHERE in str(ei.value) or exc is UnsafeCheckpointError
    return ei.value  # type: ignore[return-value]


# ----------------------------------------------------------------------------- round trip


def test_valid_doc_decodes() -> None:
    decode_doc(valid_doc())


def test_round_trip() -> None:
    m = make_manifest()
    data = encode_manifest(m)
    assert data.isascii()
    back = decode_manifest(data, WHERE)
    assert back == m
    assert encode_manifest(back) == data  # canonical


def test_encoding_is_compact_json() -> None:
    doc = valid_doc()
    assert doc["format"] == "statestream" and doc["version"] == 1 and doc["checksum"] == "crc32c"
    assert doc["files"] == [["data/r0-0.bin", 96], ["data/r0-1.bin", 69]]
    assert doc["arrays"][0]["chunks"][1] == [0, 64, 32, 22, [2, 0], [2, 4]]
    assert b" " not in encode_manifest(make_manifest()).replace(b"statestream test", b"")


def _leaf_doc(node: Node) -> dict[str, Any]:
    m = Manifest(tree=Node("list", children=[node]), arrays=[], files=[])
    return json.loads(encode_manifest(m))["tree"]["c"][0]  # type: ignore[no-any-return]


def _leaf_round_trip(node: Node) -> Node:
    m = Manifest(tree=Node("list", children=[node]), arrays=[], files=[])
    back = decode_manifest(encode_manifest(m), WHERE)
    assert back.tree.children is not None
    return back.tree.children[0]


@pytest.mark.parametrize("value", [0, 1, -1, 255, 2**63, -(2**63) - 1, 2**200, -(3**150)])
def test_int_values_are_hex(value: int) -> None:
    d = _leaf_doc(Node("int", value=value))
    assert d == {"t": "int", "v": format(value, "x")}
    back = _leaf_round_trip(Node("int", value=value))
    assert back.value == value and type(back.value) is int


@pytest.mark.parametrize(
    "value", [0.0, -0.0, 0.1, -1.5e300, 5e-324, float("inf"), float("-inf"), 1 / 3]
)
def test_float_values_are_hex_and_exact(value: float) -> None:
    d = _leaf_doc(Node("float", value=value))
    assert d == {"t": "float", "v": value.hex()}
    back = _leaf_round_trip(Node("float", value=value))
    assert back.value == value
    assert math.copysign(1.0, back.value) == math.copysign(1.0, value)


def test_float_nan_round_trips() -> None:
    back = _leaf_round_trip(Node("float", value=float("nan")))
    assert math.isnan(back.value)


def _bits(x: float) -> str:
    return struct.pack("<d", x).hex()


@pytest.mark.parametrize(("bits", "written", "read"), [
    ("000000000000f87f", "nan", "000000000000f87f"),
    ("000000000000f8ff", "-nan", "000000000000f8ff"),  # -nan: was written "nan"
    ("010000000000f8ff", "-nan", "000000000000f8ff"),  # its payload is not kept
    ("010000000000f07f", "nan", "000000000000f87f"),   # nor a signaling NaN's
])
def test_a_float_nan_keeps_its_sign_not_its_payload(bits: str, written: str,
                                                     read: str) -> None:
    """A plain float NaN is written "nan" or "-nan", which every reader's
    float.fromhex parses (readers from before 2026-12-06 too); a NaN's payload
    bits are not kept (arrays keep every bit: docs/format.md)."""
    value = struct.unpack("<d", bytes.fromhex(bits))[0]
    assert _leaf_doc(Node("float", value=value)) == {"t": "float", "v": written}
    assert _bits(float.fromhex(written)) == read  # what every reader's decoder does
    assert _bits(_leaf_round_trip(Node("float", value=value)).value) == read


def test_negative_zero_keeps_sign() -> None:
    back = _leaf_round_trip(Node("float", value=-0.0))
    assert str(back.value) == "-0.0"


def test_bool_and_int_stay_distinct() -> None:
    b = _leaf_round_trip(Node("bool", value=True))
    i = _leaf_round_trip(Node("int", value=1))
    assert b.kind == "bool" and b.value is True
    assert i.kind == "int" and type(i.value) is int and i.value == 1


# ----------------------------------------------------------------------------- header


def test_not_json() -> None:
    with pytest.raises(CheckpointCorruptError, match="not valid JSON"):
        decode_manifest(b"{not json", WHERE)
    with pytest.raises(CheckpointCorruptError, match="not valid JSON"):
        decode_manifest(b"\xff\xfe", WHERE)


def test_deeply_nested_json_is_corrupt_not_recursion_error() -> None:
    with pytest.raises(CheckpointCorruptError):
        decode_manifest(b"[" * 200_000 + b"]" * 200_000, WHERE)


def test_not_a_statestream_manifest() -> None:
    corrupt(lambda d: d.update(format="other"), "not a statestream manifest")
    with pytest.raises(CheckpointCorruptError, match="not a statestream manifest"):
        decode_manifest(b"[1, 2]", WHERE)


def test_newer_version_asks_to_upgrade() -> None:
    err = corrupt(lambda d: d.update(version=4), "format version 4.*upgrade statestream",
                  FormatVersionError)
    assert isinstance(err, ValueError)


def test_older_version_is_unsupported() -> None:
    corrupt(lambda d: d.update(version=0), "format version 0.*not supported", FormatVersionError)


@pytest.mark.parametrize("version", ["1", 1.0, True, None])
def test_version_must_be_an_integer(version: Any) -> None:
    corrupt(lambda d: d.update(version=version), "no integer format version")


def test_unknown_checksum_algorithm() -> None:
    corrupt(lambda d: d.update(checksum="md5"), "checksum 'md5'")


def test_meta_must_be_an_object() -> None:
    corrupt(lambda d: d.update(meta=[1]), "meta must be an object")


def test_manifest_size_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    data = encode_manifest(make_manifest())
    monkeypatch.setattr(decode_mod, "MAX_MANIFEST_BYTES", len(data) - 1)
    with pytest.raises(CheckpointCorruptError, match="over the .*-byte limit"):
        decode_manifest(data, WHERE)


# ----------------------------------------------------------------------------- files


@pytest.mark.parametrize(
    "name",
    [
        "data/../x.bin",
        "data/..",
        "data/a..b",
        "../data/x.bin",
        "/etc/passwd",
        "/data/x.bin",
        "data/sub/x.bin",
        "data/",
        "data",
        "",
        "x.bin",
        "data/.hidden",
        "data/-x",
        "data\\x.bin",
        "data/x\\..\\y",
        "data/x.bin\n",
        "data/x\x00.bin",
        "data/\u00e9.bin",
        "data/" + "a" * 201,
        "manifest.json",
        "COMMITTED",
    ],
)
def test_unsafe_file_names(name: str) -> None:
    err = corrupt(lambda d: d["files"][0].__setitem__(0, name), "not a plain file",
                  UnsafeCheckpointError)
    assert isinstance(err, CheckpointCorruptError)
    with pytest.raises(UnsafeCheckpointError, match="refusing to read it"):
        validate_file_name(name)


@pytest.mark.parametrize("name", [None, 3, ["data/x"]])
def test_non_string_file_names(name: Any) -> None:
    corrupt(lambda d: d["files"][0].__setitem__(0, name), "not a plain file",
            UnsafeCheckpointError)


@pytest.mark.parametrize("name", ["data/r0-0.bin", "data/_x", "data/A.b-c_d", "data/" + "a" * 200])
def test_plain_file_names_pass(name: str) -> None:
    assert validate_file_name(name) == name


def test_duplicate_file_names() -> None:
    corrupt(lambda d: d["files"][1].__setitem__(0, "data/r0-0.bin"), "listed twice")


@pytest.mark.parametrize("entry", [["data/x"], ["data/x", 1, 2], "data/x", {"n": 1}])
def test_malformed_file_entries(entry: Any) -> None:
    corrupt(lambda d: d["files"].__setitem__(1, entry), "file entry")


def test_files_must_be_a_list() -> None:
    corrupt(lambda d: d.update(files={"a": 1}), "files must be a list")


@pytest.mark.parametrize("size", [-1, 2**52 + 1, 2**70, 1.0, "96", True, None])
def test_file_size_limits(size: Any) -> None:
    corrupt(lambda d: d["files"][0].__setitem__(1, size), "file size must be an integer")


def test_largest_file_size_is_accepted() -> None:
    doc = valid_doc()
    doc["files"][0][1] = 2**52
    decode_doc(doc)


def test_file_count_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(decode_mod, "MAX_FILES", 1)
    corrupt(lambda d: None, r"2 data files \(limit 1\)")


def test_chunk_beyond_file_end() -> None:
    err = corrupt(lambda d: d["files"][0].__setitem__(1, 95),
                  r"array 0 chunk 1 spans bytes \[64, 96\) of data/r0-0.bin.*only 95 bytes")
    assert "malformed" in str(err)


def test_chunk_offset_beyond_file_end() -> None:
    corrupt(lambda d: d["arrays"][0]["chunks"][1].__setitem__(1, 1000), "spans bytes")


def test_chunk_file_index_out_of_range() -> None:
    corrupt(lambda d: d["arrays"][0]["chunks"][0].__setitem__(0, 2), "array 0 chunk 0.* file")
    corrupt(lambda d: d["arrays"][0]["chunks"][0].__setitem__(0, -1), "array 0 chunk 0.* file")


def test_chunk_with_empty_file_table() -> None:
    def mutate(d: dict[str, Any]) -> None:
        d["files"] = []

    corrupt(mutate, "array 0 chunk 0 .*file")


# ----------------------------------------------------------------------------- arrays


def test_nbytes_must_match_shape_times_itemsize() -> None:
    corrupt(lambda d: d["arrays"][0]["chunks"][0].__setitem__(2, 31),
            r"array 0 chunk 0 is 31 bytes but its shape \(2, 4\) x 4 bytes .* needs 32")


def test_chunk_outside_array() -> None:
    def mutate(d: dict[str, Any]) -> None:
        d["arrays"][0]["chunks"][1][4] = [3, 0]  # rows 3..5 of a 4-row array

    corrupt(mutate, r"array 0 chunk 1 lies outside the array's shape \(4, 4\)")


def test_chunk_with_wrong_ndim() -> None:
    corrupt(lambda d: d["arrays"][0]["chunks"][0].__setitem__(4, [0]),
            "array 0 chunk 0 .*dimensions")
    corrupt(lambda d: d["arrays"][0]["chunks"][0].__setitem__(5, [2, 4, 1]),
            "array 0 chunk 0 .*dimensions")


@pytest.mark.parametrize(
    "chunk", [[0, 0, 32, 11, [0, 0]], "chunk", [0, 0, 32, 11, [0, 0], [2, 4], 0]]
)
def test_malformed_chunk(chunk: Any) -> None:
    corrupt(lambda d: d["arrays"][0]["chunks"].__setitem__(0, chunk), "chunk 0")


@pytest.mark.parametrize(
    ("field", "value", "what"),
    [
        (0, True, "file"),
        (0, 0.0, "file"),
        (1, -1, "offset"),
        (1, 1.0, "offset"),
        (1, 2**52 + 1, "offset"),
        (2, "32", "length"),
        (2, -32, "length"),
        (3, 2**32, "checksum"),
        (3, -1, "checksum"),
        (3, False, "checksum"),
        (4, [0, -1], "start"),
        (4, [0, True], "start"),
        (5, [2, 4.0], "shape"),
        (5, [2, -4], "shape"),
        (5, "24", "shape"),
    ],
)
def test_chunk_field_types(field: int, value: Any, what: str) -> None:
    err = corrupt(lambda d: d["arrays"][0]["chunks"][0].__setitem__(field, value),
                  "array 0 chunk 0")
    assert what in str(err)


def test_overlapping_chunks() -> None:
    def mutate(d: dict[str, Any]) -> None:
        # chunk 1 now covers rows 1..2, overlapping chunk 0; a third chunk
        # makes up the element count so only the overlap is wrong
        d["arrays"][0]["chunks"][1] = [0, 32, 32, 0, [1, 0], [2, 4]]
        d["files"][0][1] = 200

    corrupt(mutate, "array 0 has overlapping chunks")
    doc = valid_doc()
    doc["arrays"][0]["shape"] = [4, 4]
    doc["arrays"][0]["chunks"] = [
        [0, 0, 32, 0, [0, 0], [2, 4]],
        [0, 32, 16, 0, [1, 0], [1, 4]],   # overlaps row 1
        [0, 64, 16, 0, [3, 0], [1, 4]],   # row 2 left uncovered: count still 16
    ]
    with pytest.raises(CheckpointCorruptError, match="array 0 has overlapping chunks"):
        decode_doc(doc)


def test_overlap_in_a_later_axis() -> None:
    doc = valid_doc()
    doc["arrays"][0]["chunks"] = [
        [0, 0, 16, 0, [0, 0], [2, 2]],
        [0, 16, 16, 0, [0, 1], [2, 2]],   # overlaps column 1 of the first box
        [0, 32, 32, 0, [2, 0], [2, 4]],
        [0, 64, 0, 0, [0, 3], [2, 0]],
    ]
    # the element count is right (4 + 4 + 8 = 16), so only the overlap is wrong
    with pytest.raises(CheckpointCorruptError, match="overlapping chunks"):
        decode_doc(doc)


def test_two_dimensional_tiling_is_accepted() -> None:
    doc = valid_doc()
    doc["arrays"][0]["chunks"] = [
        [0, 0, 16, 0, [0, 0], [2, 2]],
        [0, 16, 16, 0, [0, 2], [2, 2]],
        [0, 32, 16, 0, [2, 0], [2, 2]],
        [0, 48, 16, 0, [2, 2], [2, 2]],
        [0, 64, 0, 0, [4, 0], [0, 4]],    # empty chunks are ignored
    ]
    m = decode_doc(doc)
    assert len(m.arrays[0].chunks) == 5


def test_incomplete_coverage() -> None:
    corrupt(lambda d: d["arrays"][0]["chunks"].pop(), r"array 0's chunks cover 8 of its 16")


def test_scalar_with_two_chunks_is_rejected() -> None:
    def mutate(d: dict[str, Any]) -> None:
        d["arrays"][1]["chunks"].append([1, 0, 8, 0, [], []])

    corrupt(mutate, r"array 1's chunks cover 2 of its 1")


def test_ndim_limit() -> None:
    def mutate(d: dict[str, Any]) -> None:
        d["arrays"][2]["shape"] = [1] * (MAX_NDIM + 1)

    corrupt(mutate, rf"array 2 has {MAX_NDIM + 1} dimensions \(limit {MAX_NDIM}\)")
    doc = valid_doc()
    doc["arrays"][2]["shape"] = [0] + [1] * (MAX_NDIM - 1)
    decode_doc(doc)


def test_dimension_limit() -> None:
    def mutate(d: dict[str, Any]) -> None:
        d["arrays"][2]["shape"] = [0, MAX_DIM + 1]

    corrupt(mutate, "array 2 dimension")


def test_array_bytes_limit() -> None:
    def mutate(d: dict[str, Any]) -> None:
        d["arrays"][2]["shape"] = [MAX_DIM, 4]

    corrupt(mutate, rf"array 2 is {MAX_DIM * 4 * 2} bytes \(limit {MAX_ARRAY_BYTES}\)")


@pytest.mark.parametrize("dtype", ["float128", "object", ">f4", "", "Float32"])
def test_unknown_dtype(dtype: str) -> None:
    corrupt(lambda d: d["arrays"][0].__setitem__("dtype", dtype), "array 0 has unknown dtype")


def test_dtype_must_be_a_string() -> None:
    corrupt(lambda d: d["arrays"][0].__setitem__("dtype", 4), "array 0 dtype must be a string")


@pytest.mark.parametrize("shape", [[4.0, 4], [4, -4], ["4", 4], [True, 4]])
def test_bad_shapes(shape: Any) -> None:
    corrupt(lambda d: d["arrays"][0].__setitem__("shape", shape), "array 0 dimension")


def test_array_must_be_object() -> None:
    corrupt(lambda d: d["arrays"].__setitem__(0, [1]), "array 0 must be an object")


def test_arrays_must_be_a_list() -> None:
    corrupt(lambda d: d.update(arrays={}), "arrays must be a list")


# ----------------------------------------------------------------------------- tree


def _set_node(d: dict[str, Any], node: Any, i: int = 4) -> None:
    d["tree"]["c"][i] = node


def test_array_referenced_twice() -> None:
    corrupt(lambda d: _set_node(d, {"t": "array", "a": 0}), "array 0 is referenced twice")


@pytest.mark.parametrize("idx", [4, -1, True, "0", None, 1.0])
def test_array_index_out_of_range_or_wrong_type(idx: Any) -> None:
    corrupt(lambda d: d["tree"]["c"][0].__setitem__("a", idx), "array index")


def test_array_node_with_no_array_table() -> None:
    m = Manifest(tree=Node("array", array=0), arrays=[], files=[])
    with pytest.raises(CheckpointCorruptError, match="empty array table"):
        decode_manifest(encode_manifest(m), WHERE)


def test_array_attrs_must_be_object() -> None:
    corrupt(lambda d: d["tree"]["c"][0].__setitem__("x", [1]), "leaf attributes")


def test_blob_leaf_must_be_uint8_vector() -> None:
    corrupt(lambda d: d["tree"]["c"][0].__setitem__("t", "bytes"),
            "bytes leaf must be a 1-D uint8 blob")
    corrupt(lambda d: d["tree"]["c"][1].__setitem__("t", "pickle"),
            "pickle leaf must be a 1-D uint8 blob")


@pytest.mark.parametrize(
    ("node", "match"),
    [
        ([1], "tree node must be an object"),
        ("none", "tree node must be an object"),
        ({"t": "weird"}, "unknown tree node type 'weird'"),
        ({}, "unknown tree node type None"),
        ({"t": "bool", "v": 1}, "bool value must be true or false"),
        ({"t": "bool", "v": "true"}, "bool value must be true or false"),
        ({"t": "bool"}, "bool value must be true or false"),
        ({"t": "int", "v": 1}, "int value must be a string"),
        ({"t": "int", "v": True}, "int value must be a string"),
        ({"t": "int", "v": "0x10"}, "not lowercase hex"),
        ({"t": "int", "v": "FF"}, "not lowercase hex"),
        ({"t": "int", "v": "+1"}, "not lowercase hex"),
        ({"t": "int", "v": " 1"}, "not lowercase hex"),
        ({"t": "int", "v": ""}, "not lowercase hex"),
        ({"t": "int", "v": "1_0"}, "not lowercase hex"),
        ({"t": "float", "v": 1.5}, "float value must be a string"),
        ({"t": "float", "v": "one"}, "not a hex float"),
        ({"t": "float", "v": "0x1p99999"}, "not a hex float"),
        ({"t": "str", "v": 3}, "str value must be a string"),
        ({"t": "list", "c": {}}, "children must be a list"),
        ({"t": "list"}, "children must be a list"),
        ({"t": "dict", "c": []}, "keys must be a list"),
        ({"t": "dict", "k": ["a"], "c": []}, "keys and children differ in length"),
        ({"t": "dict", "k": [1.5], "c": [{"t": "none"}]}, "must be a string or integer"),
        ({"t": "dict", "k": [True], "c": [{"t": "none"}]}, "must be a string or integer"),
        ({"t": "dict", "k": [None], "c": [{"t": "none"}]}, "must be a string or integer"),
        ({"t": "namedtuple", "k": [0], "c": [{"t": "none"}]}, "field name 0 must be a string"),
        ({"t": "dataclass", "k": [0], "c": [{"t": "none"}]}, "field name 0 must be a string"),
        ({"t": "pytree", "k": [0], "c": [{"t": "none"}]}, "field name 0 must be a string"),
        # a repeated key: a load kept one child and dropped the other's array unnoticed
        ({"t": "dict", "k": ["a", "b", "a"], "c": [{"t": "none"}] * 3},
         "key 'a' appears twice in one dict"),
        ({"t": "dict", "k": [7, "7", 7], "c": [{"t": "none"}] * 3}, "key 7 appears twice"),
        ({"t": "namedtuple", "k": ["x", "x"], "c": [{"t": "none"}] * 2},
         "key 'x' appears twice in one namedtuple"),
        ({"t": "list", "c": [], "n": 5}, "type name must be a string"),
        ({"t": "stateful", "c": []}, "exactly one child"),
        ({"t": "stateful", "c": [{"t": "none"}, {"t": "none"}]}, "exactly one child"),
        ({"t": "stateful", "n": 1, "c": [{"t": "none"}]}, "type name must be a string"),
    ],
)
def test_bad_tree_nodes(node: Any, match: str) -> None:
    err = corrupt(lambda d: _set_node(d, node), match)
    assert "malformed" in str(err)


def test_dict_allows_int_keys_but_keeps_them_ints() -> None:
    m = decode_doc(valid_doc())
    assert m.tree.keys is not None and 7 in m.tree.keys and "7" not in m.tree.keys


def test_an_int_key_and_its_str_are_two_keys() -> None:
    node = {"t": "dict", "k": [1, "1"], "c": [{"t": "none"}, {"t": "none"}]}
    doc = valid_doc()
    _set_node(doc, node)
    decode_doc(doc)
    assert decode_tree(node, 0).keys == [1, "1"]
    with pytest.raises(CheckpointCorruptError, match="malformed tree: key 1 appears twice"):
        decode_tree(dict(node, k=[1, 1]), 0)


def test_int_hex_digit_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(decode_tree_mod, "MAX_INT_HEX_DIGITS", 24)
    corrupt(lambda d: _set_node(d, {"t": "int", "v": "1" * 25}), "not lowercase hex")
    doc = valid_doc()
    doc["tree"]["c"][4] = {"t": "int", "v": "-" + "f" * 23}
    decode_doc(doc)


def _deep(levels: int) -> dict[str, Any]:
    node: dict[str, Any] = {"t": "none"}
    for _ in range(levels):
        node = {"t": "list", "c": [node]}
    return node


def test_tree_depth_limit() -> None:
    doc = valid_doc()
    doc["tree"] = _deep(MAX_TREE_DEPTH)
    decode_doc(doc)
    doc["tree"] = _deep(MAX_TREE_DEPTH + 10)
    with pytest.raises(CheckpointCorruptError, match=f"nested deeper than {MAX_TREE_DEPTH}"):
        decode_doc(doc)


def test_missing_tree() -> None:
    corrupt(lambda d: d.pop("tree"), "tree node must be an object")


# ----------------------------------------------------------------------------- commit marker


def test_commit_round_trip() -> None:
    mbytes = encode_manifest(make_manifest())
    marker = encode_commit(mbytes)
    assert len(marker) <= MAX_COMMIT_BYTES
    doc = json.loads(marker)
    assert doc == {
        "format": "statestream",
        "version": 1,
        "manifest_bytes": len(mbytes),
        "manifest_crc32c": checksum(mbytes),
    }
    assert decode_commit(marker, "/c/COMMITTED") == (len(mbytes), checksum(mbytes))


def _commit(**over: Any) -> bytes:
    doc = json.loads(encode_commit(b"{}"))
    doc.update(over)
    return json.dumps({k: v for k, v in doc.items() if v is not ...}).encode()


@pytest.mark.parametrize(
    ("data", "exc", "match"),
    [
        (b"x" * (MAX_COMMIT_BYTES + 1), CheckpointCorruptError, "larger than 4096 bytes"),
        (b"", CheckpointCorruptError, "not valid JSON"),
        (b"{", CheckpointCorruptError, "not valid JSON"),
        (b"\xff", CheckpointCorruptError, "not valid JSON"),
        (b"[" * 4000, CheckpointCorruptError, "not valid JSON"),
        (b"[]", CheckpointCorruptError, "not a statestream commit marker"),
        (_commit(format="zarr"), CheckpointCorruptError, "not a statestream commit marker"),
        (_commit(version=4), FormatVersionError, "format version 4"),
        (_commit(manifest_bytes=...), CheckpointCorruptError, "manifest_bytes"),
        (_commit(manifest_bytes=-1), CheckpointCorruptError, "manifest_bytes"),
        (_commit(manifest_bytes=True), CheckpointCorruptError, "manifest_bytes"),
        (_commit(manifest_bytes=(1 << 30) + 1), CheckpointCorruptError, "manifest_bytes"),
        (_commit(manifest_crc32c=2**32), CheckpointCorruptError, "manifest_crc32c"),
        (_commit(manifest_crc32c="0"), CheckpointCorruptError, "manifest_crc32c"),
    ],
)
def test_bad_commit_markers(data: bytes, exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=match) as ei:
        decode_commit(data, "/c/COMMITTED")
    assert "/c/COMMITTED" in str(ei.value)


def test_decode_does_not_mutate_shared_state() -> None:
    doc = valid_doc()
    before = copy.deepcopy(doc)
    decode_doc(doc)
    assert doc == before


# ----------------------------------------------------------------------------- overlap sweep

import numpy as np  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@st.composite
def _tilings(draw: st.DrawFn) -> tuple[tuple[int, ...], np.ndarray, np.ndarray]:
    """An exact tiling of a small array by guillotine cuts, then maybe one box moved."""
    nd = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=nd, max_size=nd)))
    boxes = [((0,) * nd, shape)]
    for _ in range(draw(st.integers(0, 14))):
        i = draw(st.integers(0, len(boxes) - 1))
        s0, sh = boxes[i]
        ax = draw(st.integers(0, nd - 1))
        if sh[ax] < 2:
            continue
        cut = draw(st.integers(1, sh[ax] - 1))
        a_sh = sh[:ax] + (cut,) + sh[ax + 1:]
        b_s = s0[:ax] + (s0[ax] + cut,) + s0[ax + 1:]
        b_sh = sh[:ax] + (sh[ax] - cut,) + sh[ax + 1:]
        boxes[i:i + 1] = [(s0, a_sh), (b_s, b_sh)]
    starts = np.array([b[0] for b in boxes], dtype=np.int64).reshape(len(boxes), nd)
    ends = starts + np.array([b[1] for b in boxes], dtype=np.int64).reshape(len(boxes), nd)
    if draw(st.booleans()):  # move one box (same volume), staying inside the array
        i = draw(st.integers(0, len(boxes) - 1))
        ax = draw(st.integers(0, nd - 1))
        room = shape[ax] - ends[i, ax]
        delta = draw(st.integers(-int(starts[i, ax]), int(room)))
        starts[i, ax] += delta
        ends[i, ax] += delta
    return shape, starts, ends


@settings(max_examples=300, deadline=None)
@given(_tilings())
def test_tiling_check_matches_brute_force(t: tuple[tuple[int, ...], np.ndarray, np.ndarray]
                                          ) -> None:
    shape, starts, ends = t
    count = np.zeros(shape, dtype=np.int64)
    for s0, e0 in zip(starts, ends):
        count[tuple(slice(int(a), int(b)) for a, b in zip(s0, e0))] += 1
    assert tiles_mod._tiles_exactly(starts, ends, shape) == bool(np.all(count == 1))


def test_tiling_check_many_chunks() -> None:
    n = 5000  # row blocks, and a grid: both far past the pairwise fast path
    starts = np.stack([np.arange(n), np.zeros(n, np.int64)], axis=1)
    ends = starts + np.array([1, 3])
    assert tiles_mod._tiles_exactly(starts, ends, (n, 3))
    ends[n - 2, 0] += 1  # box n-2 now reaches into box n-1
    starts[n - 1, 1] = 0
    ends[n - 1, 1] = 2  # volumes still sum up: the overlap is what must be found
    assert not tiles_mod._tiles_exactly(starts, ends, (n, 3))
    g = np.array([(i, j) for i in range(70) for j in range(70)], dtype=np.int64)
    assert tiles_mod._tiles_exactly(g, g + 1, (70, 70))
    g2 = g.copy()
    g2[5] = g2[6]  # a duplicate box, and one cell left uncovered
    assert not tiles_mod._tiles_exactly(g2, g2 + 1, (70, 70))



# ----------------------------------------------------------------------------- aliases


def _with_alias(doc: dict[str, Any], index: Any) -> None:
    doc["tree"]["k"].append("tied")
    doc["tree"]["c"].append({"t": "alias", "a": index, "x": {"kind": "torch"}})


def test_alias_round_trips() -> None:
    doc = valid_doc()
    _with_alias(doc, 0)
    m = decode_doc(doc)
    assert m.tree.children is not None
    assert m.tree.children[-1] == Node("alias", array=0, attrs={"kind": "torch"})
    assert json.loads(encode_manifest(m)) == doc


@pytest.mark.parametrize("index, match", [
    (9, "alias's array index"), (-1, "alias's array index"), ("0", "alias's array index"),
    (3, "alias refers to array 3"),  # the bytes leaf's blob, not an array leaf
])
def test_bad_alias_is_corrupt(index: Any, match: str) -> None:
    corrupt(lambda d: _with_alias(d, index), match)


def test_alias_to_an_array_no_leaf_holds() -> None:
    def mutate(d: dict[str, Any]) -> None:
        d["tree"]["c"][2] = {"t": "none"}  # array 2 is no longer any array leaf's
        _with_alias(d, 2)

    corrupt(mutate, "alias refers to array 2")


# ----------------------------------------------------------------------------- one-chunk fast path


@pytest.mark.parametrize("field, value", [
    (4, [False]), (4, [0.0]), (4, [1]), (5, [True]), (5, [5.0]), (5, [4]), (4, [0, 0]),
    (1, True), (2, 5.0), (3, -1), (0, 2), (3, 1 << 32),
])
@pytest.mark.parametrize("path", ["small", "peek", "stream"])
def test_one_chunk_entries_get_every_check(field: int, value: Any, path: str,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The blob's entry (one chunk covering the array) takes the fast path (whole list
    or, in large manifests, entry by entry); a bool where an int belongs (True == 1),
    a float (5.0 == 5) or a chunk that does not cover the array must still be refused."""
    if path != "small":  # as if the manifest were large
        monkeypatch.setattr(decode_mod, "_SMALL_MANIFEST_BYTES", 0)
    if path == "stream":  # and every entry too long to peek at
        monkeypatch.setattr(decode_mod, "_PEEK_CHARS", 5)
    assert decode_doc(valid_doc()).arrays[3].shape == (5,)

    def mutate(d: dict[str, Any]) -> None:
        d["arrays"][3]["chunks"][0][field] = value
    corrupt(mutate, "array 3")


def test_one_chunk_attrs_keep_bool_and_int_apart() -> None:
    doc = valid_doc()
    leaves = doc["tree"]["c"]
    leaves[0]["x"] = {"kind": "numpy", "scalar": 1}
    leaves[1]["x"] = {"kind": "numpy", "scalar": True}
    m = decode_doc(doc)
    a0, a1 = m.tree.children[0].attrs, m.tree.children[1].attrs  # type: ignore[index]
    assert a0 is not None and a1 is not None
    assert type(a0["scalar"]) is int and type(a1["scalar"]) is bool


def test_shared_shapes_stay_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decoded shapes are shared through a table that never outgrows its limit, however
    many distinct shapes a process decodes (one manifest, or many)."""
    monkeypatch.setattr(arrays_mod, "_MAX_SHAPES", 50)
    monkeypatch.setattr(arrays_mod, "_SHAPES", {})
    n = 180
    arrays = [ArrayEntry("uint8", (i + 1,), (ChunkEntry(0, 256 * i, i + 1, 0, (0,), (i + 1,)),))
              for i in range(n)]
    m = Manifest(tree=Node("list", children=[Node("array", array=i) for i in range(n)]),
                 arrays=arrays, files=[FileEntry("data/r0-0.bin", 256 * n)])
    for _ in range(2):
        got = decode_manifest(encode_manifest(m), WHERE)
        assert [a.shape for a in got.arrays] == [(i + 1,) for i in range(n)]
        assert 0 < len(arrays_mod._SHAPES) <= 50
    # equal shapes still come back as one object within the table's reach
    other = ArrayEntry("uint8", (4,), (ChunkEntry(0, 1024, 4, 0, (0,), (4,)),))
    twice = Manifest(tree=Node("list", children=[Node("array", array=0), Node("array", array=1)]),
                     arrays=[arrays[3], other], files=[FileEntry("data/r0-0.bin", 2048)])
    a, b = decode_manifest(encode_manifest(twice), WHERE).arrays
    assert a.shape is b.shape
