"""NumPy arrays over exactly the same memory (one array under several keys, or a view
of all of it) are stored once, as alias leaves, and load as one array, as tied torch
tensors do (tests/api/test_tied_and_items.py)."""

from __future__ import annotations

import dataclasses
import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import statestream as ss
from statestream.cli import main
from statestream.format import MANIFEST_NAME, decode_manifest
from statestream.providers import NumpyProvider
from statestream.tree import KeyPath, Node, format_keypath

P = NumpyProvider()


def _manifest(path: Path) -> Any:
    return decode_manifest((path / MANIFEST_NAME).read_bytes(), str(path))


def _leaves(node: Node, p: KeyPath = ()) -> dict[str, tuple[str, int | None]]:
    """key path -> (node kind, array index) of every leaf holding an array."""
    if node.array is not None:
        return {format_keypath(p): (node.kind, node.array)}
    kids = node.children or []
    keys = node.keys if node.keys is not None else range(len(kids))
    out: dict[str, tuple[str, int | None]] = {}
    for k, c in zip(keys, kids):
        out.update(_leaves(c, p if node.kind == "stateful" else p + (k,)))
    return out


def _stored(path: Path) -> tuple[int, dict[str, str]]:
    """(number of arrays in the manifest, key path -> leaf kind)."""
    m = _manifest(path)
    return len(m.arrays), {k: kind for k, (kind, _) in _leaves(m.tree).items()}


def _data_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in (path / "data").iterdir())


# ----------------------------------------------------------------------------- saving


@pytest.mark.parametrize("chunk", [None, 64], ids=["one-chunk", "multi-chunk"])
def test_one_array_under_three_keys_is_stored_once(tmp_path: Path, chunk: int | None) -> None:
    x = np.arange(48, dtype=np.float32).reshape(12, 4)
    io = ss.IOOptions(max_chunk_bytes=chunk) if chunk else None
    ss.save(tmp_path / "c", {"a": x, "b": x, "c": [x], "y": np.ones(3)}, io=io)
    n, kinds = _stored(tmp_path / "c")
    assert n == 2 and kinds == {"a": "array", "b": "alias", "c/0": "alias", "y": "array"}
    leaves = _leaves(_manifest(tmp_path / "c").tree)
    assert leaves["b"][1] == leaves["c/0"][1] == leaves["a"][1]
    assert _data_bytes(tmp_path / "c") == x.nbytes + 3 * 8  # one copy of x
    md = ss.metadata(tmp_path / "c")
    assert md.num_arrays == 2 and md.total_bytes == x.nbytes + 24
    assert md.tree["b"] == md.tree["a"] and md.tree["a"].kind == "numpy"
    if chunk:
        assert md.tree["a"].num_chunks == 3
    assert ss.verify(tmp_path / "c").ok

    out = ss.load(tmp_path / "c")
    np.testing.assert_array_equal(out["a"], x)
    assert out["b"] is out["a"] and out["c"][0] is out["a"]  # loaded tied
    out["a"][0, 0] = 42.0
    assert out["b"][0, 0] == 42.0
    # None in the target: the saved kind, still one array
    out = ss.load(tmp_path / "c", {"a": None, "b": None})
    assert out["b"] is out["a"] and np.array_equal(out["a"], x)
    # an alias alone (its array's own leaf not loaded)
    np.testing.assert_array_equal(ss.load(tmp_path / "c", items=["b"])["b"], x)
    np.testing.assert_array_equal(ss.load(tmp_path / "c", {"c": [None]})["c"][0], x)


def test_only_exactly_the_same_memory_and_layout_ties(tmp_path: Path) -> None:
    base = np.arange(24, dtype=np.float64).reshape(4, 6)
    sq = np.arange(16, dtype=np.float64).reshape(4, 4)
    ro = base.view()
    ro.flags.writeable = False
    state = {
        "base": base,
        "same": base[:],            # another object, exactly base's memory: tied
        "view": base.view(),        # likewise
        "readonly": ro,             # likewise (read-only views are the same memory)
        "rows": base[1:],           # a slice at another offset
        "head": base[:2],           # the same start, another shape
        "flat": base.reshape(24),   # the same memory, another shape
        "cols": base[:, :3],        # the same start, another shape and layout
        "t": base.T,                # the same memory, other strides
        "i64": base.view(np.int64),  # the same memory and layout, another dtype
        "be": base.view(">f8"),     # ... another byte order
        "mid": base[1:3],
        "mid_again": base[1:3],     # two views of the same sub-block: tied
        "sq": sq,
        "sq_t": sq.T,               # the same memory, shape and dtype, other strides
    }
    ss.save(tmp_path / "c", state)
    n, kinds = _stored(tmp_path / "c")
    tied = {"same", "view", "readonly", "mid_again"}
    assert kinds == {k: "alias" if k in tied else "array" for k in state}
    assert n == len(state) - len(tied) == 11
    out = ss.load(tmp_path / "c")
    for k, v in state.items():
        np.testing.assert_array_equal(out[k], v, err_msg=k)
    assert out["same"] is out["base"] and out["view"] is out["base"]
    assert out["readonly"] is out["base"] and out["mid_again"] is out["mid"]
    assert out["rows"] is not out["base"] and out["head"] is not out["base"]
    assert not np.shares_memory(out["rows"], out["base"])  # untied arrays load apart


def test_a_slice_and_its_base_are_two_arrays(tmp_path: Path) -> None:
    w = np.arange(10, dtype=np.int32)
    ss.save(tmp_path / "c", {"w": w, "tail": w[5:], "all": w[:]})
    assert _stored(tmp_path / "c") == (2, {"w": "array", "tail": "array", "all": "alias"})
    out = ss.load(tmp_path / "c")
    np.testing.assert_array_equal(out["tail"], w[5:])
    assert out["all"] is out["w"]


def test_non_contiguous_and_big_endian_arrays_tie(tmp_path: Path) -> None:
    t = np.arange(12, dtype=np.int16).reshape(3, 4).T
    be = np.arange(5, dtype=">i4")
    ss.save(tmp_path / "c", {"t": t, "t2": t, "be": be, "be2": be})
    assert _stored(tmp_path / "c") == (2, {"t": "array", "t2": "alias", "be": "array",
                                           "be2": "alias"})
    out = ss.load(tmp_path / "c")
    assert out["t2"] is out["t"] and np.array_equal(out["t"], t)
    assert out["be2"] is out["be"] and np.array_equal(out["be"], be)


def test_0d_arrays_tie_numpy_scalars_and_empty_arrays_do_not(tmp_path: Path) -> None:
    z = np.array(2.5)
    s = np.float32(1.5)
    e = np.zeros((0, 3), np.float32)
    ss.save(tmp_path / "c", {"z": z, "z2": z, "s": s, "s2": s, "e": e, "e2": e})
    n, kinds = _stored(tmp_path / "c")
    assert n == 5 and kinds["z2"] == "alias"
    assert [kinds[k] for k in ("s", "s2", "e", "e2")] == ["array"] * 4
    out = ss.load(tmp_path / "c")
    assert out["z2"] is out["z"] and out["z"].shape == () and out["z"] == 2.5
    # a NumPy scalar is an immutable value: each key loads its own scalar again
    assert type(out["s"]) is np.float32 and type(out["s2"]) is np.float32
    assert out["s"] == out["s2"] == 1.5
    assert out["e"].shape == out["e2"].shape == (0, 3)


def test_broadcast_views_tie_without_a_warning(tmp_path: Path) -> None:
    """Asking a view of np.broadcast_arrays whether it is writable warns: never asked."""
    x, y = np.broadcast_arrays(np.arange(4.0), np.zeros((1, 4)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ss.save(tmp_path / "c", {"x": x, "x2": x, "y": y})
    assert _stored(tmp_path / "c") == (2, {"x": "array", "x2": "alias", "y": "array"})
    out = ss.load(tmp_path / "c")
    assert out["x2"] is out["x"] and np.array_equal(out["x"], x)


class _Sub(np.ndarray):
    pass


def test_ndarray_subclasses_are_not_tied(tmp_path: Path) -> None:
    x = np.arange(4.0).view(_Sub)
    ss.save(tmp_path / "c", {"a": x, "b": x})
    assert _stored(tmp_path / "c") == (2, {"a": "array", "b": "array"})
    out = ss.load(tmp_path / "c")
    assert np.array_equal(out["a"], x) and np.array_equal(out["b"], x)


@pytest.mark.parametrize("bad", [
    np.array([1, "x", None], dtype=object),
    np.zeros(2, dtype=[("a", "f4"), ("b", "i4")]),
    np.array(["ab", "c"]),
    np.zeros(3, dtype=np.longdouble) if np.dtype(np.longdouble).itemsize > 8 else
    np.array(["x"], dtype="S1"),
], ids=["object", "structured", "unicode", "unstorable"])
def test_refused_arrays_raise_as_before(tmp_path: Path, bad: np.ndarray) -> None:
    with pytest.raises(ss.UnsupportedTypeError) as direct:
        P.prepare(bad, ("a",))
    with pytest.raises(ss.UnsupportedTypeError) as saved:
        ss.save(tmp_path / "c", {"a": bad, "b": bad})
    assert str(saved.value) == str(direct.value) and "'a'" in str(saved.value)
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("make", [
    lambda: np.arange(24.0).reshape(4, 6),                      # dense
    lambda: np.arange(24.0).reshape(4, 6)[1:3],                 # a view at an offset
    lambda: np.arange(24.0).reshape(4, 6).T,                    # not contiguous
    lambda: np.frombuffer(b"abcdefgh", np.uint8),               # read-only
    lambda: np.arange(6, dtype=">i4"),                          # big-endian
    lambda: np.array(3.5),                                      # 0-d
    lambda: np.zeros((0, 3)),                                   # empty
    lambda: np.int16(7),                                        # a NumPy scalar
    lambda: np.arange(6, dtype=np.int16)[::2],                  # strided
    lambda: np.arange(4.0).view(_Sub),                          # a subclass
], ids=["dense", "view", "transposed", "readonly", "big-endian", "0-d", "empty", "scalar",
        "strided", "subclass"])
def test_alias_and_prepare_matches_alias_key_and_prepare(make: Callable[[], Any]) -> None:
    x = make()
    key, prepared = P.alias_and_prepare(x, ("w",))
    want = P.prepare(x, ("w",))
    assert key == P.alias_key(x)
    if key is not None:
        assert key == (x.__array_interface__["data"][0], x.shape, x.strides, x.dtype)
    assert (dataclasses.replace(prepared, chunk=None, copy_into=None)
            == dataclasses.replace(want, chunk=None, copy_into=None))
    assert (prepared.copy_into is None) == (want.copy_into is None) == (not want.copies)
    if x.size:
        whole = (0,) * x.ndim
        assert bytes(prepared.chunk(whole, want.shape)) == bytes(want.chunk(whole, want.shape))
        if want.copy_into is not None:  # the same bytes, written into a buffer
            out = np.empty(want.nbytes, dtype=np.uint8)
            want.copy_into(whole, want.shape, out)
            assert bytes(out) == bytes(want.chunk(whole, want.shape))
        if x.ndim and x.shape[0] > 1:  # a row block
            rows = (1,) + want.shape[1:]
            assert bytes(prepared.chunk(whole, rows)) == bytes(want.chunk(whole, rows))


def test_a_tie_in_a_format_v3_manifest(tmp_path: Path) -> None:
    """1,100 arrays: the array table and compact leaves, with an alias among them."""
    many: dict[str, np.ndarray] = {f"l{i:04d}": np.full(2, i, np.int32) for i in range(1100)}
    many["tied"] = many["l0007"]
    ss.save(tmp_path / "c", {"many": many})
    assert json.loads((tmp_path / "c" / MANIFEST_NAME).read_text())["version"] == 3
    n, kinds = _stored(tmp_path / "c")
    assert n == 1100 and kinds["many/tied"] == "alias"
    out = ss.load(tmp_path / "c")["many"]
    assert out["tied"] is out["l0007"] and out["tied"].tolist() == [7, 7]


def test_a_tied_array_is_compressed_as_its_first_key_path_says(tmp_path: Path) -> None:
    z = np.zeros((64, 64), np.float32)
    ss.save(tmp_path / "c", {"a": z, "b": z}, compression={"b": "zstd"})
    md = ss.metadata(tmp_path / "c")
    assert md.num_arrays == 1 and md.tree["a"].codec is None and md.tree["b"].codec is None
    ss.save(tmp_path / "d", {"a": z, "b": z}, compression={"a": "zstd"})
    md = ss.metadata(tmp_path / "d")
    assert md.tree["a"].codec == md.tree["b"].codec == "zstd"
    out = ss.load(tmp_path / "d")
    assert out["b"] is out["a"] and not out["a"].any()


# ----------------------------------------------------------------------------- loading


def _tied(tmp_path: Path) -> tuple[Path, np.ndarray]:
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    ss.save(tmp_path / "c", {"a": x, "b": x})
    assert _stored(tmp_path / "c")[0] == 1
    return tmp_path / "c", x


@pytest.mark.parametrize("in_place", [False, True])
def test_two_separate_numpy_targets_each_get_the_array(tmp_path: Path, in_place: bool) -> None:
    path, x = _tied(tmp_path)
    t1, t2 = np.zeros((3, 4), np.float32), np.zeros((3, 4), np.float32)
    got = ss.load(path, {"a": t1, "b": t2}, in_place=in_place)
    assert np.array_equal(got["a"], x) and np.array_equal(got["b"], x)
    assert (got["a"] is t1) == in_place and (got["b"] is t2) == in_place
    assert np.array_equal(t1, x) == in_place and np.array_equal(t2, x) == in_place
    assert not np.shares_memory(got["a"], got["b"])
    # targets of other dtypes: each cast on its own
    got = ss.load(path, {"a": np.zeros((3, 4), np.float64), "b": np.zeros((3, 4), np.int64)},
                  in_place=in_place)
    assert got["a"].dtype == np.float64 and got["b"].dtype == np.int64
    assert np.array_equal(got["a"], x) and np.array_equal(got["b"], x)


def test_one_numpy_target_under_both_keys_is_filled_once(tmp_path: Path) -> None:
    path, x = _tied(tmp_path)
    like = np.zeros((3, 4), np.float32)
    got = ss.load(path, {"a": like, "b": like}, in_place=True)
    assert got["a"] is like and got["b"] is like and np.array_equal(like, x)
    got = ss.load(path, {"a": like, "b": like})  # a fresh array, still one for both keys
    assert got["a"] is got["b"] and got["a"] is not like


def test_the_one_stored_copy_is_checksummed(tmp_path: Path) -> None:
    path, _ = _tied(tmp_path)
    assert ss.verify(path).ok
    (f,) = (path / "data").iterdir()
    raw = bytearray(f.read_bytes())
    assert len(raw) == 48
    raw[5] ^= 0xFF
    f.write_bytes(bytes(raw))
    assert not ss.verify(path).ok
    for kw in ({}, {"items": ["b"]}, {"target": {"b": np.zeros((3, 4), np.float32)}}):
        with pytest.raises(ss.CheckpointCorruptError):
            ss.load(path, **kw)


# ----------------------------------------------------------------------------- other saves


@pytest.mark.parametrize("lazy", [False, True])
def test_async_and_lazy_saves_store_a_tie_once(tmp_path: Path, lazy: bool) -> None:
    x = np.arange(1000, dtype=np.float64)
    state = {"p": {"w": x, "w2": x}, "opt": {"m": x}}
    h = ss.save_async(tmp_path / "c", state, lazy=lazy)
    h.wait_snapshot()
    x[:] = -1.0  # after the snapshot: not in the checkpoint
    h.result()
    assert _stored(tmp_path / "c") == (1, {"p/w": "array", "p/w2": "alias", "opt/m": "alias"})
    out = ss.load(tmp_path / "c")
    assert out["p"]["w2"] is out["p"]["w"] and out["opt"]["m"] is out["p"]["w"]
    np.testing.assert_array_equal(out["p"]["w"], np.arange(1000, dtype=np.float64))


def test_an_incremental_save_keeps_the_tie(tmp_path: Path) -> None:
    x = np.arange(4096, dtype=np.float32)
    ss.save(tmp_path / "s1", {"a": x, "b": x, "step": 1}, hashes=True)
    ss.save(tmp_path / "s2", {"a": x, "b": x, "step": 2}, base=tmp_path / "s1")
    md = ss.metadata(tmp_path / "s2")
    assert md.num_arrays == 1 and md.referenced_bytes == x.nbytes  # nothing rewritten
    assert _stored(tmp_path / "s2")[1] == {"a": "array", "b": "alias"}
    out = ss.load(tmp_path / "s2")
    assert out["b"] is out["a"] and np.array_equal(out["a"], x) and out["step"] == 2


def test_inspect_lists_both_keys_and_counts_one_array(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    path, x = _tied(tmp_path)
    assert main(["inspect", "--json", str(path)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["num_arrays"] == 1 and doc["total_bytes"] == x.nbytes
    leaves = {leaf["key"]: leaf for leaf in doc["leaves"]}
    assert sorted(leaves) == ["a", "b"]
    assert leaves["a"] == {**leaves["b"], "key": "a"} and leaves["a"]["kind"] == "numpy"


# ----------------------------------------------------------------------------- convert


@pytest.fixture
def tied_src(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    emb = np.arange(40, dtype=np.float32).reshape(10, 4)
    sd = {"emb.weight": emb, "x": np.arange(3.0, dtype=np.float32), "head.weight": emb}
    ss.save(tmp_path / "src", {"model": sd, "step": 1})
    assert ss.metadata(tmp_path / "src").num_arrays == 2
    return tmp_path / "src", sd


def _same(got: Any, sd: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(sd)
    for k, v in sd.items():
        np.testing.assert_array_equal(np.asarray(got[k]), v, err_msg=k)


def test_convert_to_statestream_keeps_the_alias(tmp_path: Path, tied_src: Any) -> None:
    src, sd = tied_src
    out = ss.convert(src, tmp_path / "out", items=["model"])
    assert ss.metadata(out).num_arrays == 2
    got = ss.load(out)
    _same(got, sd)
    assert got["head.weight"] is got["emb.weight"]


def test_convert_to_safetensors_writes_the_array_once(tmp_path: Path, tied_src: Any) -> None:
    safetensors = pytest.importorskip("safetensors")
    src, sd = tied_src
    out = ss.convert(src, tmp_path / "o.safetensors", items=["model"])
    with safetensors.safe_open(out, "np") as f:
        assert sorted(f.keys()) == ["emb.weight", "x"]
    got = ss.load(out)
    _same(got, sd)
    assert got["head.weight"] is got["emb.weight"]


def test_convert_to_torch_writes_one_storage(tmp_path: Path, tied_src: Any) -> None:
    torch = pytest.importorskip("torch")
    src, sd = tied_src
    out = ss.convert(src, tmp_path / "o.pt", items=["model"])
    got = torch.load(out, weights_only=True)
    _same({k: v.numpy() for k, v in got.items()}, sd)
    assert got["head.weight"] is got["emb.weight"]
