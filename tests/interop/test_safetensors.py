"""safetensors files and Hugging Face shards: read by content, written by convert, bit-exact."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest

import statestream as ss
from statestream.interop import detect_format

torch = pytest.importorskip("torch")
st_torch = pytest.importorskip("safetensors.torch")

#: every dtype safetensors holds that torch can make (and statestream reads)
TORCH_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                torch.uint16, torch.uint32, torch.uint64, torch.float16, torch.bfloat16,
                torch.float32, torch.float64, torch.complex64, torch.float8_e4m3fn,
                torch.float8_e5m2]


def _tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (int(np.prod(shape)) * dtype.itemsize,), generator=g,
                        dtype=torch.uint8)
    if dtype == torch.bool:
        return (raw[: int(np.prod(shape))] & 1).bool().reshape(shape)
    return raw.view(dtype).reshape(shape)


def _bits(x: object) -> bytes:
    if isinstance(x, torch.Tensor):
        return x.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return np.ascontiguousarray(x).reshape(-1).view(np.uint8).tobytes()


@pytest.fixture()
def tensors() -> dict[str, torch.Tensor]:
    out = {f"layer.{i}.{str(dt).split('.')[1]}": _tensor(dt, (3, 5), i)
           for i, dt in enumerate(TORCH_DTYPES)}
    out["scalar"] = torch.tensor(2.5)
    out["empty"] = torch.zeros((0, 4))
    return out


def test_load_every_dtype_bit_exact(tmp_path: Path, tensors: dict[str, torch.Tensor]) -> None:
    f = tmp_path / "m.safetensors"
    st_torch.save_file(tensors, f, metadata={"format": "pt", "note": "hi"})
    assert detect_format(f) == "safetensors"
    out = ss.load(f)
    assert set(out) == set(tensors)
    for k, t in tensors.items():
        assert tuple(out[k].shape) == tuple(t.shape)
        assert _bits(out[k]) == _bits(t), k
    md = ss.metadata(f)
    assert md.meta["__metadata__"] == {"format": "pt", "note": "hi"}
    assert md.tree["layer.10.bfloat16"].dtype == "bfloat16"
    assert ss.verify(f).ok


def test_detected_by_content_not_extension(tmp_path: Path) -> None:
    f = tmp_path / "weights.bin"
    st_torch.save_file({"w": torch.arange(6.0)}, f)
    assert detect_format(f) == "safetensors"
    assert ss.load(f)["w"].tolist() == list(range(6))


def test_target_and_items(tmp_path: Path, tensors: dict[str, torch.Tensor]) -> None:
    f = tmp_path / "m.safetensors"
    st_torch.save_file(tensors, f)
    target = {"layer.10.bfloat16": torch.zeros(3, 5, dtype=torch.bfloat16),
              "layer.11.float32": torch.zeros(3, 5)}
    out = ss.load(f, target=target)
    assert isinstance(out["layer.11.float32"], torch.Tensor)
    assert torch.equal(out["layer.11.float32"], tensors["layer.11.float32"])
    assert _bits(out["layer.10.bfloat16"]) == _bits(tensors["layer.10.bfloat16"])
    # items= reads only those keys
    assert set(ss.load(f, items=["scalar", "empty"])) == {"scalar", "empty"}
    with pytest.raises(ss.TargetMismatchError, match="layer.11.float32"):
        ss.load(f, target={"layer.11.float32": torch.zeros(2, 2)})


def test_sharded_directory_and_weight_map(tmp_path: Path) -> None:
    d = tmp_path / "hf"
    d.mkdir()
    a = {"w1": torch.randn(4, 4), "b1": torch.randn(4)}
    b = {"w2": torch.randn(8, 2).to(torch.bfloat16)}
    st_torch.save_file(a, d / "model-00001-of-00002.safetensors")
    st_torch.save_file(b, d / "model-00002-of-00002.safetensors")
    idx = {"metadata": {"total_size": 100}, "weight_map": {
        "w1": "model-00001-of-00002.safetensors", "b1": "model-00001-of-00002.safetensors",
        "w2": "model-00002-of-00002.safetensors"}}
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    assert detect_format(d) == "safetensors-sharded"
    out = ss.load(d)
    assert list(out) == ["w1", "b1", "w2"]
    for k, t in {**a, **b}.items():
        assert _bits(out[k]) == _bits(t)
    got = ss.load(d, target={"w2": torch.zeros(8, 2, dtype=torch.bfloat16)})
    assert torch.equal(got["w2"], b["w2"])
    md = ss.metadata(d)
    assert [n for n, _ in md.files] == ["model-00001-of-00002.safetensors",
                                       "model-00002-of-00002.safetensors"]


def test_index_larger_than_its_limit_is_refused_and_read_at_its_size(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tracemalloc

    from statestream.interop import _safetensors
    d = tmp_path / "hf"
    d.mkdir()
    st_torch.save_file({"w": torch.ones(3)}, d / "model-00001-of-00001.safetensors")
    idx = json.dumps({"weight_map": {"w": "model-00001-of-00001.safetensors"}})
    (d / "model.safetensors.index.json").write_text(idx)
    tracemalloc.start()
    try:
        assert torch.equal(torch.as_tensor(ss.load(d)["w"]), torch.ones(3))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, peak  # not the 256 MiB limit reserved for a tiny index
    monkeypatch.setattr(_safetensors, "MAX_INDEX_BYTES", len(idx) - 1)
    with pytest.raises(ss.CheckpointCorruptError, match=r"index\.json is larger than"):
        ss.load(d)


def test_model_directory_with_one_file(tmp_path: Path) -> None:
    """``save_pretrained`` of a model below its shard size writes one model.safetensors and
    no index: the directory reads as that file (load, metadata, convert, the CLI)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=8)
    model = transformers.GPT2LMHeadModel(cfg)
    model.save_pretrained(tmp_path / "hf")
    assert not list((tmp_path / "hf").glob("*.index.json"))
    assert detect_format(tmp_path / "hf") == "safetensors"
    out = ss.load(tmp_path / "hf")
    for k, t in model.state_dict().items():
        if k != "lm_head.weight":  # tied to wte: save_pretrained writes it once
            assert _bits(out[k]) == _bits(t), k
    md = ss.metadata(tmp_path / "hf")
    assert md.format == "safetensors" and md.path.endswith("model.safetensors")
    ss.convert(tmp_path / "hf", tmp_path / "ck")
    assert set(ss.load(tmp_path / "ck")) == set(out)
    from statestream.cli import main

    assert main(["inspect", str(tmp_path / "hf")]) == 0
    # two files and no index: which one is meant is not guessed
    st_torch.save_file({"x": torch.zeros(2)}, tmp_path / "hf" / "other.safetensors")
    assert detect_format(tmp_path / "hf") is None


def test_sharded_index_cannot_escape(tmp_path: Path) -> None:
    d = tmp_path / "hf"
    d.mkdir()
    st_torch.save_file({"w": torch.zeros(2)}, tmp_path / "outside.safetensors")
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": "../outside.safetensors"}}))
    with pytest.raises(ss.UnsafeCheckpointError, match="not a plain file"):
        ss.load(d)
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": "/etc/passwd"}}))
    with pytest.raises(ss.UnsafeCheckpointError):
        ss.load(d)


def _raw(header: object, data: bytes = b"", *, pad: bytes = b"") -> bytes:
    hb = json.dumps(header).encode() + pad
    return struct.pack("<Q", len(hb)) + hb + data


@pytest.mark.parametrize("blob,match", [
    (_raw({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8),
     "outside"),
    (_raw({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}, b"\0" * 16),
     "needs 16"),
    (_raw({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
           "v": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12),
     "overlap"),
    (_raw({"w": {"dtype": "X9", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8),
     "dtype"),
    (_raw({"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8),
     "shape"),
    (_raw({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8], "x": 1}}, b"\0" * 8),
     "exactly"),
    (_raw({"__metadata__": {"a": 1}}), "strings"),
    (_raw({"__metadata__": []}), "strings"),
    (_raw({"__metadata__": 0}), "strings"),
    (_raw({"__metadata__": None}), None),
    (_raw([1, 2]), "object"),
    (struct.pack("<Q", 1 << 40) + b"{}", "header length"),
    (struct.pack("<Q", 10) + b'{"a":', "header length"),
    (struct.pack("<Q", 9) + b'{"a":1,"a', "JSON"),
    (struct.pack("<Q", 4) + b"{\xff\xfe}", "UTF-8"),
    (struct.pack("<Q", 2) + b"{}", None),
])
def test_hostile_headers(tmp_path: Path, blob: bytes, match: str | None) -> None:
    f = tmp_path / "bad.safetensors"
    f.write_bytes(blob)
    if match is None:  # an empty (valid) file
        assert ss.load(f) == {}
        return
    with pytest.raises(ss.CheckpointCorruptError, match=match):
        ss.load(f)
    with pytest.raises(ss.CheckpointCorruptError):
        ss.metadata(f)


def test_duplicate_keys_and_deep_nesting_refused(tmp_path: Path) -> None:
    f = tmp_path / "dup.safetensors"
    hb = b'{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},' \
         b'"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'
    f.write_bytes(struct.pack("<Q", len(hb)) + hb + b"\0" * 4)
    with pytest.raises(ss.CheckpointCorruptError, match="twice"):
        ss.load(f)
    deep = b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    f.write_bytes(struct.pack("<Q", len(deep)) + deep)
    with pytest.raises(ss.CheckpointCorruptError):
        ss.load(f)


def _tagged(names: str, tree: str) -> bytes:
    return _raw({"__metadata__": {"statestream.arrays": names, "statestream.tree": tree},
                 "1": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4)


@pytest.mark.parametrize("blob,match", [
    # a name that is not a string, though its str() is a tensor's name (was a KeyError)
    (_tagged("[1]", '{"t": "array", "a": 0}'), "statestream.arrays"),
    (_tagged('[["1"]]', '{"t": "array", "a": 0}'), "statestream.arrays"),
    # NaN in statestream's metadata was read, and convert then failed with a bare
    # ValueError writing it back
    (_raw({"__metadata__": {"statestream.meta": '{"x": NaN}'},
           "w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4),
     "statestream.meta: NaN is not a JSON value"),
    # a malformed tree names the file and the metadata key
    (_tagged('["1"]', "{}"), r"bad\.safetensors: statestream\.tree: malformed tree"),
])
def test_hostile_statestream_metadata(tmp_path: Path, blob: bytes, match: str) -> None:
    f = tmp_path / "bad.safetensors"
    f.write_bytes(blob)
    for fn in (ss.load, ss.metadata):
        with pytest.raises(ss.CheckpointCorruptError, match=match):
            fn(f)
    assert ss.verify(f).problems


def _two(c0: dict[str, object], c1: dict[str, object] | None = None) -> bytes:
    """A float32 (2, 2) tensor ``a`` and a uint8 (3,) tensor ``b``, whose embedded tree holds
    ``c0`` (over array 0) and ``c1`` (over array 1; an array leaf by default)."""
    tree = {"t": "dict", "k": ["a", "b"], "c": [c0, c1 or {"t": "array", "a": 1}]}
    return _raw({"__metadata__": {"statestream.arrays": '["a", "b"]',
                                  "statestream.tree": json.dumps(tree)},
                 "a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
                 "b": {"dtype": "U8", "shape": [3], "data_offsets": [16, 19]}},
                np.arange(4, dtype=np.float32).tobytes() + b"abc")


@pytest.mark.parametrize("c0,match", [
    ({"t": "bytes", "a": 0}, "bytes leaf must be a 1-D uint8 blob"),
    # (reached pickle.loads with allow_pickle=True: UnpicklingError escaped)
    ({"t": "pickle", "a": 0, "x": {"type": "x"}}, "pickle leaf must be a 1-D uint8 blob"),
    ({"t": "alias", "a": 0}, "an alias refers to array 0, which no array leaf holds"),
    ({"t": "array", "a": 0, "x": {"kind": {"t": "none"}}},
     "leaf attributes must hold plain values, not tree nodes"),
], ids=["bytes-on-float", "pickle-on-float", "dangling-alias", "node-in-attrs"])
def test_an_embedded_tree_gets_a_manifests_leaf_checks(tmp_path: Path, c0: dict[str, object],
                                                       match: str) -> None:
    # only decode_tree's checks applied, not decode_manifest's: these loaded (or failed
    # with a foreign exception), and convert wrote checkpoints statestream refused
    f = tmp_path / "bad.safetensors"
    f.write_bytes(_two(c0))
    reads = (ss.load, ss.metadata, lambda p: ss.load(p, allow_pickle=True),
             lambda p: ss.convert(p, tmp_path / "out"))
    for read in reads:
        with pytest.raises(ss.CheckpointCorruptError,
                           match=r"bad\.safetensors: statestream\.tree: malformed tree: " + match):
            read(f)
    assert not (tmp_path / "out").exists()
    assert ss.verify(f).problems


def test_an_embedded_bytes_leaf_over_a_uint8_vector_loads(tmp_path: Path) -> None:
    f = tmp_path / "ok.safetensors"
    f.write_bytes(_two({"t": "array", "a": 0}, {"t": "bytes", "a": 1}))
    out = ss.load(f)
    assert out["b"] == b"abc" and out["a"].tolist() == [[0, 1], [2, 3]]


def test_truncated_data_is_an_error(tmp_path: Path) -> None:
    f = tmp_path / "m.safetensors"
    st_torch.save_file({"w": torch.randn(64)}, f)
    f.write_bytes(f.read_bytes()[:-10])
    with pytest.raises(ss.CheckpointCorruptError, match="outside"):
        ss.load(f)


# ----------------------------------------------------------------------------- convert


def _state() -> dict[str, object]:
    return {
        "model": {f"t{i}": _tensor(dt, (4, 3), 10 + i) for i, dt in enumerate(TORCH_DTYPES)},
        "opt": {"step": 12, "lr": 0.1, "betas": (0.9, 0.999), "name": "adam", "none": None,
                "flag": True, "big": 1 << 80, "moments": [np.arange(5.0), np.float32(1.5)]},
        "blob": b"\x00\x01raw",
    }


def _same(a: object, b: object) -> None:
    if isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    elif isinstance(a, (torch.Tensor, np.ndarray, np.generic)):
        assert type(a) is type(b) or isinstance(b, np.ndarray)
        assert a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape)  # type: ignore[union-attr]
        assert _bits(a) == _bits(b)
    else:
        assert type(a) is type(b) and a == b


def test_statestream_safetensors_statestream_is_exact(tmp_path: Path) -> None:
    state = _state()
    ss.save(tmp_path / "ck", state, meta={"run": "r1"})
    ref = ss.load(tmp_path / "ck")
    out = ss.convert(tmp_path / "ck", tmp_path / "x.safetensors")
    assert out == str(tmp_path / "x.safetensors")
    _same(ref, ss.load(tmp_path / "x.safetensors"))
    # safetensors' own reader sees the tensors under flat names, dtypes kept
    flat = st_torch.load_file(tmp_path / "x.safetensors")
    for i, dt in enumerate(TORCH_DTYPES):
        assert flat[f"model.t{i}"].dtype == dt
        assert _bits(flat[f"model.t{i}"]) == _bits(state["model"][f"t{i}"])  # type: ignore[index]
    ss.convert(tmp_path / "x.safetensors", tmp_path / "back")
    _same(ref, ss.load(tmp_path / "back"))
    assert ss.verify(tmp_path / "back").ok
    assert ss.metadata(tmp_path / "back").meta["user"] == {"run": "r1"}


def test_convert_to_hf_shards(tmp_path: Path) -> None:
    state = {"model": {f"w{i}": torch.randn(64, 16) for i in range(5)}}
    ss.save(tmp_path / "ck", state)
    ss.convert(tmp_path / "ck", tmp_path / "hf", to="safetensors", items=["model"],
               max_shard_bytes=3 * 64 * 16 * 4)
    files = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                     "model.safetensors.index.json"]
    idx = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert set(idx["weight_map"]) == {f"w{i}" for i in range(5)}
    got: dict[str, torch.Tensor] = {}
    for f in files[:2]:
        got.update(st_torch.load_file(tmp_path / "hf" / f))
    for k, t in state["model"].items():
        assert torch.equal(got[k], t)
    back = ss.load(tmp_path / "hf", target={k: torch.zeros(64, 16) for k in state["model"]})
    for k, t in state["model"].items():
        assert isinstance(back[k], torch.Tensor) and torch.equal(back[k], t)


def test_convert_foreign_safetensors_keeps_metadata(tmp_path: Path) -> None:
    t = {"a": torch.randn(3), "b": torch.randn(2, 2).to(torch.float16)}
    st_torch.save_file(t, tmp_path / "in.safetensors", metadata={"format": "pt"})
    ss.convert(tmp_path / "in.safetensors", tmp_path / "ck")
    assert ss.metadata(tmp_path / "ck").meta["__metadata__"] == {"format": "pt"}
    ss.convert(tmp_path / "ck", tmp_path / "out.safetensors")
    with open(tmp_path / "out.safetensors", "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    assert header["__metadata__"]["format"] == "pt"
    again = st_torch.load_file(tmp_path / "out.safetensors")
    for k in t:
        assert torch.equal(again[k], t[k])


def test_what_safetensors_cannot_hold_names_key_paths(tmp_path: Path) -> None:
    ss.save(tmp_path / "ck", {"m": {"ok": np.zeros(2), "c": np.zeros(2, np.complex128)},
                              "f": np.zeros(1)})
    with pytest.raises(ss.UnsupportedTypeError, match=r"'m/c' \(complex128\)"):
        ss.convert(tmp_path / "ck", tmp_path / "x.safetensors")
    assert not (tmp_path / "x.safetensors").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".statestream")]


def test_flat_name_collision_is_an_error(tmp_path: Path) -> None:
    ss.save(tmp_path / "ck", {"a.b": np.zeros(1), "a": {"b": np.ones(1)}})
    with pytest.raises(ss.UnsupportedTypeError, match="a.b"):
        ss.convert(tmp_path / "ck", tmp_path / "x.safetensors")


@pytest.mark.parametrize("dst", ["m.safetensors", "shards"])
def test_a_tensor_named_metadata_is_refused(tmp_path: Path, dst: str) -> None:
    """A key '__metadata__' became the tensor of that name, overwriting the header's
    metadata: convert succeeded and wrote a file no reader (ours, safetensors') could open."""
    ss.save(tmp_path / "ck", {"__metadata__": np.ones(2, np.float32), "w": np.zeros(1)})
    with pytest.raises(ss.UnsupportedTypeError, match="key path '__metadata__'"):
        ss.convert(tmp_path / "ck", tmp_path / dst, to="safetensors")
    assert not (tmp_path / dst).exists()


def test_convert_refuses_to_overwrite(tmp_path: Path) -> None:
    ss.save(tmp_path / "ck", {"w": np.zeros(3)})
    (tmp_path / "x.safetensors").write_bytes(b"keep")
    with pytest.raises(ss.CheckpointExistsError):
        ss.convert(tmp_path / "ck", tmp_path / "x.safetensors")
    assert (tmp_path / "x.safetensors").read_bytes() == b"keep"
    ss.convert(tmp_path / "ck", tmp_path / "x.safetensors", overwrite=True)
    assert ss.load(tmp_path / "x.safetensors")["w"].tolist() == [0, 0, 0]
    ss.convert(tmp_path / "ck", tmp_path / "ck2")
    with pytest.raises(ss.CheckpointExistsError):
        ss.convert(tmp_path / "x.safetensors", tmp_path / "ck2")


@pytest.mark.parametrize("dst,to", [("o.safetensors", None), ("hf", "safetensors"),
                                    ("o.pt", None), ("d", "dcp"), ("ck", None)])
def test_convert_makes_missing_parent_directories(tmp_path: Path, dst: str,
                                                  to: str | None) -> None:
    """As a save does: a conversion into a directory that does not exist yet makes it
    (it raised FileNotFoundError naming a hidden staging directory)."""
    ss.save(tmp_path / "ck0", {"w": np.arange(3.0)})
    out = ss.convert(tmp_path / "ck0", tmp_path / "new" / "sub" / dst, to=to)
    assert ss.load(out)["w"].tolist() == [0.0, 1.0, 2.0]
    assert [p.name for p in (tmp_path / "new" / "sub").iterdir()] == [dst]  # no staging left


@pytest.mark.parametrize("to", ["safetensors", "dcp", "torch", "statestream"])
def test_overwrite_never_replaces_what_is_not_a_checkpoint(tmp_path: Path, to: str) -> None:
    """overwrite=True into a directory of other files (a project, a model directory's
    parent) used to rename the output over it and delete everything it held."""
    ss.save(tmp_path / "ck", {"w": np.arange(4.0)})
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "notes.txt").write_text("keep")
    with pytest.raises(ss.CheckpointExistsError, match="never replaces it"):
        ss.convert(tmp_path / "ck", proj, to=to, overwrite=True)
    assert (proj / "notes.txt").read_text() == "keep"
    if to != "torch":  # a directory output does not replace a file either
        (tmp_path / "f").write_text("keep")
        with pytest.raises(ss.CheckpointExistsError, match="is a file"):
            ss.convert(tmp_path / "ck", tmp_path / "f", to=to, overwrite=True)
        assert (tmp_path / "f").read_text() == "keep"
        # an earlier export, or an empty directory, is replaced
        ss.convert(tmp_path / "ck", tmp_path / "out", to=to)
        ss.convert(tmp_path / "ck", tmp_path / "out", to=to, overwrite=True)
        (tmp_path / "empty").mkdir()
        ss.convert(tmp_path / "ck", tmp_path / "empty", to=to, overwrite=True)
        assert ss.load(tmp_path / "empty")["w"].tolist() == [0, 1, 2, 3]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


@pytest.mark.parametrize("old", ["dcp", "sharded"])
@pytest.mark.parametrize("to", ["statestream", "safetensors", "dcp"])
def test_overwrite_replaces_a_checkpoint_of_another_format_for_every_directory_output(
        tmp_path: Path, old: str, to: str) -> None:
    """docs/interop.md: overwrite=True replaces a checkpoint directory statestream reads by
    a directory output. A statestream output refused a DCP or sharded safetensors one
    ('not a statestream checkpoint; statestream never replaces it') where the other
    outputs replaced it; ss.save itself still replaces only its own checkpoints."""
    ss.save(tmp_path / "ck", {"w": np.arange(4.0)})
    dst = tmp_path / "out"
    ss.convert(tmp_path / "ck", dst, to="dcp" if old == "dcp" else "safetensors",
               max_shard_bytes=None if old == "dcp" else 1 << 20)
    was = ss.metadata(dst).format
    with pytest.raises(ss.CheckpointExistsError, match="pass overwrite=True"):
        ss.convert(tmp_path / "ck", dst, to=to)
    assert ss.metadata(dst).format == was
    ss.convert(tmp_path / "ck", dst, to=to, overwrite=True)
    got = ss.metadata(dst).format
    assert got == {"statestream": "statestream", "dcp": "dcp"}.get(to, "safetensors-sharded")
    assert ss.load(dst)["w"].tolist() == [0.0, 1.0, 2.0, 3.0]
    if to == "statestream":
        assert ss.verify(dst).ok
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "out"]  # no staging left
    ss.convert(tmp_path / "ck", tmp_path / "d2", to="dcp")
    with pytest.raises(ss.CheckpointExistsError, match="not even with overwrite=True"):
        ss.save(tmp_path / "d2", {"w": np.zeros(2)}, overwrite=True)  # a save's rule stays
    from statestream.cli import main

    assert main(["convert", str(tmp_path / "ck"), str(tmp_path / "d2"), "--to", to,
                 "--overwrite"]) == 0  # the command line's convert --overwrite too
    assert ss.load(tmp_path / "d2")["w"].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_progress_never_exceeds_total(tmp_path: Path) -> None:
    ss.save(tmp_path / "ck", {"w": np.zeros((1000, 100)), "v": np.ones(10)})
    seen: list[tuple[int, int]] = []
    ss.convert(tmp_path / "ck", tmp_path / "x.safetensors",
               memory=ss.MemoryOptions(memory_budget_bytes=64 << 10),
               progress=lambda d, t: seen.append((d, t)))
    assert seen and all(d <= t for d, t in seen) and seen[-1][0] == seen[-1][1]
    assert len(seen) > 5  # many slabs under a 64 KiB budget


def test_metadata_names_the_format_and_cli_inspects(tmp_path: Path) -> None:
    import subprocess
    import sys

    f = tmp_path / "m.safetensors"
    st_torch.save_file({"enc.w": torch.zeros(2, 3)}, f)
    assert ss.metadata(f).format == "safetensors"
    r = subprocess.run([sys.executable, "-m", "statestream", "inspect", str(f)],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    assert "enc.w" in r.stdout and "(2, 3)" in r.stdout


def test_only_the_wanted_bytes_are_read(tmp_path: Path) -> None:
    f = tmp_path / "m.safetensors"
    st_torch.save_file({"big": torch.zeros(2048, 1024), "small": torch.ones(4, 4)}, f)
    seen: list[tuple[int, int]] = []
    out = ss.load(f, items=["small"], progress=lambda d, t: seen.append((d, t)))
    assert set(out) == {"small"} and seen[-1] == (64, 64)
    # a target holding some rows (a shard) reads about those rows, not the 8 MiB tensor
    from statestream.api._load import open_checkpoint
    from statestream.plan import Wanted, plan_load

    reader, m = open_checkpoint(f)
    reader.close()
    import numpy as np

    dest = np.empty((16, 1024), np.float32)
    reqs = plan_load(m.arrays, [Wanted(0, (1000, 0), dest)])
    assert sum(r.nbytes for r in reqs) <= 4 << 20  # one 4 MiB row block at most


def test_jax_target_with_sharding(tmp_path: Path) -> None:
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    f = tmp_path / "m.safetensors"
    w = torch.randn(8, 4)
    st_torch.save_file({"w": w, "b": torch.arange(3.0).to(torch.bfloat16)}, f)
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    out = ss.load(f, target={"w": jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=sharding),
                             "b": jnp.zeros(3, jnp.bfloat16)})
    assert isinstance(out["w"], jax.Array) and out["w"].sharding == sharding
    assert np.asarray(out["w"]).tobytes() == w.numpy().tobytes()
    assert out["b"].dtype == jnp.bfloat16 and np.asarray(out["b"], np.float32).tolist() == [0, 1, 2]


def test_save_pretrained_directory_loads_into_a_tied_model(tmp_path: Path) -> None:
    """``save_pretrained`` writes a tied GPT-2's lm_head.weight only as
    transformer.wte.weight; loading the directory into the model fills the tied
    name from it (the target's own tie says which), as from_pretrained does. An
    untied missing key is still a MissingKeyError. A model built on the meta
    device (whose tensors have no memory to tell a tie by) is tied by its own
    Parameters and stays tied after the load assigns them."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=8)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    model.save_pretrained(tmp_path / "hf")
    fresh = transformers.GPT2LMHeadModel(cfg).eval()
    assert ss.load(tmp_path / "hf", target=fresh) is fresh
    assert fresh.lm_head.weight is fresh.transformer.wte.weight
    x = torch.arange(6).reshape(1, 6)
    assert torch.equal(fresh(x).logits, model(x).logits)
    untied = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(**{**cfg.to_dict(), "tie_word_embeddings": False}))
    with pytest.raises(ss.MissingKeyError, match="lm_head.weight"):
        ss.load(tmp_path / "hf", target=untied)
    with torch.device("meta"):  # a meta model's tie is told by its own Parameters
        meta = transformers.GPT2LMHeadModel(cfg).eval()
    assert ss.load(tmp_path / "hf", target=meta) is meta
    assert meta.lm_head.weight is meta.transformer.wte.weight
    assert meta.lm_head.weight.device.type == "cpu"
    assert torch.equal(meta(x).logits, model(x).logits)


def test_a_header_or_index_above_the_readers_limits_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The single file's header holds the tree: with enough arrays it passed the 100 MB
    readers accept, and convert wrote a file no reader opened (here the limits are made
    small instead). The index of shards is checked against statestream's limit too."""
    import statestream.interop._safetensors as st_mod

    ss.save(tmp_path / "ck", {f"layer_{i:04d}": np.zeros(1, np.float32) for i in range(100)})
    monkeypatch.setattr(st_mod, "MAX_HEADER_BYTES", 4096)
    with pytest.raises(ss.UnsupportedTypeError, match="header would be .* above the 4096"):
        ss.convert(tmp_path / "ck", tmp_path / "m.safetensors")
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    ss.convert(tmp_path / "ck", tmp_path / "shards", to="safetensors", max_shard_bytes=64)
    assert len(ss.load(tmp_path / "shards")) == 100  # shard headers are small: it loads
    monkeypatch.setattr(st_mod, "MAX_INDEX_BYTES", 4096)
    with pytest.raises(ss.UnsupportedTypeError, match="index would be .* above the 4096"):
        ss.convert(tmp_path / "ck", tmp_path / "shards2", to="safetensors", max_shard_bytes=64)
    assert not (tmp_path / "shards2").exists()


def test_a_tensor_named_empty_keeps_its_name(tmp_path: Path) -> None:
    """A safetensors tensor named "" converted back to safetensors was named "tensor"."""
    st_torch.save_file({"": torch.ones(2), "b": torch.zeros(1)}, tmp_path / "e.safetensors")
    ss.convert(tmp_path / "e.safetensors", tmp_path / "back.safetensors", to="safetensors")
    got = st_torch.load_file(tmp_path / "back.safetensors")
    assert sorted(got) == ["", "b"] and torch.equal(got[""], torch.ones(2))
    ss.save(tmp_path / "lone", torch.ones(3))  # a lone array has no name: "tensor"
    ss.convert(tmp_path / "lone", tmp_path / "lone.safetensors", to="safetensors")
    assert list(st_torch.load_file(tmp_path / "lone.safetensors")) == ["tensor"]


def test_shard_index_total_size_is_the_files_not_the_users(tmp_path: Path) -> None:
    """A ``total_size`` in the user's safetensors metadata replaced the index's own."""
    state = {f"w{i}": torch.randn(16, 16) for i in range(3)}
    st_torch.save_file(state, tmp_path / "in.safetensors", metadata={"total_size": "7",
                                                                     "note": "n"})
    ss.convert(tmp_path / "in.safetensors", tmp_path / "hf", to="safetensors",
               max_shard_bytes=2048)
    idx = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert idx["metadata"]["total_size"] == 3 * 16 * 16 * 4
    assert idx["metadata"]["note"] == "n"
