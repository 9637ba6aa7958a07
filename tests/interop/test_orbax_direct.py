"""A whole Orbax storage chunk read straight into its destination (interop/_orbax_direct.py):
a load holds the result and the compressed chunk, not tensorstore's decoded copy as well."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

import statestream as ss

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _peak import peak_growth  # noqa: E402


def _save(path: Path, state: dict) -> None:
    ocp = pytest.importorskip("orbax.checkpoint")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ocp.PyTreeCheckpointer().save(path, state)


def test_loading_one_large_chunk_holds_it_once(tmp_path: Path) -> None:
    n = 32 << 20  # 128 MiB of float32, one zstd storage chunk (orbax's default)
    # random values: the compressed chunk is about as large as the array
    w = np.random.default_rng(0).standard_normal(n, dtype=np.float32)
    _save(tmp_path / "o", {"w": w})
    np.save(tmp_path / "sample.npy", w[::4099])
    del w
    _save(tmp_path / "small", {"w": np.arange(1024, dtype=np.float32)})
    warm = "import statestream as ss; ss.load(argv[1])"
    work = ("import numpy as np; out = ss.load(argv[0])['w']; "
            f"assert out.dtype == np.float32 and out.shape == ({n},); "
            "assert np.array_equal(out[::4099], np.load(argv[2]))")
    growth = peak_growth(warm, work, str(tmp_path / "o"), str(tmp_path / "small"),
                         str(tmp_path / "sample.npy"))
    # the result is 128 MiB, and the compressed chunk is read in 4 MiB ranges; through
    # tensorstore its decoded copy came on top (~256 MiB), and read whole the compressed
    # chunk and the client's copy of it did (~354 MiB)
    assert growth < (n * 4) * 3 // 2, f"peak RSS grew by {growth >> 20} MiB loading 128 MiB"


@pytest.mark.parametrize("shape", [(3,), (5, 7), (2, 3, 4)])
def test_direct_reads_are_exact(tmp_path: Path, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(0)
    state = {"a": rng.standard_normal(shape).astype(np.float32),
             "b": rng.integers(0, 100, shape, dtype=np.int64),
             "c": rng.integers(0, 2, shape).astype(bool)}
    _save(tmp_path / "o", state)
    out = ss.load(tmp_path / "o")
    for k, v in state.items():
        assert out[k].dtype == v.dtype and np.array_equal(out[k], v), k


def test_a_damaged_chunk_is_reported(tmp_path: Path) -> None:
    ts = pytest.importorskip("tensorstore")
    _save(tmp_path / "o", {"w": np.arange(4096, dtype=np.float32)})
    from statestream.interop._orbax_direct import read_chunk_direct

    spec = {"driver": "zarr", "kvstore": {"driver": "memory"},
            "metadata": {"dtype": "<f4", "shape": [4096], "chunks": [4096],
                         "compressor": {"id": "zstd"}}}
    store = ts.open(spec, create=True).result()
    store.write(np.arange(4096, dtype=np.float32)).result()
    frame = store.kvstore.read("0").result().value
    store.kvstore.write("0", frame[:-8]).result()  # cut short
    view = memoryview(bytearray(4096 * 4))
    with pytest.raises(Exception, match="chunk '0'|zstd|frame|corrupt"):
        read_chunk_direct(store, (0,), (4096,), np.dtype(np.float32), view, "w")
    store.kvstore.write("0", frame).result()
    assert read_chunk_direct(store, (0,), (4096,), np.dtype(np.float32), view, "w")
    assert np.array_equal(np.frombuffer(view, np.float32), np.arange(4096, dtype=np.float32))


def test_bfloat16_and_float16_arrays_still_load(tmp_path: Path) -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes")
    state = {"h": np.arange(12, dtype=np.float32).astype(ml_dtypes.bfloat16),
             "f16": np.arange(12, dtype=np.float16).reshape(3, 4)}
    _save(tmp_path / "o", state)
    out = ss.load(tmp_path / "o")
    for k, v in state.items():
        assert out[k].dtype == v.dtype and np.array_equal(out[k], v), k


@pytest.mark.parametrize("sep", [".", "/", "/../../", "\\", "", None, 3])
def test_a_chunk_key_is_built_only_with_zarrs_separators(sep: object) -> None:
    """The key of a chunk read straight from the store joins its indices with the
    array's ``dimension_separator``: only zarr v2's '.' and '/' are used (any other,
    such as '/../../' from a hostile .zarray, goes through tensorstore, which refuses
    it), so the key never names a file outside the array."""
    from statestream.interop._orbax_direct import _chunk_key

    meta = {"zarr_format": 2, "order": "C", "compressor": None, "dtype": "<f4",
            "chunks": [2, 2], "shape": [4, 4], "dimension_separator": sep}
    key = _chunk_key(meta, (2, 0), (2, 2), np.dtype("<f4"))
    assert key == (f"1{sep}0" if sep in (".", "/") else None)
