"""PyTorch DCP directories: read without torch's unpickler, converted both ways, bit-exact."""

from __future__ import annotations

import os
import pickle
import warnings
from pathlib import Path

import numpy as np
import pytest

import statestream as ss
from statestream.interop import detect_format

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
          torch.uint16, torch.uint32, torch.uint64, torch.float16, torch.bfloat16,
          torch.float32, torch.float64, torch.complex64, torch.complex128,
          torch.float8_e4m3fn, torch.float8_e5m2]


def _rand(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n = int(np.prod(shape))
    raw = torch.randint(0, 256, (n * dtype.itemsize,), generator=g, dtype=torch.uint8)
    if dtype == torch.bool:
        return (raw[:n] & 1).bool().reshape(shape)
    return raw.view(dtype).reshape(shape)


def _bits(x: object) -> bytes:
    if isinstance(x, torch.Tensor):
        return x.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return np.ascontiguousarray(x).reshape(-1).view(np.uint8).tobytes()


def _save(state: dict[str, object], path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(path))


def _state() -> dict[str, object]:
    return {"model": {f"t{i}": _rand(dt, (6, 3), i) for i, dt in enumerate(DTYPES)},
            "step": 5, "opt": {"lr": 0.1, "name": "adamw", "betas": (0.9, 0.99)}}


def test_reads_dcp_every_dtype(tmp_path: Path) -> None:
    state = _state()
    _save(state, tmp_path / "d")
    assert detect_format(tmp_path / "d") == "dcp"
    out = ss.load(tmp_path / "d")
    for i, dt in enumerate(DTYPES):
        assert _bits(out["model"][f"t{i}"]) == _bits(state["model"][f"t{i}"]), dt  # type: ignore[index]
    assert out["step"] == 5 and out["opt"] == {"lr": 0.1, "name": "adamw", "betas": (0.9, 0.99)}
    md = ss.metadata(tmp_path / "d")
    assert md.format == "dcp" and md.tree["model"]["t10"].dtype == "bfloat16"
    got = ss.load(tmp_path / "d", target={"model": {"t11": torch.zeros(6, 3)}}, items=["model"])
    assert torch.equal(got["model"]["t11"], state["model"]["t11"])  # type: ignore[index]


def test_metadata_pickle_payload_refused_no_file(tmp_path: Path) -> None:
    _save({"w": torch.zeros(3)}, tmp_path / "d")
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (os.system, (f"touch {marker}",))

    (tmp_path / "d" / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(ss.PickleNotAllowedError, match="system"):
        ss.load(tmp_path / "d")
    with pytest.raises(ss.PickleNotAllowedError):
        ss.convert(tmp_path / "d", tmp_path / "out")
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_hostile_storage_entries(tmp_path: Path) -> None:
    _save({"w": torch.arange(8.0)}, tmp_path / "d")
    raw = (tmp_path / "d" / ".metadata").read_bytes()
    # a relative path that escapes the directory
    esc = raw.replace(b"__0_0.distcp", b"../_0.distcp")  # same length
    (tmp_path / "d" / ".metadata").write_bytes(esc)
    with pytest.raises(ss.UnsafeCheckpointError):
        ss.load(tmp_path / "d")
    # a data file shorter than the metadata says
    (tmp_path / "d" / ".metadata").write_bytes(raw)
    f = tmp_path / "d" / "__0_0.distcp"
    f.write_bytes(f.read_bytes()[:100])
    with pytest.raises(ss.CheckpointCorruptError, match="outside"):
        ss.load(tmp_path / "d")


def test_a_dcp_directory_missing_its_data_file_is_damage_naming_it(tmp_path: Path) -> None:
    """With its only .distcp gone, a DCP directory was no known format: verify said 'no
    COMMITTED marker' (exit 2) where a sharded safetensors directory missing its shard is
    damage naming the file (exit 1)."""
    from statestream.cli import main

    _save({"w": torch.arange(8.0)}, tmp_path / "d")
    (tmp_path / "d" / "__0_0.distcp").unlink()
    assert detect_format(tmp_path / "d") == "dcp"
    rep = ss.verify(tmp_path / "d")
    assert not rep.ok and len(rep.problems) == 1
    assert "__0_0.distcp is missing" in rep.problems[0]
    assert main(["verify", str(tmp_path / "d")]) == 1
    with pytest.raises(ss.TruncatedFileError, match="__0_0.distcp is missing"):
        ss.load(tmp_path / "d")
    # a .metadata that is no DCP pickle, or no regular file, is not taken for one
    for other in (b"", b"\x80\x04junk", pickle.dumps({"torch": 1})):
        (tmp_path / "d" / ".metadata").write_bytes(other)
        assert detect_format(tmp_path / "d") is None
    (tmp_path / "d" / ".metadata").unlink()
    os.mkfifo(tmp_path / "d" / ".metadata")  # never opened, nor waited on
    assert detect_format(tmp_path / "d") is None


def test_dcp_to_statestream_and_safetensors_exact(tmp_path: Path) -> None:
    state = _state()
    _save(state, tmp_path / "d")
    ss.convert(tmp_path / "d", tmp_path / "ck")
    ck = ss.load(tmp_path / "ck")
    for i, _ in enumerate(DTYPES):
        assert _bits(ck["model"][f"t{i}"]) == _bits(state["model"][f"t{i}"])  # type: ignore[index]
    assert ck["step"] == 5
    st = pytest.importorskip("safetensors.torch")
    with pytest.raises(ss.UnsupportedTypeError, match=r"'t14' \(complex128\)"):
        ss.convert(tmp_path / "d", tmp_path / "m.safetensors", items=["model"])
    del state["model"]["t14"]  # type: ignore[attr-defined]
    _save(state, tmp_path / "d2")
    ss.convert(tmp_path / "d2", tmp_path / "m.safetensors", items=["model"])
    flat = st.load_file(tmp_path / "m.safetensors")
    for k, t in state["model"].items():  # type: ignore[attr-defined]
        assert flat[k].dtype == t.dtype and _bits(flat[k]) == _bits(t)


def test_convert_to_dcp_is_read_by_dcp_load(tmp_path: Path) -> None:
    state = {"model": {f"t{i}": _rand(dt, (6, 3), i) for i, dt in enumerate(DTYPES)},
             "step": 5, "opt": {"lr": 0.1, "hist": [torch.ones(2), 3]}, "blob": b"hi"}
    ss.save(tmp_path / "ck", state)
    ss.convert(tmp_path / "ck", tmp_path / "d", to="dcp")
    target = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()},  # type: ignore[attr-defined]
              "step": 0, "opt": {"lr": 0.0, "hist": [torch.zeros(2), 0]}, "blob": b""}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, checkpoint_id=str(tmp_path / "d"))
    for k, v in state["model"].items():  # type: ignore[attr-defined]
        assert target["model"][k].dtype == v.dtype and _bits(target["model"][k]) == _bits(v)  # type: ignore[index]
    assert target["step"] == 5 and target["opt"]["lr"] == 0.1  # type: ignore[index]
    assert target["opt"]["hist"][1] == 3 and target["blob"] == b"hi"  # type: ignore[index]
    # and back: DCP -> statestream keeps values, lists and bytes
    back = ss.load(tmp_path / "d")
    assert back["opt"]["hist"][1] == 3 and back["blob"] == b"hi" and back["step"] == 5
    assert _bits(back["opt"]["hist"][0]) == _bits(torch.ones(2))
    with pytest.raises(ss.CheckpointExistsError):
        ss.convert(tmp_path / "ck", tmp_path / "d", to="dcp")


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return model, opt


def test_convert_to_dcp_flattens_as_dcp_save_does(tmp_path: Path) -> None:
    """A list of plain values (an optimizer's ``params``) is one DCP item, as dcp.save
    stores it, so dcp.load reads a converted model + optimizer into their state dicts."""
    from torch.distributed.checkpoint import FileSystemReader

    model, opt = _trained()
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "ids": [[1, 2], [3]]}
    ss.save(tmp_path / "ck", state)
    ss.convert(tmp_path / "ck", tmp_path / "d", to="dcp")
    _save(state, tmp_path / "own")
    keys = set(FileSystemReader(str(tmp_path / "d")).read_metadata().state_dict_metadata)
    own = set(FileSystemReader(str(tmp_path / "own")).read_metadata().state_dict_metadata)
    assert keys == own and "optim.param_groups.0.params" in keys
    fresh, fresh_opt = _trained()
    for p in fresh.parameters():
        p.data.zero_()
    target = {"model": fresh.state_dict(), "optim": fresh_opt.state_dict(), "ids": [[0], [0]]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, checkpoint_id=str(tmp_path / "d"))
    for k, v in state["model"].items():  # type: ignore[attr-defined]
        assert torch.equal(target["model"][k], v), k  # type: ignore[index]
    saved_group = state["optim"]["param_groups"][0]  # type: ignore[index]
    assert target["optim"]["param_groups"][0]["params"] == saved_group["params"]  # type: ignore[index]
    assert target["ids"] == [[1, 2], [3]]
    assert ss.load(tmp_path / "d")["optim"]["param_groups"][0]["params"] == [0, 1, 2, 3]


def test_converted_dcp_records_key_paths_as_dcp_save_does(tmp_path: Path) -> None:
    """Mapping keys are str in DCP's planner paths (an optimizer's state is keyed by
    int): a converted checkpoint reads back with the structure dcp.save's own has,
    a dict keyed '0', '1', ..., not a list."""
    from torch.distributed.checkpoint import FileSystemReader

    model, opt = _trained()
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    ss.save(tmp_path / "ck", state)
    ss.convert(tmp_path / "ck", tmp_path / "d", to="dcp")
    _save(state, tmp_path / "own")
    ours = FileSystemReader(str(tmp_path / "d")).read_metadata().planner_data
    own = FileSystemReader(str(tmp_path / "own")).read_metadata().planner_data
    assert ours == own
    back, ref = ss.load(tmp_path / "d"), ss.load(tmp_path / "own")
    assert isinstance(back["optim"]["state"], dict)
    assert sorted(back["optim"]["state"]) == sorted(ref["optim"]["state"]) == ["0", "1", "2", "3"]
    for k, v in ref["optim"]["state"].items():
        np.testing.assert_array_equal(back["optim"]["state"][k]["exp_avg"], v["exp_avg"])


def test_metadata_claiming_a_huge_tensor_is_refused(tmp_path: Path) -> None:
    """A .metadata whose size is far larger than its chunks must not make load allocate it."""
    from torch.distributed.checkpoint.metadata import Metadata

    _save({"w": torch.arange(8.0)}, tmp_path / "d")
    with open(tmp_path / "d" / ".metadata", "rb") as f:
        md: Metadata = pickle.load(f)
    md.state_dict_metadata["w"].size = torch.Size([1 << 40])
    with open(tmp_path / "d" / ".metadata", "wb") as f:
        pickle.dump(md, f)
    with pytest.raises(ss.CheckpointCorruptError, match="cover 8 of"):
        ss.load(tmp_path / "d")
    md.state_dict_metadata["w"].size = torch.Size([4])
    with open(tmp_path / "d" / ".metadata", "wb") as f:
        pickle.dump(md, f)
    with pytest.raises(ss.CheckpointCorruptError, match="outside"):
        ss.load(tmp_path / "d")


def test_protocol_2_builtin_names_are_the_admitted_builtins(tmp_path: Path) -> None:
    """DCP (torch.save) pickles values with protocol 2, which names builtins
    ``__builtin__``: a bytearray value is read, not refused as a foreign global."""
    _save({"w": torch.ones(2), "extra": {"blob": bytearray(b"a\x00\xff")}}, tmp_path / "d")
    out = ss.load(tmp_path / "d")
    assert out["extra"]["blob"] == b"a\x00\xff"


def _set_size_5(md: object) -> None:
    md.state_dict_metadata["w"].size = 5  # type: ignore[attr-defined]


def _set_chunks_5(md: object) -> None:
    md.state_dict_metadata["w"].chunks = 5  # type: ignore[attr-defined]


def _set_offsets_5(md: object) -> None:
    md.state_dict_metadata["w"].chunks[0].offsets = 5  # type: ignore[attr-defined]


def _set_properties_none(md: object) -> None:
    md.state_dict_metadata["w"].properties = None  # type: ignore[attr-defined]


@pytest.mark.parametrize("edit,match", [
    (_set_size_5, "'w': size 5 is not a tuple"),
    (_set_chunks_5, "'w': chunks 5 is not a list"),
    (_set_offsets_5, "'w': offsets 5 is not a tuple"),
    (_set_properties_none, "properties None is not a DCP record"),
])
def test_metadata_fields_of_the_wrong_type_are_corrupt(tmp_path: Path, edit, match) -> None:
    _save({"w": torch.arange(4.0)}, tmp_path / "d")
    with open(tmp_path / "d" / ".metadata", "rb") as f:
        md = pickle.load(f)  # our own file, written just above by dcp.save
    edit(md)
    with open(tmp_path / "d" / ".metadata", "wb") as f:
        pickle.dump(md, f)
    for read in (ss.load, ss.metadata):
        with pytest.raises(ss.CheckpointCorruptError, match=match):
            read(tmp_path / "d")


def test_a_planner_path_deeper_than_a_tree_falls_back_to_flat_keys(tmp_path: Path) -> None:
    _save({"w": torch.arange(4.0)}, tmp_path / "d")
    with open(tmp_path / "d" / ".metadata", "rb") as f:
        md = pickle.load(f)  # our own file, written just above by dcp.save
    md.planner_data = {"w": ("a",) * 100_000}
    with open(tmp_path / "d" / ".metadata", "wb") as f:
        pickle.dump(md, f)
    assert list(ss.load(tmp_path / "d")) == ["w"]


@pytest.mark.parametrize("keys", [68, 69, 256])
def test_a_planner_path_and_the_value_at_it_nest_no_deeper_than_a_manifest(
        tmp_path: Path, keys: int) -> None:
    # each was bounded alone (256 keys, 200 levels of value), not together: at 446
    # levels a conversion died with RecursionError, at 290 it wrote a checkpoint that
    # statestream then refused
    v: object = 1
    for _ in range(190):
        v = [v]
    _save({"w": torch.zeros(2), "v": v}, tmp_path / "d")
    with open(tmp_path / "d" / ".metadata", "rb") as f:
        md = pickle.load(f)  # our own file, written just above by dcp.save
    md.planner_data["v"] = tuple(f"k{i}" for i in range(keys))
    with open(tmp_path / "d" / ".metadata", "wb") as f:
        pickle.dump(md, f)
    if keys == 68:  # the int at 68 + 190 levels: as deep as a manifest's tree may be
        ss.convert(tmp_path / "d", tmp_path / "out")
        got = ss.load(tmp_path / "out")
        for i in range(keys):
            got = got[f"k{i}"]
        assert got == v
        return
    where = "/".join(f"k{i}" for i in range(keys))
    for read in (ss.load, ss.metadata, lambda p: ss.convert(p, tmp_path / "out")):
        with pytest.raises(ss.CheckpointCorruptError,
                           match=f"d: the state is nested deeper than 256 levels at key path "
                                 f"'{where[:200]}"):
            read(tmp_path / "d")
    assert not (tmp_path / "out").exists()


def test_metadata_read_reserves_its_size_not_the_limit(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading ``.metadata`` asks for its own size, not the 1 GiB limit plus one."""
    import tracemalloc

    from statestream.interop import _dcp
    _save({"w": torch.ones(4)}, tmp_path / "d")
    tracemalloc.start()
    try:
        _dcp._metadata(str(tmp_path / "d"), allow_pickle=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, peak
    (tmp_path / "d" / ".metadata").write_bytes(b"\x80" * 64)
    monkeypatch.setattr(_dcp, "MAX_METADATA_BYTES", 63)
    with pytest.raises(ss.CheckpointCorruptError, match=r"\.metadata is larger than 63 bytes"):
        ss.load(tmp_path / "d")


def test_a_transposed_tensor_is_refused_not_scrambled(tmp_path: Path) -> None:
    # DCP's torch.save archive keeps a dense permuted chunk's strides; its bytes are
    # not in row-major order, and were read as if they were (wrong values, no error).
    w = torch.arange(6.0).reshape(2, 3).t()  # shape (3, 2), strides (1, 3)
    _save({"w": w, "ok": torch.arange(4)}, tmp_path / "d")
    with pytest.raises(ss.UnsupportedTypeError,
                       match=r"chunk of 'w' at \(0, 0\) is a non-contiguous view "
                             r"\(size \(3, 2\), stride \(1, 3\)\)"):
        ss.load(tmp_path / "d")
    with pytest.raises(ss.UnsupportedTypeError, match="non-contiguous"):
        ss.convert(tmp_path / "d", tmp_path / "out.safetensors")
    assert not (tmp_path / "out.safetensors").exists()


def test_reads_dcp_written_as_safetensors(tmp_path: Path) -> None:
    # serialization_format=SAFETENSORS: each file is a safetensors blob keyed by fqn,
    # and every chunk is recorded at the blob's start (it read the header as data).
    from torch.distributed.checkpoint.filesystem import FileSystemWriter, SerializationFormat

    state = {"w": _rand(torch.float32, (4, 6), 1), "i": torch.tensor([7, 8], dtype=torch.int32),
             "b": _rand(torch.bfloat16, (3,), 2), "n": {"x": _rand(torch.int64, (5,), 3)}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=FileSystemWriter(
            str(tmp_path / "d"), serialization_format=SerializationFormat.SAFETENSORS))
    out = ss.load(tmp_path / "d")
    for k in ("w", "i", "b"):
        assert _bits(out[k]) == _bits(state[k]), k
    assert _bits(out["n"]["x"]) == _bits(state["n"]["x"])
    assert ss.verify(tmp_path / "d").ok


def _one_adam_step() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 3)
    o = torch.optim.Adam(m.parameters())
    m(torch.randn(2, 4)).sum().backward()
    o.step()
    return m, o


@pytest.mark.parametrize("made_by", ["dcp.save", "ss.convert"])
def test_an_optimizer_target_loads_from_dcp(tmp_path: Path, made_by: str) -> None:
    # DCP stores the optimizer's int-keyed state as "0", "1"; the target's int keys
    # now match them (MissingKeyError: 'optim/state/0' is in the target but not ...).
    _, o1 = _one_adam_step()
    if made_by == "dcp.save":
        _save({"optim": o1.state_dict()}, tmp_path / "d")
    else:
        ss.save(tmp_path / "n", {"optim": o1})
        ss.convert(tmp_path / "n", tmp_path / "d", to="dcp")
    m3 = torch.nn.Linear(4, 3)
    o3 = torch.optim.Adam(m3.parameters())
    ss.load(tmp_path / "d", target={"optim": o3})
    want, got = o1.state_dict(), o3.state_dict()
    assert sorted(got["state"]) == [0, 1]
    for i in (0, 1):
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(got["state"][i][name], want["state"][i][name]), (i, name)
    assert got["param_groups"] == want["param_groups"]
    got_sd = ss.load(tmp_path / "d", target={"optim": o3.state_dict()})  # a plain dict too
    assert torch.equal(got_sd["optim"]["state"][1]["exp_avg"], want["state"][1]["exp_avg"])


def test_bytes_inside_a_list_or_tuple_convert_to_dcp(tmp_path: Path) -> None:
    """A list or tuple of plain values holding bytes is one DCP item, as dcp.save stores
    it; the conversion refused it as 'a list holding arrays' (a bytes leaf's data is an
    array of the checkpoint), though it holds no tensor. A tuple holding a tensor is
    still refused."""
    state = {"a": [b"x", b"yz"], "b": (b"\x00\xff", 1), "w": torch.ones(2)}
    ss.save(tmp_path / "ck", {**state, "e": [b""]})
    ss.convert(tmp_path / "ck", tmp_path / "d", to="dcp")
    _save(state, tmp_path / "own")
    back, own = ss.load(tmp_path / "d"), ss.load(tmp_path / "own")
    assert back["a"] == own["a"] == [b"x", b"yz"]
    assert back["b"] == own["b"] == (b"\x00\xff", 1)
    assert back["e"] == [b""]
    target: dict[str, object] = {"a": None, "b": None, "e": None, "w": torch.zeros(2)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, checkpoint_id=str(tmp_path / "d"))
    assert target["a"] == [b"x", b"yz"] and target["e"] == [b""]
    ss.save(tmp_path / "t", {"t": (torch.ones(1), b"x")})
    with pytest.raises(ss.UnsupportedTypeError, match="key path 't' is a tuple holding arrays"):
        ss.convert(tmp_path / "t", tmp_path / "d2", to="dcp")


def test_empty_dicts_converted_to_dcp_are_left_out_with_a_warning(tmp_path: Path) -> None:
    """DCP holds no item for an empty dict (dcp.save drops it too): the conversion says
    which key paths it leaves out, and dcp.load into a target that has them works."""
    _, opt = _trained()
    fresh = torch.optim.Adam(torch.nn.Linear(4, 3).parameters())  # no step: state is {}
    state = {"a": {}, "b": 1, "l": [torch.ones(2), {"x": {}, "y": 2}, 3],
             "opt": fresh.state_dict()}
    ss.save(tmp_path / "ck", state)
    with pytest.warns(UserWarning, match=r"key path\(s\) 'a', 'l/1/x', 'opt/state' are not in"):
        ss.convert(tmp_path / "ck", tmp_path / "d", to="dcp")
    back = ss.load(tmp_path / "d")
    assert "a" not in back and "state" not in back["opt"] and back["b"] == 1
    assert back["l"][1] == {"y": 2} and back["l"][2] == 3
    target = {"a": {}, "b": 0, "l": [torch.zeros(2), {"x": {}, "y": 0}, 0],
              "opt": torch.optim.Adam(torch.nn.Linear(4, 3).parameters()).state_dict()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, checkpoint_id=str(tmp_path / "d"))
    assert target["a"] == {} and target["b"] == 1 and target["l"][1] == {"x": {}, "y": 2}
    assert target["opt"]["state"] == {}  # type: ignore[index]
    ss.save(tmp_path / "full", {"opt": opt.state_dict()})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing left out: no warning
        ss.convert(tmp_path / "full", tmp_path / "d2", to="dcp")


@pytest.mark.parametrize("element", [{}, {"x": {}}])
def test_an_empty_dict_inside_a_list_of_tensors_is_refused_for_dcp(
        tmp_path: Path, element: dict[str, object]) -> None:
    """No DCP item holds it, so the list reads back as a dict {0: .., 2: ..} and dcp.load
    into a matching target fails ('Missing key ... l.1'), as with dcp.save's own."""
    ss.save(tmp_path / "ck", {"l": [torch.ones(2), element, 3]})
    with pytest.raises(ss.UnsupportedTypeError,
                       match=r"key path 'l/1' is an empty dict .* inside a list holding"):
        ss.convert(tmp_path / "ck", tmp_path / "d", to="dcp")
    assert not os.path.exists(tmp_path / "d")


@pytest.mark.parametrize("state", [
    {"0": {0: 0, "0": {"w": np.ones(2)}}},  # '0/0' and '0/0/w': nested in each other
    {"x": {0: {"a": np.ones(2)}, "0": {"b": np.ones(2)}}},  # would merge into one dict
    {"x": {1: np.ones(2), "1": 2}},  # one FQN
])
def test_int_and_str_keys_written_alike_are_refused_for_dcp(tmp_path: Path,
                                                            state: dict[str, object]) -> None:
    """DCP stores dict keys as str: an int key and its str in one mapping were converted
    when their FQNs differed, and read back flat ('0.0', '0.0.w') or merged."""
    ss.save(tmp_path / "ck", state)
    where = next(iter(state))
    with pytest.raises(ss.UnsupportedTypeError,
                       match=rf"mapping at key path '{where}' has the keys .* DCP stores alike"):
        ss.convert(tmp_path / "ck", tmp_path / "d", to="dcp")
    assert not os.path.exists(tmp_path / "d")


def test_a_value_statestream_cannot_hold_names_its_key_path_and_file(tmp_path: Path) -> None:
    """DCP stores a non-tensor value as a small torch.save archive; one statestream cannot
    hold (a set) was refused as "key path '<root>' holds a set", naming neither where in
    the state it is nor the file."""
    _save({"w": torch.ones(2), "opt": {"tags": {"a", "b"}}}, tmp_path / "c")
    for call in (ss.load, ss.metadata, ss.verify):
        with pytest.raises(ss.UnsupportedTypeError, match="holds a set") as ei:
            call(tmp_path / "c")
        msg = str(ei.value)
        assert "'opt/tags'" in msg and str(tmp_path / "c") in msg and ".distcp" in msg, msg


@pytest.mark.parametrize("root", [np.arange(3.0), 5, None, "x"])
def test_a_root_that_is_no_mapping_converts_to_dcp_and_back_as_itself(
        tmp_path: Path, root: object) -> None:
    """A state that is one tensor or value (a torch.save of a tensor) is DCP's item "" at
    the empty planner path; it was read back as {"": value}, another tree."""
    ss.save(tmp_path / "ck", root)
    ss.convert(tmp_path / "ck", tmp_path / "dcp", to="dcp")
    back = ss.load(tmp_path / "dcp")
    if isinstance(root, np.ndarray):
        assert isinstance(back, np.ndarray) and np.array_equal(back, root)
    else:
        assert back == root
    ss.convert(tmp_path / "dcp", tmp_path / "ck2")
    assert type(ss.load(tmp_path / "ck2")) is type(back)


def test_chunk_records_naming_the_same_bytes_over_and_over_are_refused(
        tmp_path: Path) -> None:
    """600 chunks of one 1 MiB byte range: a 600 MiB tensor from a 1 MiB file. Each chunk
    was read on its own, so a small .metadata could make a load allocate without bound."""
    import copy

    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    n = 1 << 18
    _save({"w": torch.arange(float(n))}, tmp_path / "d")
    with open(tmp_path / "d" / ".metadata", "rb") as f:
        md = pickle.load(f)  # our own file, written just above by dcp.save
    meta = md.state_dict_metadata["w"]
    (index, info), = [(k, v) for k, v in md.storage_data.items() if k.fqn == "w"]
    copies = 600
    meta.size = torch.Size([copies * n])
    meta.chunks = [ChunkStorageMetadata(offsets=torch.Size([i * n]), sizes=torch.Size([n]))
                   for i in range(copies)]
    for i in range(1, copies):
        md.storage_data[MetadataIndex("w", torch.Size([i * n]))] = copy.copy(info)
    with open(tmp_path / "d" / ".metadata", "wb") as f:
        pickle.dump(md, f)
    with pytest.raises(ss.CheckpointCorruptError, match="the same bytes over and over"):
        ss.metadata(tmp_path / "d")
    with pytest.raises(ss.CheckpointCorruptError, match="the same bytes over and over"):
        ss.load(tmp_path / "d")
    # a few records over the same bytes are taken (a weight and its view, say)
    meta.size, meta.chunks = torch.Size([4 * n]), meta.chunks[:4]
    md.storage_data = {k: v for k, v in md.storage_data.items()
                       if k.fqn != "w" or k.offset[0] < 4 * n}
    with open(tmp_path / "d" / ".metadata", "wb") as f:
        pickle.dump(md, f)
    out = ss.load(tmp_path / "d")["w"]
    assert out.shape == (4 * n,) and np.array_equal(out[3 * n:], np.arange(float(n)))
