"""torch.save files: read with weights-only semantics (no torch import), written for torch.load."""

from __future__ import annotations

import io
import os
import pickle
import zipfile
from pathlib import Path

import numpy as np
import pytest

import statestream as ss
from statestream.interop import detect_format

torch = pytest.importorskip("torch")

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


def _state() -> dict[str, object]:
    base = torch.randn(10, 4)
    return {
        "model": {f"t{i}": _rand(dt, (5, 3), i) for i, dt in enumerate(DTYPES)},
        "param": torch.nn.Parameter(torch.randn(3)),
        "view": base[2:5],  # a contiguous view at a storage offset
        "tied": base,  # shares the storage with "view"
        "opt": {"step": 3, "lr": 0.1, "betas": (0.9, 0.99), "size": torch.Size([2, 3]),
                "none": None, "flag": True, "name": "adamw"},
        "scalar": torch.tensor(7, dtype=torch.int64),
        "empty": torch.zeros(0, 2),
    }



def _write_pt(path: Path, pickler: type[pickle.Pickler], obj: object, storage: bytes) -> Path:
    """A hand-made torch zip file at ``path``: ``obj`` pickled by ``pickler`` (which
    names the storage "0"), and that storage's bytes."""
    buf = io.BytesIO()
    pickler(buf, protocol=2).dump(obj)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", buf.getvalue())
        z.writestr("archive/data/0", storage)
    return path

def test_reads_every_dtype_bit_exact(tmp_path: Path) -> None:
    state = _state()
    torch.save(state, tmp_path / "s.pt")
    assert detect_format(tmp_path / "s.pt") == "torch"
    out = ss.load(tmp_path / "s.pt")
    for i, dt in enumerate(DTYPES):
        assert _bits(out["model"][f"t{i}"]) == _bits(state["model"][f"t{i}"]), dt
    assert _bits(out["view"]) == _bits(state["view"])
    assert _bits(out["tied"]) == _bits(state["tied"])
    assert out["opt"] == {"step": 3, "lr": 0.1, "betas": (0.9, 0.99), "size": (2, 3),
                          "none": None, "flag": True, "name": "adamw"}
    assert out["scalar"].shape == () and int(out["scalar"]) == 7
    md = ss.metadata(tmp_path / "s.pt")
    assert md.format == "torch" and md.tree["model"]["t10"].dtype == "bfloat16"
    # targets: torch tensors come back as torch, only the wanted rows read
    got = ss.load(tmp_path / "s.pt", target={"view": torch.zeros(3, 4)}, items=["view"])
    assert torch.equal(got["view"], state["view"])  # type: ignore[arg-type]


def test_pickle_payload_is_refused_and_creates_no_file(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (os.system, (f"touch {marker}",))

    torch.save({"w": torch.zeros(2), "evil": Evil()}, tmp_path / "evil.pt")
    with pytest.raises(ss.PickleNotAllowedError, match="system"):
        ss.load(tmp_path / "evil.pt")
    with pytest.raises(ss.PickleNotAllowedError):
        ss.metadata(tmp_path / "evil.pt")
    with pytest.raises(ss.PickleNotAllowedError):
        ss.convert(tmp_path / "evil.pt", tmp_path / "out")
    assert not marker.exists()
    assert not (tmp_path / "out").exists()


def test_open_builtin_payload_refused(tmp_path: Path) -> None:
    target = tmp_path / "created.txt"
    payload = (b"\x80\x02c__builtin__\nopen\nq\x00X" + len(str(target)).to_bytes(4, "little")
               + str(target).encode() + b"X\x01\x00\x00\x00w\x86R.")
    with zipfile.ZipFile(tmp_path / "p.pth", "w") as z:
        z.writestr("archive/data.pkl", payload)
        z.writestr("archive/version", "3\n")
    with pytest.raises(ss.PickleNotAllowedError, match="open"):
        ss.load(tmp_path / "p.pth")
    assert not target.exists()


def test_hostile_archives(tmp_path: Path) -> None:
    torch.save({"w": torch.arange(16.0)}, tmp_path / "ok.pt")
    raw = (tmp_path / "ok.pt").read_bytes()
    # a tensor whose storage offset points outside its storage
    with zipfile.ZipFile(tmp_path / "ok.pt") as z:
        pkl = z.read("ok/data.pkl")
    bad = pkl.replace(b"K\x00K\x10\x85", b"K\x08K\x10\x85")  # offset 8, 16 elements
    assert bad != pkl
    with zipfile.ZipFile(tmp_path / "off.pt", "w") as z:
        z.writestr("off/data.pkl", bad)
        with zipfile.ZipFile(tmp_path / "ok.pt") as src:
            z.writestr("off/data/0", src.read("ok/data/0"))
    with pytest.raises(ss.CheckpointCorruptError, match="outside its storage"):
        ss.load(tmp_path / "off.pt")
    (tmp_path / "trunc.pt").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(ss.CheckpointError):
        ss.load(tmp_path / "trunc.pt")
    (tmp_path / "legacy.pt").write_bytes(pickle.dumps({"a": 1}))
    # a format statestream does not read, not damage (verify raises it, exit 2)
    with pytest.raises(ss.UnsupportedTypeError, match="legacy"):
        ss.load(tmp_path / "legacy.pt")


def test_a_zip_entry_name_that_is_not_utf8_is_a_corrupt_error(tmp_path: Path) -> None:
    """zipfile raises UnicodeDecodeError (and other non-BadZipFile errors) for damaged
    names and headers: every byte of the entries' names, in the local headers and the
    central directory, set to 0x80 or 0xff gives a result or a CheckpointError."""
    torch.save({"model": {"w": torch.arange(8.0)}, "step": 3}, tmp_path / "ok.pt")
    raw = (tmp_path / "ok.pt").read_bytes()
    spots = []
    for sig, head in ((b"PK\x03\x04", 30), (b"PK\x01\x02", 46)):
        at = raw.find(sig)
        while at >= 0:
            n = int.from_bytes(raw[at + head - (4 if head == 30 else 18):][:2], "little")
            spots += range(at + head, at + head + n)
            at = raw.find(sig, at + 4)
    assert len(spots) > 40
    outcomes = set()
    for off in spots:
        for byte in (0x80, 0xFF):
            bad = bytearray(raw)
            bad[off] = byte
            (tmp_path / "bad.pt").write_bytes(bytes(bad))
            try:
                ss.load(tmp_path / "bad.pt")
                outcomes.add("ok")
            except ss.CheckpointError as exc:
                outcomes.add(type(exc).__name__)
    assert "CheckpointCorruptError" in outcomes, outcomes


@pytest.mark.parametrize("field", [20, 24])  # compressed size, uncompressed size
def test_a_zip_entry_claiming_gigabytes_is_refused_before_it_is_read(tmp_path: Path,
                                                                     field: int) -> None:
    """zipfile asks for an entry's recorded size at once: a small torch.save file whose
    central directory says data.pkl holds 2 GiB would have it reserve 2 GiB (found by
    fuzzing, as a MemoryError under a 1 GiB address-space limit)."""
    import tracemalloc

    torch.save({"w": torch.arange(8.0)}, tmp_path / "ok.pt")
    raw = bytearray((tmp_path / "ok.pt").read_bytes())
    at = raw.find(b"PK\x01\x02")
    while not raw[at + 46:at + 46 + 40].split(b"/", 1)[-1].startswith(b"data.pkl"):
        at = raw.find(b"PK\x01\x02", at + 4)
    raw[at + field:at + field + 4] = (1 << 31).to_bytes(4, "little")
    (tmp_path / "big.pt").write_bytes(bytes(raw))
    tracemalloc.start()
    try:
        with pytest.raises(ss.CheckpointCorruptError, match="data.pkl"):
            ss.load(tmp_path / "big.pt")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, peak


def test_a_zip_version_zipfile_cannot_read_is_no_torch_file(tmp_path: Path) -> None:
    """zipfile raises NotImplementedError for a 'version needed to extract' it does not
    know (found by fuzzing): format detection says the file is no torch.save file."""
    torch.save({"w": torch.arange(8.0)}, tmp_path / "ok.pt")
    raw = bytearray((tmp_path / "ok.pt").read_bytes())
    at = raw.find(b"PK\x01\x02")
    raw[at + 6:at + 8] = (255).to_bytes(2, "little")
    (tmp_path / "v.pt").write_bytes(bytes(raw))
    with pytest.raises(ss.CheckpointError):
        ss.load(tmp_path / "v.pt")
    with pytest.raises(ss.CheckpointError):
        ss.metadata(tmp_path / "v.pt")


def test_non_contiguous_tensor_named(tmp_path: Path) -> None:
    torch.save({"t": torch.randn(4, 3).t()}, tmp_path / "t.pt")
    with pytest.raises(ss.UnsupportedTypeError, match="key path 't'.*non-contiguous"):
        ss.load(tmp_path / "t.pt")


def test_convert_torch_roundtrips_bit_exact(tmp_path: Path) -> None:
    state = _state()
    torch.save(state, tmp_path / "s.pt")
    ss.convert(tmp_path / "s.pt", tmp_path / "ck")
    ss.convert(tmp_path / "ck", tmp_path / "back.pt")
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    for i, dt in enumerate(DTYPES):
        t = back["model"][f"t{i}"]
        assert t.dtype == dt and _bits(t) == _bits(state["model"][f"t{i}"])
    assert _bits(back["param"]) == _bits(state["param"])
    assert back["opt"]["betas"] == (0.9, 0.99) and back["opt"]["step"] == 3
    mm = torch.load(tmp_path / "back.pt", weights_only=True, mmap=True)
    assert torch.equal(mm["model"]["t11"], state["model"]["t11"])  # type: ignore[index]
    with zipfile.ZipFile(tmp_path / "back.pt") as z:
        for info in z.infolist():
            if "/data/" in info.filename:
                name_len = len(info.filename.encode())
                with open(tmp_path / "back.pt", "rb") as f:
                    f.seek(info.header_offset + 28)
                    extra = int.from_bytes(f.read(2), "little")
                assert (info.header_offset + 30 + name_len + extra) % 64 == 0


def test_statestream_to_torch_and_safetensors_to_torch(tmp_path: Path) -> None:
    st = pytest.importorskip("safetensors.torch")
    t = {"a": torch.randn(3, 2).to(torch.bfloat16), "b": torch.arange(4)}
    st.save_file(t, tmp_path / "m.safetensors")
    ss.convert(tmp_path / "m.safetensors", tmp_path / "m.pt")
    back = torch.load(tmp_path / "m.pt", weights_only=True)
    assert all(torch.equal(back[k], t[k]) for k in t)
    ss.save(tmp_path / "ck", {"blob": b"xyz", "w": np.ones(2, np.float32)})
    ss.convert(tmp_path / "ck", tmp_path / "ck.pt")
    back = torch.load(tmp_path / "ck.pt", weights_only=True)
    assert back["blob"] == b"xyz" and back["w"].dtype == torch.float32


def test_missing_torch_names_the_extra_and_import_needs_only_numpy(tmp_path: Path) -> None:
    import subprocess
    import sys

    code = (
        "import sys\n"
        "for m in ('torch', 'jax', 'safetensors', 'orbax'): sys.modules[m] = None\n"
        "import numpy as np, statestream as ss\n"
        f"ss.save({str(tmp_path / 'ck')!r}, {{'w': np.ones(3)}})\n"
        f"ss.convert({str(tmp_path / 'ck')!r}, {str(tmp_path / 'x.safetensors')!r})\n"
        "try:\n"
        f"    ss.convert({str(tmp_path / 'ck')!r}, {str(tmp_path / 'x.pt')!r})\n"
        "except ImportError as e:\n"
        "    print('ERR', type(e).__name__, e)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    assert "ERR MissingDependencyError" in r.stdout and "statestream[torch]" in r.stdout
    assert not (tmp_path / "x.pt").exists()


def test_an_unrepresentable_builtin_is_named_not_called_foreign_code(tmp_path: Path) -> None:
    """torch.save writes protocol 2, naming builtins ``__builtin__.set``: that is the
    admitted builtins.set, so the error says what statestream cannot hold and where."""
    torch.save({"w": torch.zeros(2), "tags": {"a", "b"}}, tmp_path / "set.pt")
    with pytest.raises(ss.UnsupportedTypeError, match="'tags' holds a set"):
        ss.load(tmp_path / "set.pt")


def _unsupported_tensors() -> dict[str, tuple[object, str]]:
    """name -> (a tensor torch.load(weights_only=True) reads, what the error calls it)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ComplexHalf is experimental
        return {
            "sparse_coo": (torch.eye(2).to_sparse(), "a sparse tensor (torch.sparse_coo)"),
            "sparse_csr": (torch.eye(3).to_sparse_csr(), "a sparse tensor (torch.sparse_csr)"),
            "complex32": (torch.ones(2, dtype=torch.complex32),
                          "dtype complex32 is not supported"),
            "nested": (torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
                       "a nested tensor"),
            "meta": (torch.empty(2, device="meta"), "a meta tensor"),
            "quantized": (torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.quint8),
                          "a quantized tensor"),
        }


@pytest.mark.parametrize("kind", ["sparse_coo", "sparse_csr", "complex32", "nested", "meta",
                                  "quantized"])
@pytest.mark.parametrize("allow_pickle", [False, True])
def test_a_tensor_statestream_cannot_hold_is_named_not_foreign_code_nor_damage(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, allow_pickle: bool) -> None:
    """Without allow_pickle these were PickleNotAllowedError ('could run arbitrary code'),
    with it CheckpointCorruptError ('Could not infer dtype of TensorRef', 'complex32 is
    not a torch dtype'): torch's own rebuild functions are never called, even with
    allow_pickle; the error says what it is, the file and the key path."""
    tensor, what = _unsupported_tensors()[kind]
    path = tmp_path / f"{kind}.pt"
    torch.save({"w": torch.zeros(2), "layer": {"x": tensor}}, path)
    torch.load(path, weights_only=True)  # torch reads it: it is neither hostile nor damaged

    def called(*args: object) -> None:
        raise AssertionError("torch's rebuild function was called")

    for name in ("_rebuild_sparse_tensor", "_rebuild_nested_tensor", "_rebuild_qtensor",
                 "_rebuild_meta_tensor_no_storage"):
        monkeypatch.setattr(torch._utils, name, called)
    for call in (lambda: ss.load(path, allow_pickle=allow_pickle),
                 lambda: ss.verify(path, allow_pickle=allow_pickle),
                 lambda: ss.convert(path, tmp_path / "out", allow_pickle=allow_pickle)):
        with pytest.raises(ss.UnsupportedTypeError) as ei:
            call()
        msg = str(ei.value)
        assert what in msg and str(path) in msg and "layer/x" in msg, msg
    with pytest.raises(ss.UnsupportedTypeError, match=what.replace("(", r"\(").replace(")", r"\)")):
        ss.metadata(path)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("to", ["torch", "dcp"])
def test_a_numpy_scalar_converted_to_torch_becomes_a_0d_tensor(tmp_path: Path, to: str) -> None:
    """As docs/interop.md says: a torch file (or DCP item) holds a 0-d tensor, read back
    as a 0-d array without a target and as the NumPy scalar into one that holds it."""
    ss.save(tmp_path / "ck", {"u": np.uint16(5), "f": np.float32(1.5)})
    dst = tmp_path / ("c.pt" if to == "torch" else "d")
    ss.convert(tmp_path / "ck", dst, to=to)
    back = ss.load(dst)
    assert type(back["u"]) is np.ndarray and back["u"].shape == () and back["u"].dtype == np.uint16
    assert back["u"] == 5 and back["f"] == np.float32(1.5)
    got = ss.load(dst, target={"u": np.uint16(0), "f": np.float32(0)})
    assert type(got["u"]) is np.uint16 and got["u"] == 5 and type(got["f"]) is np.float32
    if to == "torch":
        t = torch.load(dst, weights_only=True)["u"]
        assert t.dtype == torch.uint16 and t.shape == () and int(t) == 5


@pytest.mark.parametrize("shape", [(1,) * 40, (0, 1 << 60)])
def test_a_shape_statestream_cannot_hold_is_refused_not_converted(
        tmp_path: Path, shape: tuple[int, ...]) -> None:
    """torch holds 40 dimensions, and an empty tensor of a dimension above 2**48: load
    returned the first (and convert wrote a checkpoint whose manifest load then refused),
    and failed on the second with NumPy's bare ValueError. Both are refused naming the
    key path and the file."""
    path = tmp_path / "big.pt"
    torch.save({"w": torch.zeros(2), "layer": {"x": torch.zeros(shape)}}, path)
    for call in (lambda: ss.load(path), lambda: ss.metadata(path),
                 lambda: ss.convert(path, tmp_path / "out")):
        with pytest.raises(ss.UnsupportedTypeError, match="outside statestream's limits") as ei:
            call()
        assert "'layer/x'" in str(ei.value) and str(path) in str(ei.value)
    assert not (tmp_path / "out").exists()


def test_a_v3_tensor_over_a_storage_statestream_cannot_hold_is_named(tmp_path: Path) -> None:
    """_rebuild_tensor_v3 names the tensor's dtype and the storage's class apart: a float32
    tensor over a QUInt8Storage raised a bare KeyError('quint8')."""
    import collections

    storage, tensor = object(), object()

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj: object) -> object:
            return ("storage", torch.QUInt8Storage, "0", "cpu", 8) if obj is storage else None

        def reducer_override(self, obj: object) -> object:
            if obj is not tensor:
                return NotImplemented
            return torch._utils._rebuild_tensor_v3, (
                storage, 0, (2,), (1,), False, collections.OrderedDict(), torch.float32)

    path = _write_pt(tmp_path / "q.pt", Pickler, {"layer": {"x": tensor}}, bytes(8))
    with pytest.raises(ss.UnsupportedTypeError, match="dtype quint8") as ei:
        ss.load(path)
    assert "'layer/x'" in str(ei.value) and str(path) in str(ei.value)


def test_a_key_statestream_cannot_hold_names_the_file(tmp_path: Path) -> None:
    """A dict key that is neither str nor int was refused naming the key path only."""
    path = tmp_path / "k.pt"
    torch.save({"layer": {(1, 2): torch.zeros(2)}}, path)
    with pytest.raises(ss.UnsupportedTypeError, match=r"key \(1, 2\) at key path 'layer'") as ei:
        ss.load(path)
    assert str(path) in str(ei.value)


def test_a_pickle_that_refers_to_one_list_over_and_over_is_refused(tmp_path: Path) -> None:
    """``x = [x] * 10`` five times is a pickle of about 140 bytes and a tree of 111111
    nodes (nine times: 10**9, and ``metadata`` ran out of memory): a state larger than
    its pickle could hold without such sharing is refused before it is built."""
    x: list[object] = [1]
    for _ in range(5):
        x = [x] * 10
    path = tmp_path / "laugh.pt"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", pickle.dumps({"a": x}, protocol=2))
    with pytest.raises(ss.CheckpointCorruptError, match="expands without bound") as ei:
        ss.metadata(path)
    assert str(path) in str(ei.value) and "key path 'a/" in str(ei.value)
    # sharing within what the pickle could hold is no damage: 10 * 10 * 2 nodes
    torch.save({"a": [[b"xy"] * 10] * 10}, path)
    assert ss.load(path) == {"a": [[b"xy"] * 10] * 10}


def test_a_bytes_value_referred_to_again_is_held_once(tmp_path: Path) -> None:
    """torch.save pickles a bytes value named twice once; the reader copied it into its
    in-memory file once per reference (3000 references to 64 KiB: 196 MB held for a
    100 KB file)."""
    from statestream.interop._torchfile import open_torch_file

    b = bytes(range(256)) * 256
    path = tmp_path / "b.pt"
    torch.save({"a": b, "l": [b] * 500}, path)
    reader, m = open_torch_file(str(path))
    reader.close()
    assert [f.size for f in m.files[1:]] == [len(b)]  # the one in-memory file: one copy
    out = ss.load(path)
    assert out["a"] == b and len(out["l"]) == 500 and all(v == b for v in out["l"])
    # each reference loads as a value of its own: 3000 of them (196 MB from a 171 KB
    # file) name the same bytes over and over (check_stored_bytes)
    torch.save({"a": b, "l": [b] * 3000}, path)
    with pytest.raises(ss.CheckpointCorruptError, match="the same bytes over and over"):
        open_torch_file(str(path))


def test_an_empty_slice_is_no_non_contiguous_view(tmp_path: Path) -> None:
    """An empty slice keeps its base's strides (``ones(2, 4)[:, :0]``: size (2, 0),
    stride (4, 1)); it was refused as a non-contiguous view, with advice to save
    ``.contiguous()``, which returns it unchanged (torch calls it contiguous)."""
    w = torch.ones(2, 4)[:, :0]
    assert w.is_contiguous() and w.stride() == (4, 1)
    path = tmp_path / "e.pt"
    torch.save({"w": w, "v": torch.arange(3.0)}, path)
    out = ss.load(path)
    assert out["w"].shape == (2, 0) and out["v"].tolist() == [0.0, 1.0, 2.0]
    ss.convert(path, tmp_path / "e.safetensors")
    assert ss.load(tmp_path / "e.safetensors")["w"].shape == (2, 0)


def test_a_zip_entry_header_before_the_archive_is_a_corrupt_error(tmp_path: Path) -> None:
    """A central directory whose recorded offset is too large makes zipfile place every
    local header earlier by as much: before byte 0 for the first entry, and reading it
    (or our own seek to it) was a bare OSError EINVAL naming no file."""
    import struct

    path = tmp_path / "m.pt"
    torch.save({"w": torch.arange(4.0)}, path)
    raw = bytearray(path.read_bytes())
    eocd = raw.rfind(b"PK\x06\x06")  # torch.save writes the zip64 end record
    (cd,) = struct.unpack_from("<Q", raw, eocd + 48)
    struct.pack_into("<Q", raw, eocd + 48, cd + 100_000)
    path.write_bytes(bytes(raw))
    for call in (ss.load, ss.metadata):
        with pytest.raises(ss.CheckpointCorruptError, match="outside the archive") as ei:
            call(path)
        assert str(path) in str(ei.value)


@pytest.mark.parametrize("to", ["torch", "dcp"])
def test_a_dtype_torch_lacks_is_refused_naming_its_key_path(tmp_path: Path, to: str) -> None:
    """float4_e2m1fn has no torch dtype: the error said only 'torch has no dtype
    float4_e2m1fn', not which array, nor before anything was claimed."""
    import ml_dtypes

    ss.save(tmp_path / "ck", {"m": {"q": np.zeros(4, ml_dtypes.float4_e2m1fn)},
                              "w": np.ones(2)})
    with pytest.raises(ss.UnsupportedTypeError, match=r"'m/q' \(float4_e2m1fn\)"):
        ss.convert(tmp_path / "ck", tmp_path / "out", to=to)
    assert not (tmp_path / "out").exists()


def test_damage_found_while_unpickling_names_the_file(tmp_path: Path) -> None:
    """A persistent id that is not a storage, or a refused text encoding, was reported
    without the file (the stand-ins that find them do not know it)."""
    import collections

    storage, tensor = object(), object()

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj: object) -> object:  # the key must be a str
            return ("storage", torch.FloatStorage, 5, "cpu", 4) if obj is storage else None

        def reducer_override(self, obj: object) -> object:
            if obj is not tensor:
                return NotImplemented
            return torch._utils._rebuild_tensor_v2, (
                storage, 0, (4,), (1,), False, collections.OrderedDict())

    path = _write_pt(tmp_path / "p.pt", Pickler, {"w": tensor}, bytes(16))
    with pytest.raises(ss.CheckpointCorruptError, match="is not a tensor storage") as ei:
        ss.load(path)
    assert str(path) in str(ei.value)
    # _codecs.encode(text, "cp037"): an encoding a weights-only load refuses
    pkl = (b"\x80\x02}q\x00X\x01\x00\x00\x00bq\x01c_codecs\nencode\nq\x02X\x01\x00\x00\x00aq"
           b"\x03X\x05\x00\x00\x00cp037q\x04\x86q\x05Rq\x06s.")
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", pkl)
    with pytest.raises(ss.PickleNotAllowedError, match="cp037") as ei2:
        ss.load(path)
    assert str(path) in str(ei2.value)


def test_views_naming_the_same_bytes_over_and_over_are_refused(tmp_path: Path) -> None:
    """600 views of one 1 MiB storage: a 1 MiB file that loaded as 600 MiB (each view an
    array of its own); a few views over the same bytes still load."""
    base = torch.arange(float(1 << 18))
    many = {f"v{i}": base[i:] for i in range(600)}
    torch.save(many, tmp_path / "many.pt")
    assert os.path.getsize(tmp_path / "many.pt") < 2 << 20
    with pytest.raises(ss.CheckpointCorruptError, match="the same bytes over and over"):
        ss.metadata(tmp_path / "many.pt")
    with pytest.raises(ss.CheckpointCorruptError, match="many.pt"):
        ss.load(tmp_path / "many.pt")
    few = {"w": base, "tail": base[7:], "head": base[:100]}
    torch.save(few, tmp_path / "few.pt")
    out = ss.load(tmp_path / "few.pt")
    assert np.array_equal(out["tail"], base[7:].numpy())
    assert np.array_equal(out["head"], base[:100].numpy())
