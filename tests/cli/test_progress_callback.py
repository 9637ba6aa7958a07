"""The ``progress`` callback of save, save_async, load and convert never reports
more done than total, and ends at done == total (issue 11: 100,794,472 of 100,761,704)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import statestream as ss


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []
        self._lock = threading.Lock()

    def __call__(self, done: int, total: int) -> None:
        with self._lock:
            self.calls.append((done, total))

    def check(self) -> None:
        assert self.calls, "progress was never called"
        for done, total in self.calls:
            assert 0 <= done <= total, (done, total)
        done, total = max(self.calls)
        assert done == total, (done, total)


def _state() -> dict[str, Any]:
    rng = np.random.default_rng(0)
    return {
        # sizes that are not multiples of any chunk or alignment size
        "a": rng.standard_normal((1000, 37)).astype(np.float32),
        "b": rng.integers(0, 255, size=(300_001,), dtype=np.uint8),
        "c": rng.standard_normal((17, 129)).astype(np.float64),
        "step": 5,
    }


SMALL = ss.IOOptions(max_chunk_bytes=4096, max_request_bytes=10_000)


@pytest.fixture()
def saved(tmp_path: Path) -> Path:
    path = tmp_path / "ck"
    ss.save(path, _state(), io=SMALL)
    return path


def test_save(tmp_path: Path) -> None:
    rec = Recorder()
    ss.save(tmp_path / "s", _state(), io=SMALL, progress=rec)
    rec.check()


def test_save_async(tmp_path: Path) -> None:
    rec = Recorder()
    ss.save_async(tmp_path / "s", _state(), io=SMALL, progress=rec).result()
    rec.check()


def _targets() -> dict[str, Callable[[], Any]]:
    def like() -> Any:
        return {k: (np.zeros_like(v) if isinstance(v, np.ndarray) else v)
                for k, v in _state().items()}
    return {"none": lambda: None, "target": like}


@pytest.mark.parametrize("target", ["none", "target", "in_place"])
def test_load(saved: Path, target: str) -> None:
    rec = Recorder()
    if target == "none":
        ss.load(saved, progress=rec)
    else:
        t = _targets()["target"]()
        ss.load(saved, target=t, in_place=(target == "in_place"), progress=rec)
    rec.check()


@pytest.mark.parametrize("dst", ["out.safetensors", "out-ss"])
def test_convert(saved: Path, tmp_path: Path, dst: str) -> None:
    rec = Recorder()
    src = saved
    if dst == "out.safetensors":
        ss.convert(saved, tmp_path / "x.safetensors", items=None)
        src = tmp_path / "x.safetensors"
    kw: dict[str, Any] = {}
    ss.convert(src, tmp_path / dst, progress=rec, **kw)
    rec.check()


def _tied_model() -> Any:
    torch = pytest.importorskip("torch")
    emb = torch.nn.Embedding(64, 32)
    lin = torch.nn.Linear(32, 64, bias=True)
    lin.weight = emb.weight  # tied: saved once, as an alias
    return torch.nn.Sequential(emb, lin)


@pytest.mark.parametrize("dst", ["out.pt", "out.safetensors", "out-ss"])
def test_convert_with_tied_weights(tmp_path: Path, dst: str) -> None:
    """An alias lists its array twice in the conversion plan; writers that read it once
    (torch, safetensors) used to end at done == total / 2 of the tied bytes."""
    ss.save(tmp_path / "ck", {"model": _tied_model(), "x": np.ones(100)}, io=SMALL)
    rec = Recorder()
    ss.convert(tmp_path / "ck", tmp_path / dst, items=["model"], progress=rec)
    rec.check()
    assert rec.calls[-1][1] == (64 * 32 + 64) * 4  # the tied weight counted once


def test_save_and_load_with_tied_weights(tmp_path: Path) -> None:
    model = _tied_model()
    rec = Recorder()
    ss.save(tmp_path / "ck", {"model": model}, io=SMALL, progress=rec)
    rec.check()
    for kw in ({}, {"target": {"model": model}}, {"target": {"model": model}, "in_place": True}):
        rec = Recorder()
        ss.load(tmp_path / "ck", progress=rec, **kw)
        rec.check()
