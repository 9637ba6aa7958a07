"""engine._recent: what this process committed is described without decoding its
manifest again, and only while that very manifest is committed (real local storage)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

import statestream as ss
from statestream.engine import committed_summary
from statestream.errors import UnsupportedTypeError
from statestream.format import COMMIT_NAME, MANIFEST_NAME


def _same_as_metadata(path: str) -> None:
    got = committed_summary(path)
    assert got is not None
    md = ss.metadata(path)
    assert (got.meta, got.total_bytes, list(got.bases)) == (md.meta, md.total_bytes, md.bases)


@pytest.mark.parametrize("kw", [{}, {"hashes": True}, {"compression": "zstd"},
                                {"meta": {"a": (1, 2), "b": {"c": [None, 1.5]}}}])
def test_the_summary_is_what_metadata_reads(tmp_path: Path, kw: dict) -> None:
    p = str(tmp_path / "c")
    ss.save(p, {"w": np.arange(1000.0), "x": np.ones((3, 4), np.int8), "step": 3}, **kw)
    _same_as_metadata(p)


def test_tied_arrays_and_other_kinds_are_summed_as_metadata_sums_them(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    w = torch.ones(8, 4)
    p = str(tmp_path / "c")
    ss.save(p, {"emb": w, "head": w, "view": w[2:], "t": torch.zeros(3, dtype=torch.int64),
                "np": np.ones((2, 2), np.float16), "b": b"bytes", "n": 1.5})
    _same_as_metadata(p)


def test_an_incremental_saves_bases_are_in_its_summary(tmp_path: Path) -> None:
    base, p = str(tmp_path / "base"), str(tmp_path / "next")
    frozen = np.random.default_rng(0).standard_normal(4096)
    ss.save(base, {"frozen": frozen, "lora": np.zeros(8)}, hashes=True)
    ss.save(p, {"frozen": frozen, "lora": np.ones(8)}, base=base)
    got = committed_summary(p)
    assert got is not None and got.bases == ("base",)
    _same_as_metadata(p)


def test_a_replaced_or_damaged_manifest_is_read_again(tmp_path: Path) -> None:
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    ss.save(a, {"w": np.zeros(10)}, meta={"who": "a"})
    ss.save(b, {"w": np.zeros(10)}, meta={"who": "b"})
    for name in (MANIFEST_NAME, COMMIT_NAME):  # another writer's checkpoint now at a
        shutil.copyfile(os.path.join(b, name), os.path.join(a, name))
    assert committed_summary(a) is None
    assert ss.metadata(a).meta["user"] == {"who": "b"}
    with open(os.path.join(b, MANIFEST_NAME), "r+b") as f:  # damaged after the commit
        f.seek(10)
        c = f.read(1)
        f.seek(10)
        f.write(bytes([c[0] ^ 1]))
    assert committed_summary(b) is None
    with pytest.raises(ss.CheckpointCorruptError):
        ss.metadata(b)


def test_a_checkpoint_removed_or_never_committed_here_has_none(tmp_path: Path) -> None:
    p = str(tmp_path / "c")
    ss.save(p, {"w": np.zeros(3)})
    shutil.rmtree(p)
    assert committed_summary(p) is None
    assert committed_summary(str(tmp_path / "never")) is None


def test_the_caller_gets_its_own_copy_of_meta(tmp_path: Path) -> None:
    p = str(tmp_path / "c")
    ss.save(p, {"w": np.zeros(3)}, meta={"m": {"loss": 1.0}})
    got = committed_summary(p)
    assert got is not None
    got.meta["user"]["m"]["loss"] = 2.0
    again = committed_summary(p)
    assert again is not None and again.meta["user"]["m"]["loss"] == 1.0


def _nested(levels: int) -> dict:
    """A meta mapping of ``levels`` levels of dicts and lists (the mapping is one)."""
    v: object = 1
    for _ in range(levels - 1):
        v = [v]
    return {"deep": v}


@pytest.mark.parametrize("lazy", [None, False, True])
def test_meta_nested_too_deep_is_refused_before_anything_is_written(
        tmp_path: Path, lazy: bool | None) -> None:
    """JSON holds meta nested 600 deep, but the summary kept after the commit copies it
    by recursion: such a save committed, then raised RecursionError. It is refused at
    once now, and 64 levels still save and read back."""
    p = tmp_path / "c"
    for levels in (65, 600):
        with pytest.raises(UnsupportedTypeError, match=f"meta nests {levels} levels.*within 64"):
            if lazy is None:
                ss.save(p, {"w": np.zeros(3)}, meta=_nested(levels))
            else:
                ss.save_async(p, {"w": np.zeros(3)}, meta=_nested(levels), lazy=lazy).result()
        assert not p.exists()
    ss.save(p, {"w": np.zeros(3)}, meta=_nested(64))
    assert ss.metadata(p).meta["user"] == _nested(64)
    got = committed_summary(str(p))
    assert got is not None and got.meta["user"] == _nested(64)
