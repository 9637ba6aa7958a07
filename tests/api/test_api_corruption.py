"""Damaged and hostile checkpoints: load raises the right error, verify and the CLI report it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import statestream as ss
from statestream.format import encode_commit

# chunks of 16 KiB: "bad/w" (64 KiB) has 4 equal chunks, "good" has 1
_IO = ss.IOOptions(max_chunk_bytes=16 << 10)


def _state():
    rng = np.random.default_rng(0)
    return {
        "good": np.arange(1000, dtype=np.float32),
        "bad": {"w": rng.standard_normal(8192)},  # 64 KiB float64
        "step": 3,
    }


@pytest.fixture
def ckpt(tmp_path):
    c = tmp_path / "ckpt"
    ss.save(c, _state(), io=_IO)
    assert ss.verify(c).ok
    return c


def _doc(c):
    return json.loads((c / "manifest.json").read_bytes())


def _write_doc(c, doc, update_marker=True):
    data = json.dumps(doc, separators=(",", ":")).encode()
    (c / "manifest.json").write_bytes(data)
    if update_marker:
        (c / "COMMITTED").write_bytes(encode_commit(data))


def _array_index(doc, keys):
    node = doc["tree"]
    for k in keys:
        node = node["c"][node["k"].index(k)]
    return node["a"]


def _chunk(c, keys, i=0):
    """(data file name, offset, nbytes) of chunk ``i`` of the array at ``keys``."""
    doc = _doc(c)
    a = doc["arrays"][_array_index(doc, keys)]
    f, off, nb = a["chunks"][i][:3]
    return doc["files"][f][0], off, nb


def _cli_verify(c):
    return subprocess.run([sys.executable, "-m", "statestream", "verify", str(c)],
                          capture_output=True, text=True, timeout=120)


def _assert_reported(c, exc_type, names, *, exact=False, cli=True):
    """load raises ``exc_type`` naming ``names``; verify and the CLI report them too."""
    with pytest.raises(exc_type) as ei:
        ss.load(c)
    if exact:
        assert type(ei.value) is exc_type, repr(ei.value)
    assert isinstance(ei.value, ss.CheckpointError)
    for n in names:
        assert n in str(ei.value), (n, str(ei.value))
    rep = ss.verify(c)
    assert not rep.ok
    text = "\n".join(rep.problems)
    for n in names:
        assert n in text, (n, text)
    if not cli:  # the CLI is a thin shell over verify; run it only on representative cases
        return ei.value
    r = _cli_verify(c)
    assert r.returncode != 0, r
    for n in names:
        assert n in r.stderr, (n, r.stderr)
    return ei.value


def _assert_refused(c, exc_type, names):
    """load and verify raise ``exc_type`` naming ``names``: not damage (a checkpoint this
    statestream cannot read), so ``statestream verify`` exits 2 with the error, not 1."""
    for call in (ss.load, ss.verify):
        with pytest.raises(exc_type) as ei:
            call(c)
        for n in names:
            assert n in str(ei.value), (n, str(ei.value))
    r = _cli_verify(c)
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "DAMAGED" not in r.stderr, r
    for n in names:
        assert n in r.stderr, (n, r.stderr)
    return ei.value


# ----------------------------------------------------------------------------- data damage


@pytest.mark.parametrize("chunk", [0, 3])
def test_flipped_byte(ckpt, chunk):
    name, off, nb = _chunk(ckpt, ["bad", "w"], chunk)
    with open(ckpt / name, "r+b") as f:
        f.seek(off + nb // 3)
        b = f.read(1)
        f.seek(off + nb // 3)
        f.write(bytes([b[0] ^ 0x10]))
    _assert_reported(ckpt, ss.ChecksumMismatchError, ["bad/w", name], cli=chunk == 0)
    # the undamaged part still loads on its own
    np.testing.assert_array_equal(ss.load(ckpt, items=["good"])["good"], _state()["good"])
    rep = ss.verify(ckpt)
    assert len(rep.problems) == 1 and "good" not in rep.problems[0]


def test_truncated_data_file(ckpt):
    name, off, nb = _chunk(ckpt, ["bad", "w"], 2)
    os.truncate(ckpt / name, off + nb // 2)
    err = _assert_reported(ckpt, ss.CheckpointCorruptError, ["bad/w", name])
    assert isinstance(err, (ss.TruncatedFileError, ss.ChecksumMismatchError))


def test_data_file_truncated_to_zero(ckpt):
    name, _, _ = _chunk(ckpt, ["bad", "w"])
    os.truncate(ckpt / name, 0)
    _assert_reported(ckpt, ss.TruncatedFileError, ["bad/w", name], cli=False)


def test_deleted_data_file(ckpt):
    name, _, _ = _chunk(ckpt, ["bad", "w"])
    os.unlink(ckpt / name)
    _assert_reported(ckpt, ss.TruncatedFileError, ["bad/w", name])


@pytest.mark.parametrize("cut", ["chunk 2", "zero", "deleted"])
def test_a_short_data_file_is_one_problem(ckpt, cut):
    """One problem for one short or missing file, naming what it lacks; requests of
    16 KiB make a read request per chunk. It was two or more: the size against the
    manifest, then each failed read of the chunks past its end."""
    name, off, nb = _chunk(ckpt, ["bad", "w"], 2)
    if cut == "deleted":
        os.unlink(ckpt / name)
    else:
        os.truncate(ckpt / name, off + nb // 2 if cut == "chunk 2" else 0)
    rep = ss.verify(ckpt, io=ss.IOOptions(max_request_bytes=16 << 10))
    assert len(rep.problems) == 1, rep.problems
    assert name in rep.problems[0] and "key path 'bad/w'" in rep.problems[0]
    assert ("key path 'good'" in rep.problems[0]) == (cut != "chunk 2"), rep.problems


def test_deleted_data_dir(ckpt):
    shutil.rmtree(ckpt / "data")
    _assert_reported(ckpt, ss.TruncatedFileError, ["bad/w"], cli=False)


def test_extra_bytes_appended_load_but_verify_reports_them(ckpt):
    name, _, _ = _chunk(ckpt, ["bad", "w"])
    with open(ckpt / name, "ab") as f:
        f.write(b"junk")
    rep = ss.verify(ckpt)
    assert not rep.ok and name in rep.problems[0] and "longer" in rep.problems[0]
    np.testing.assert_array_equal(ss.load(ckpt)["bad"]["w"], _state()["bad"]["w"])


# ----------------------------------------------------------------------------- hostile manifests


@pytest.mark.parametrize("bad_name", [
    "../../etc/passwd", "data/../../x", "/etc/passwd", "data/../manifest.json", "data/sub/x",
    "data/", "data/.hidden", "data/..", "other/x.bin", "data\\..\\x", "", "data/a\x00b",
])
def test_manifest_points_outside(ckpt, bad_name):
    doc = _doc(ckpt)
    doc["files"][0][0] = bad_name
    _write_doc(ckpt, doc)
    err = _assert_reported(ckpt, ss.UnsafeCheckpointError, [], cli=bad_name == "../../etc/passwd")
    assert repr(bad_name)[1:-1][:40] in str(err)
    with pytest.raises(ss.UnsafeCheckpointError):
        ss.metadata(ckpt)
    assert "data file" in ss.verify(ckpt).problems[0]


def test_manifest_edit_without_marker_update(ckpt):
    doc = _doc(ckpt)
    doc["files"][0][0] = "../../etc/passwd"
    _write_doc(ckpt, doc, update_marker=False)
    _assert_reported(ckpt, ss.CheckpointCorruptError, ["manifest.json"], exact=True)


def test_manifest_byte_flip_without_marker_update(ckpt):
    data = bytearray((ckpt / "manifest.json").read_bytes())
    i = data.index(b'"step"')
    data[i + 1] = ord("S")
    (ckpt / "manifest.json").write_bytes(bytes(data))
    _assert_reported(ckpt, ss.CheckpointCorruptError, ["manifest.json"], exact=True, cli=False)


def test_manifest_missing(ckpt):
    os.unlink(ckpt / "manifest.json")
    _assert_reported(ckpt, ss.CheckpointCorruptError, ["manifest.json"], cli=False)


@pytest.mark.parametrize("marker", [b"", b"not json", b"[]", b'{"format":"other"}',
                                    b'{"format":"statestream","version":1}',
                                    b'{"format":"statestream","version":1,"manifest_bytes":-1,'
                                    b'"manifest_crc32c":0}',
                                    b"x" * 5000])
def test_bad_commit_marker(ckpt, marker):
    (ckpt / "COMMITTED").write_bytes(marker)
    _assert_reported(ckpt, ss.CheckpointCorruptError, ["COMMITTED"], cli=marker == b"not json")


def test_future_version_in_marker(ckpt):
    m = json.loads((ckpt / "COMMITTED").read_bytes())
    m["version"] = 4
    (ckpt / "COMMITTED").write_bytes(json.dumps(m).encode())
    _assert_refused(ckpt, ss.FormatVersionError, ["COMMITTED"])


# ----------------------------------------------------------------------------- symlinks


def test_symlinked_data_file(ckpt, tmp_path):
    name, _, _ = _chunk(ckpt, ["bad", "w"])
    outside = tmp_path / "outside.bin"
    shutil.copyfile(ckpt / name, outside)  # identical bytes: only the link itself is wrong
    os.unlink(ckpt / name)
    os.symlink(outside, ckpt / name)
    _assert_reported(ckpt, ss.UnsafeCheckpointError, ["bad/w", name])


def test_symlinked_data_dir(ckpt, tmp_path):
    outside = tmp_path / "outside"
    shutil.copytree(ckpt / "data", outside)
    shutil.rmtree(ckpt / "data")
    os.symlink(outside, ckpt / "data")
    _assert_reported(ckpt, ss.UnsafeCheckpointError, ["bad/w"], cli=False)


def test_symlinked_manifest(ckpt, tmp_path):
    outside = tmp_path / "m.json"
    shutil.copyfile(ckpt / "manifest.json", outside)
    os.unlink(ckpt / "manifest.json")
    os.symlink(outside, ckpt / "manifest.json")
    _assert_reported(ckpt, ss.UnsafeCheckpointError, ["manifest.json"], cli=False)


def test_planted_symlink_to_secret_not_followed(ckpt, tmp_path):
    """A hostile manifest naming a planted link to a file outside: refused, never read."""
    secret = tmp_path / "secret"
    secret.write_bytes(b"s" * 100)
    os.symlink(secret, ckpt / "data" / "leak.bin")
    doc = _doc(ckpt)
    doc["files"].append(["data/leak.bin", 100])
    doc["arrays"].append({"dtype": "uint8", "shape": [100],
                          "chunks": [[len(doc["files"]) - 1, 0, 100, 0, [0], [100]]]})
    doc["tree"]["k"].append("leak")
    doc["tree"]["c"].append({"t": "bytes", "a": len(doc["arrays"]) - 1})
    _write_doc(ckpt, doc)
    with pytest.raises(ss.UnsafeCheckpointError) as ei:
        ss.load(ckpt)
    assert "leak" in str(ei.value)
    rep = ss.verify(ckpt)
    assert not rep.ok and any("leak.bin" in p for p in rep.problems)
    # items that do not touch the link load fine
    assert ss.load(ckpt, items=["step"]) == {"step": 3}


# ----------------------------------------------------------------------------- manifest limits


def _bad_w(doc):
    return doc["arrays"][_array_index(doc, ["bad", "w"])]


def _edit_offset_beyond(doc):
    a = _bad_w(doc)
    f = a["chunks"][0][0]
    a["chunks"][0][1] = doc["files"][f][1] - a["chunks"][0][2] + 1


def _edit_length(doc):
    _bad_w(doc)["chunks"][0][2] += 8


def _edit_negative_dim(doc):
    _bad_w(doc)["shape"] = [-8192]


def _edit_overlap(doc):
    a = _bad_w(doc)
    a["chunks"][1][4] = list(a["chunks"][0][4])


def _edit_not_covering(doc):
    _bad_w(doc)["chunks"].pop()


def _edit_unknown_dtype(doc):
    _bad_w(doc)["dtype"] = "float128"


def _edit_object_dtype(doc):
    _bad_w(doc)["dtype"] = "object"


def _edit_too_many_dims(doc):
    a = _bad_w(doc)
    a["shape"] = [8192] + [1] * 40
    for ch in a["chunks"]:
        ch[4] = ch[4] + [0] * 40
        ch[5] = ch[5] + [1] * 40


def _edit_huge_dim(doc):
    a = _bad_w(doc)
    a["shape"] = [1 << 60]


def _edit_huge_array(doc):
    a = _bad_w(doc)
    a["shape"] = [1 << 47, 1 << 4]


def _edit_file_index(doc):
    _bad_w(doc)["chunks"][0][0] = 7


def _edit_chunk_outside_shape(doc):
    _bad_w(doc)["chunks"][3][4] = [8000]


def _edit_chunk_wrong_ndim(doc):
    _bad_w(doc)["chunks"][0][4] = [0, 0]


def _edit_checksum_range(doc):
    _bad_w(doc)["chunks"][0][3] = 1 << 40


def _edit_float_offset(doc):
    _bad_w(doc)["chunks"][0][1] = 0.5


def _edit_bool_dim(doc):
    _bad_w(doc)["shape"] = [True]


def _edit_duplicate_file(doc):
    doc["files"].append(list(doc["files"][0]))


def _edit_array_twice(doc):
    doc["tree"]["c"][0]["a"] = _array_index(doc, ["bad", "w"])


def _edit_array_index_range(doc):
    doc["tree"]["c"][0]["a"] = 99


def _edit_unknown_node(doc):
    doc["tree"]["c"][0]["t"] = "exec"


def _edit_int_not_hex(doc):
    doc["tree"]["c"][doc["tree"]["k"].index("step")]["v"] = "0x3"


def _edit_keys_children_mismatch(doc):
    doc["tree"]["k"].append("extra")


def _edit_bytes_leaf_float(doc):
    doc["tree"]["c"][0]["t"] = "bytes"  # "good" is float32, not a uint8 blob


def _edit_checksum_algo(doc):
    doc["checksum"] = "md5"


def _edit_not_statestream(doc):
    doc["format"] = "other"


def _edit_no_version(doc):
    doc["version"] = "1"


def _edit_deep_tree(doc):
    node = {"t": "none"}
    for _ in range(300):  # deeper than MAX_TREE_DEPTH
        node = {"t": "list", "c": [node]}
    doc["tree"]["c"][0] = node


def test_manifest_nested_beyond_json_recursion(ckpt):
    doc = _doc(ckpt)
    doc["tree"]["c"][0] = "PLACEHOLDER"
    n = 200_000
    text = json.dumps(doc, separators=(",", ":")).replace(
        '"PLACEHOLDER"', '{"t":"list","c":[' * n + '{"t":"none"}' + "]}" * n)
    data = text.encode()
    (ckpt / "manifest.json").write_bytes(data)
    (ckpt / "COMMITTED").write_bytes(encode_commit(data))
    with pytest.raises(ss.CheckpointCorruptError) as ei:
        ss.load(ckpt)
    assert type(ei.value) is ss.CheckpointCorruptError
    assert not ss.verify(ckpt).ok


def _edit_meta_type(doc):
    doc["meta"] = [1]


_LIMIT_EDITS = [
    _edit_offset_beyond, _edit_length, _edit_negative_dim, _edit_overlap, _edit_not_covering,
    _edit_unknown_dtype, _edit_object_dtype, _edit_too_many_dims, _edit_huge_dim,
    _edit_huge_array, _edit_file_index, _edit_chunk_outside_shape, _edit_chunk_wrong_ndim,
    _edit_checksum_range, _edit_float_offset, _edit_bool_dim, _edit_duplicate_file,
    _edit_array_twice, _edit_array_index_range, _edit_unknown_node, _edit_int_not_hex,
    _edit_keys_children_mismatch, _edit_bytes_leaf_float, _edit_checksum_algo,
    _edit_not_statestream, _edit_no_version, _edit_deep_tree, _edit_meta_type,
]


@pytest.mark.parametrize("edit", _LIMIT_EDITS, ids=lambda f: f.__name__[len("_edit_"):])
def test_manifest_limits(ckpt, edit):
    doc = _doc(ckpt)
    edit(doc)
    _write_doc(ckpt, doc)
    # no data at all: the manifest alone must be rejected, before any data read
    shutil.rmtree(ckpt / "data")
    os.mkdir(ckpt / "data")
    with pytest.raises(ss.CheckpointCorruptError) as ei:
        ss.load(ckpt)
    assert type(ei.value) is ss.CheckpointCorruptError, repr(ei.value)
    assert "manifest" in str(ei.value)
    with pytest.raises(ss.CheckpointCorruptError):
        ss.metadata(ckpt)
    rep = ss.verify(ckpt)
    assert not rep.ok and "manifest" in rep.problems[0]


def test_manifest_limits_cli(ckpt):
    doc = _doc(ckpt)
    _edit_overlap(doc)
    _write_doc(ckpt, doc)
    r = _cli_verify(ckpt)
    assert r.returncode != 0
    assert "overlapping" in r.stderr and "manifest.json" in r.stderr


def test_future_version_in_manifest(ckpt):
    doc = _doc(ckpt)
    doc["version"] = 4
    _write_doc(ckpt, doc, update_marker=False)
    data = (ckpt / "manifest.json").read_bytes()
    (ckpt / "COMMITTED").write_bytes(encode_commit(data, version=1))  # only the manifest says 4
    shutil.rmtree(ckpt / "data")
    err = _assert_refused(ckpt, ss.FormatVersionError, ["manifest.json"])
    assert "version 4" in str(err)


def test_manifest_not_json(ckpt):
    data = b"{not json"
    (ckpt / "manifest.json").write_bytes(data)
    (ckpt / "COMMITTED").write_bytes(encode_commit(data))
    _assert_reported(ckpt, ss.CheckpointCorruptError, ["manifest.json"], exact=True, cli=False)


def test_undamaged_checkpoint_cli_ok(ckpt):
    r = _cli_verify(ckpt)
    assert r.returncode == 0, r.stderr
    assert "OK" in r.stdout
