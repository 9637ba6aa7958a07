"""``convert(..., compression=...)``: imported checkpoints compressed as a save would be."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import statestream as ss
from statestream.cli import main

safetensors_np = pytest.importorskip("safetensors.numpy")


def _tensors() -> dict[str, np.ndarray]:
    g = np.random.default_rng(0)
    return {
        "model.w": np.tile(np.linspace(0, 1, 512, dtype=np.float32), (256, 1)),  # compressible
        "model.noise": g.integers(0, 256, size=200_000, dtype=np.uint8),  # does not pay
        "head.b": np.zeros((64, 64), np.float64),
    }


def _stored_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in (path / "data").iterdir())


def _check(got: dict[str, Any], want: dict[str, np.ndarray]) -> None:
    assert set(got) == set(want)
    for k, v in want.items():
        np.testing.assert_array_equal(got[k], v, err_msg=k)
        assert got[k].dtype == v.dtype


@pytest.mark.parametrize("budget", [None, 256 << 10], ids=["one-slab", "many-slabs"])
def test_a_safetensors_import_is_compressed(tmp_path: Path, budget: int | None) -> None:
    src = tmp_path / "m.safetensors"
    safetensors_np.save_file(_tensors(), str(src))
    memory = ss.MemoryOptions(memory_budget_bytes=budget) if budget else None
    raw = Path(ss.convert(src, tmp_path / "raw", memory=memory))
    packed = Path(ss.convert(src, tmp_path / "zstd", compression="zstd", memory=memory))
    for out in (raw, packed):
        assert ss.verify(str(out)).ok
        _check(ss.load(out), _tensors())
    md = ss.metadata(packed).tree
    assert md["model.w"].codec == md["head.b"].codec == "zstd"
    assert md["model.noise"].codec is None  # stored raw: compressing it does not pay
    assert md["model.w"].stored_bytes < md["model.w"].nbytes // 4
    assert _stored_bytes(packed) < _stored_bytes(raw) * 0.6
    if budget:  # several slabs per array, each its own compressed chunk
        assert md["model.w"].num_chunks > 1
        part = ss.load(packed, items=["model.w"])
        np.testing.assert_array_equal(part["model.w"], _tensors()["model.w"])


def test_compression_patterns_choose_arrays(tmp_path: Path) -> None:
    src = tmp_path / "m.safetensors"
    safetensors_np.save_file(_tensors(), str(src))
    out = Path(ss.convert(src, tmp_path / "ck", compression={"model.w": "zstd"}))
    md = ss.metadata(out).tree
    assert md["model.w"].codec == "zstd" and md["head.b"].codec is None
    _check(ss.load(out), _tensors())


def test_a_compressed_checkpoint_converts_back_to_raw(tmp_path: Path) -> None:
    state = {"w": np.zeros((300, 300), np.float32), "step": 3}
    ss.save(tmp_path / "a", state, compression="zstd")
    assert ss.metadata(tmp_path / "a").tree["w"].codec == "zstd"
    ss.convert(tmp_path / "a", tmp_path / "b")
    assert ss.metadata(tmp_path / "b").tree["w"].codec is None
    got = ss.load(tmp_path / "b")
    np.testing.assert_array_equal(got["w"], state["w"])
    assert got["step"] == 3


def test_compression_is_refused_for_other_formats(tmp_path: Path) -> None:
    ss.save(tmp_path / "a", {"w": np.zeros(10, np.float32)})
    with pytest.raises(ss.InvalidOptionError, match="compresses statestream checkpoints"):
        ss.convert(tmp_path / "a", tmp_path / "w.safetensors", compression="zstd")
    assert not (tmp_path / "w.safetensors").exists()


def test_the_cli_compresses(tmp_path: Path) -> None:
    src = tmp_path / "m.safetensors"
    safetensors_np.save_file(_tensors(), str(src))
    assert main(["convert", str(src), str(tmp_path / "ck"), "--compression", "zstd"]) == 0
    assert ss.metadata(tmp_path / "ck").tree["model.w"].codec == "zstd"
    _check(ss.load(tmp_path / "ck"), _tensors())


def test_compressed_chunks_are_at_most_4_mib_as_in_a_save(tmp_path: Path) -> None:
    w = np.tile(np.arange(1024, dtype=np.float32), (3 * 1024, 1))  # 12 MiB, one slab
    ss.save(tmp_path / "a", {"w": w})
    ss.convert(tmp_path / "a", tmp_path / "b", compression="zstd")
    md = ss.metadata(tmp_path / "b").tree["w"]
    assert md.num_chunks == 3 and md.codec == "zstd"
    ss.save(tmp_path / "c", {"w": w}, compression="zstd")  # what a save makes of it
    assert ss.metadata(tmp_path / "c").tree["w"].num_chunks == md.num_chunks
    np.testing.assert_array_equal(ss.load(tmp_path / "b")["w"], w)
    assert ss.verify(str(tmp_path / "b")).ok
