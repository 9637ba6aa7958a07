"""Loads that map arrays' file bytes (private, copy-on-write) instead of reading them."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import statestream as ss
from statestream.errors import ChecksumMismatchError, TruncatedFileError


def _mapped_file(arr: np.ndarray) -> str | None:
    """The file whose mapping holds ``arr``'s first byte (None: anonymous memory)."""
    addr = arr.__array_interface__["data"][0]
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= addr < hi:
                return parts[5] if len(parts) > 5 else None
    return None


def _state() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"big": rng.standard_normal((512, 1024)).astype(np.float32),  # 2 MiB
            "small": np.arange(10, dtype=np.int64)}


@pytest.fixture()
def ckpt(tmp_path: Path) -> Path:
    d = tmp_path / "ck"
    ss.save(d, _state())
    return d


def _in_data(arr: np.ndarray, ckpt: Path) -> bool:
    return (_mapped_file(arr) or "").startswith(str(ckpt / "data"))


def test_large_and_small_arrays_are_mapped(ckpt: Path) -> None:
    out = ss.load(ckpt)
    want = _state()
    for k, v in want.items():
        np.testing.assert_array_equal(out[k], v)
        assert _in_data(out[k], ckpt), k


def test_small_mapped_arrays_are_private_copies(ckpt: Path) -> None:
    out = ss.load(ckpt)
    out["small"][:] = -3
    np.testing.assert_array_equal(ss.load(ckpt)["small"], _state()["small"])


def test_mapped_arrays_are_private_copies(ckpt: Path) -> None:
    out = ss.load(ckpt)
    out["big"][:] = 7  # copy-on-write: the file keeps its bytes
    again = ss.load(ckpt)
    np.testing.assert_array_equal(again["big"], _state()["big"])


def test_map_files_off_reads_into_fresh_memory(ckpt: Path) -> None:
    out = ss.load(ckpt, io=ss.IOOptions(map_files=False))
    for k, v in _state().items():
        np.testing.assert_array_equal(out[k], v)
        assert not _in_data(out[k], ckpt), k


def _flip(ckpt: Path, at: int) -> None:
    (f,) = sorted((ckpt / "data").iterdir())
    with open(f, "r+b") as fh:
        fh.seek(at)
        b = fh.read(1)
        fh.seek(at)
        fh.write(bytes([b[0] ^ 1]))


def test_mapped_arrays_are_verified(ckpt: Path) -> None:
    _flip(ckpt, 1 << 20)  # inside "big"
    with pytest.raises(ChecksumMismatchError, match="'big'"):
        ss.load(ckpt)


def test_short_file_is_refused_before_mapping(ckpt: Path) -> None:
    (f,) = sorted((ckpt / "data").iterdir())
    os.truncate(f, 1 << 20)
    with pytest.raises(TruncatedFileError, match="'big'"):
        ss.load(ckpt)


def _offset_of(ckpt: Path, arr: np.ndarray) -> int:
    """Where ``arr``'s bytes lie in the checkpoint's (only) data file."""
    (f,) = sorted((ckpt / "data").iterdir())
    at = f.read_bytes().find(arr.tobytes())
    assert at >= 0
    return at


def test_small_mapped_arrays_are_verified(ckpt: Path) -> None:
    _flip(ckpt, _offset_of(ckpt, _state()["small"]) + 3)
    with pytest.raises(ChecksumMismatchError, match="'small'"):
        ss.load(ckpt)
    with pytest.raises(ChecksumMismatchError, match="'small'"):
        ss.load(ckpt, target={"small": np.zeros(10, np.int64)}, items=["small"])


def test_a_file_short_of_a_small_array_is_refused_with_its_key_path(tmp_path: Path) -> None:
    # small arrays only, so the first array past the end is a small, mapped one
    state = {f"a{i}": np.full(100, i, np.int32) for i in range(20)}
    ss.save(tmp_path / "c", state)
    (f,) = sorted((tmp_path / "c" / "data").iterdir())
    last = max(state, key=lambda k: _offset_of(tmp_path / "c", state[k]))
    os.truncate(f, _offset_of(tmp_path / "c", state[last]) + 10)
    with pytest.raises(TruncatedFileError, match=f"'{last}'"):
        ss.load(tmp_path / "c")
    with pytest.raises(TruncatedFileError, match=f"'{last}'"):
        ss.load(tmp_path / "c", target={k: np.zeros_like(v) for k, v in state.items()})


def test_torch_targets_get_mapped_tensors(ckpt: Path) -> None:
    torch = pytest.importorskip("torch")
    like = {"big": torch.empty(512, 1024), "small": torch.empty(10, dtype=torch.int64)}
    out = ss.load(ckpt, target=like)
    assert torch.equal(out["big"], torch.from_numpy(_state()["big"]))
    assert torch.equal(out["small"], torch.from_numpy(_state()["small"]))
    for k in like:
        assert out[k] is not like[k]
        assert _in_data(out[k].numpy(), ckpt), k
    out["small"][0] = 99  # copy-on-write
    assert ss.load(ckpt, target=like)["small"][0] == 0
    # a Parameter takes the general path: mapped when large, read when small
    params = {"big": torch.nn.Parameter(torch.empty(512, 1024)),
              "small": torch.nn.Parameter(torch.empty(10), requires_grad=False)}
    got = ss.load(ckpt, target={"big": params["big"]}, items=["big"])
    assert isinstance(got["big"], torch.nn.Parameter)
    assert torch.equal(got["big"].detach(), torch.from_numpy(_state()["big"]))
    # in place: the target's own memory, never a mapping
    got = ss.load(ckpt, target=like, in_place=True)
    for k in like:
        assert got[k] is like[k]
        assert torch.equal(like[k], torch.from_numpy(_state()[k]))


def test_compressed_arrays_are_read_and_referenced_ones_map_their_base(tmp_path: Path) -> None:
    # A compressed chunk's file bytes are not the array's: read and decoded, not mapped.
    # A referenced chunk's bytes lie in its base's data file: mapped from there.
    big = np.tile(np.arange(1024, dtype=np.float32), (1024, 1))  # 4 MiB, compressible
    state = {"big": big, "other": np.ones((512, 1024), np.float32)}
    ss.save(tmp_path / "z", state, compression="zstd")
    assert ss.metadata(tmp_path / "z").tree["big"].codec is not None
    got = ss.load(tmp_path / "z")
    np.testing.assert_array_equal(got["big"], big)
    assert not (_mapped_file(got["big"]) or "").startswith("/")  # anonymous or [heap]
    ss.save(tmp_path / "s1", state, hashes=True)
    changed = {"big": big, "other": state["other"] * 2}
    ss.save(tmp_path / "s2", changed, base=tmp_path / "s1")
    assert ss.metadata(tmp_path / "s2").bases == ["s1"]
    got = ss.load(tmp_path / "s2")
    np.testing.assert_array_equal(got["big"], big)
    np.testing.assert_array_equal(got["other"], changed["other"])
    assert (_mapped_file(got["big"]) or "").startswith(str(tmp_path / "s1" / "data"))
    assert (_mapped_file(got["other"]) or "").startswith(str(tmp_path / "s2" / "data"))
    got["big"][0, 0] = -1  # copy-on-write: the base's file never changes
    np.testing.assert_array_equal(ss.load(tmp_path / "s2")["big"], big)
    np.testing.assert_array_equal(ss.load(tmp_path / "s1")["big"], big)


# ----------------------------------------------------------------------------- several files

def _spread_state() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    # 64 MiB + one 2 KiB row: 1 MiB row blocks, a new file every 16 MiB (4 files, then
    # the first again), the last block not a whole number of pages
    return {"wide": rng.standard_normal((32769, 512)).astype(np.float32),
            "small": np.arange(5, dtype=np.int16)}


@pytest.fixture()
def spread(tmp_path: Path) -> Path:
    d = tmp_path / "spread"
    ss.save(d, _spread_state(), io=ss.IOOptions(max_chunk_bytes=1 << 20, num_threads=4))
    return d


def _files_of(ckpt: Path, key: str) -> set[int]:
    import json

    doc = json.loads((ckpt / "manifest.json").read_bytes())
    node = doc["tree"]["c"][doc["tree"]["k"].index(key)]
    return {c[0] for c in doc["arrays"][node["a"]]["chunks"]}


def _spans(arr: np.ndarray) -> list[str]:
    """The files mapped over ``arr``'s bytes, in address order (one entry per mapping)."""
    lo = arr.__array_interface__["data"][0]
    hi = lo + arr.nbytes
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            a, b = (int(x, 16) for x in parts[0].split("-"))
            if a < hi and b > lo:
                out.append(parts[5] if len(parts) > 5 else "")
    return out


def test_an_array_spread_over_several_files_is_mapped(spread: Path) -> None:
    assert _files_of(spread, "wide") == {0, 1, 2, 3}  # the save spread its row blocks
    out = ss.load(spread)
    want = _spread_state()
    for k, v in want.items():
        np.testing.assert_array_equal(out[k], v)
    files = _spans(out["wide"])
    assert len(files) >= 4 and all(f.startswith(str(spread / "data")) for f in files)
    assert len(set(files)) == 4  # one region, made of every file's ranges


def test_a_spread_mapping_is_private_and_outlives_the_load(spread: Path) -> None:
    out = ss.load(spread)
    wide = out.pop("wide")
    view = wide[1500:]
    del out, wide
    import gc

    gc.collect()
    view[:] = 3  # copy-on-write: still mapped, the files keep their bytes
    np.testing.assert_array_equal(ss.load(spread)["wide"], _spread_state()["wide"])


def test_a_spread_mapping_is_unmapped_with_its_last_array(spread: Path) -> None:
    out = ss.load(spread)
    lo = out["wide"].__array_interface__["data"][0]
    del out
    import gc

    gc.collect()
    with open("/proc/self/maps") as f:
        starts = {int(line.split("-")[0], 16) for line in f}
    assert lo not in starts


def test_a_spread_array_is_verified_and_a_short_file_refused(spread: Path) -> None:
    files = sorted((spread / "data").iterdir())
    with open(files[2], "r+b") as fh:  # a byte of a later file's block of "wide"
        fh.seek(100)
        b = fh.read(1)
        fh.seek(100)
        fh.write(bytes([b[0] ^ 1]))
    with pytest.raises(ChecksumMismatchError, match="'wide'"):
        ss.load(spread)
    os.truncate(files[3], 4096)
    with pytest.raises(TruncatedFileError):
        ss.load(spread)


def test_compose_checks_alignment_and_places_ranges(tmp_path: Path) -> None:
    from statestream.storage._compose import PAGE, compose

    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(b"A" * PAGE * 3)
    b.write_bytes(b"B" * PAGE + b"b" * 10)
    fa, fb = os.open(a, os.O_RDONLY), os.open(b, os.O_RDONLY)
    try:
        with pytest.raises(ValueError, match="page"):
            compose([(fa, 10, PAGE), (fb, 0, PAGE)])
        with pytest.raises(ValueError, match="page"):
            compose([(fa, 0, PAGE + 1), (fb, 0, PAGE)])
        view = compose([(fa, PAGE, PAGE * 2), (fb, PAGE, 10)])
    finally:
        os.close(fa)
        os.close(fb)
    assert view is not None
    assert bytes(view) == b"A" * PAGE * 2 + b"b" * 10
    view[0:1] = b"Z"  # private: the file is unchanged
    assert a.read_bytes() == b"A" * PAGE * 3


def test_where_ranges_cannot_be_composed_the_array_is_read(
        spread: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import platform

    monkeypatch.setattr(platform, "machine", lambda: "alpha")  # MAP_FIXED is not 0x10 there
    out = ss.load(spread)
    np.testing.assert_array_equal(out["wide"], _spread_state()["wide"])
    assert not any(f.startswith(str(spread / "data")) for f in _spans(out["wide"]))


def test_an_array_split_between_a_checkpoint_and_its_base_is_read(tmp_path: Path) -> None:
    """Row blocks in the checkpoint's own files and in its base's cannot be one mapping:
    such an array is read (and still exact); one wholly in the base is mapped from it."""
    io = ss.IOOptions(max_chunk_bytes=1 << 20, num_threads=4)
    state = _spread_state()
    ss.save(tmp_path / "s1", state, io=io, hashes=True)
    changed = {**state, "wide": state["wide"].copy()}
    changed["wide"][:8] += 1  # one row block changes, the others are referenced
    ss.save(tmp_path / "s2", changed, io=io, base=tmp_path / "s1")
    got = ss.load(tmp_path / "s2")
    np.testing.assert_array_equal(got["wide"], changed["wide"])
    np.testing.assert_array_equal(got["small"], state["small"])
    assert not (_mapped_file(got["wide"]) or "").startswith("/")  # read into memory
    again = ss.load(tmp_path / "s2", io=ss.IOOptions(drop_behind=True))
    np.testing.assert_array_equal(again["wide"], changed["wide"])


def test_a_provider_that_ignores_the_mapping_still_gets_its_bytes(
        ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the piece is verify-only only when the value really is on the mapping
    from statestream.providers.numpy import NumpyProvider

    orig = NumpyProvider.restore_flat

    def fresh(self: NumpyProvider, dtype: str, shape: tuple[int, ...], nbytes: int,
              like: object, in_place: bool, memory: object = None) -> object:
        got = orig(self, dtype, shape, nbytes, like, in_place, None)
        if got is not None:
            got[0].fill(0x5A)  # fresh memory that happens to hold the bytes proves nothing
        return got

    monkeypatch.setattr(NumpyProvider, "restore_flat", fresh)
    out = ss.load(ckpt)
    for k, v in _state().items():
        np.testing.assert_array_equal(out[k], v)
    assert not _in_data(out["small"], ckpt)


def test_state_an_object_keeps_is_read_not_mapped(tmp_path: Path) -> None:
    # An optimizer keeps the loaded tensors as its state, and its next step writes every
    # one: a private mapping would fault and copy each page then (slower than reading).
    # A module copies into its own parameters: its source may be mapped (nothing kept).
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 512)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 1024)).sum().backward()
    opt.step()
    ss.save(tmp_path / "c", {"model": model, "opt": opt})
    model2 = torch.nn.Linear(1024, 512)
    opt2 = torch.optim.Adam(model2.parameters())
    seen: list[object] = []
    orig = torch.nn.Module.load_state_dict

    def spy(self, state, *a, **k):  # what the module was handed
        seen.extend(v for v in state.values() if v.numel() > 1024)
        return orig(self, state, *a, **k)

    torch.nn.Module.load_state_dict = spy
    try:
        ss.load(tmp_path / "c", {"model": model2, "opt": opt2})
    finally:
        torch.nn.Module.load_state_dict = orig
    assert seen and all(_in_data(t.numpy(), tmp_path / "c") for t in seen)
    moments = [v for st in opt2.state.values() for v in st.values() if v.numel() > 1024]
    assert len(moments) == 2
    for v in moments:
        assert not _in_data(v.numpy(), tmp_path / "c")
        assert torch.equal(v, next(w for st in opt.state.values() for w in st.values()
                                   if w.shape == v.shape and torch.equal(w, v)))
    # a module on the meta device loads with assign=True and keeps the tensors: read
    with torch.device("meta"):
        meta = torch.nn.Linear(1024, 512)
    ss.load(tmp_path / "c", {"model": meta}, items=["model"])
    assert not _in_data(meta.weight.detach().numpy(), tmp_path / "c")
    assert torch.equal(meta.weight, model.weight)
