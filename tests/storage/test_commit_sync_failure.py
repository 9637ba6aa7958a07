"""A local commit whose last step fails (syncing the parent directory after the rename)
commits nothing: the save raises, the path holds what it held before (the replaced
checkpoint with ``overwrite=True``), and no staging directory is left behind. Before,
the new checkpoint stayed published, and an overwrite had already deleted the old one,
under an error saying the commit failed."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import statestream as ss
from statestream.errors import StorageError
from statestream.storage import _local


def _failing_parent_sync(monkeypatch: pytest.MonkeyPatch, parent: Path,
                         exc: BaseException | None = None) -> list[str]:
    """Make fsync of ``parent`` (only) fail; returns the directories synced."""
    real = _local.fsync_dir
    seen: list[str] = []

    def fsync_dir(path: str) -> None:
        seen.append(path)
        if os.path.realpath(path) == os.path.realpath(parent):
            raise exc if exc is not None else OSError(errno.EIO, "injected", path)
        real(path)

    monkeypatch.setattr(_local, "fsync_dir", fsync_dir)
    return seen


def _leftovers(parent: Path) -> list[str]:
    return sorted(n for n in os.listdir(parent) if n.startswith("."))


def _save(path: Path, state: dict[str, Any], how: str, overwrite: bool) -> None:
    if how == "sync":
        ss.save(path, state, overwrite=overwrite)
    else:
        ss.save_async(path, state, overwrite=overwrite, lazy=how == "lazy").result()


@pytest.mark.parametrize("how", ["sync", "async", "lazy"])
def test_a_new_checkpoint_is_not_left_published(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 how: str) -> None:
    p = tmp_path / "ckpt"
    seen = _failing_parent_sync(monkeypatch, tmp_path)
    with pytest.raises(StorageError, match="committing .*ckpt failed.*injected"):
        _save(p, {"w": np.arange(8)}, how, overwrite=False)
    assert any(os.path.realpath(s) == os.path.realpath(tmp_path) for s in seen)
    assert not os.path.lexists(p)
    assert _leftovers(tmp_path) == []
    monkeypatch.undo()  # the file system works again: the same save commits
    _save(p, {"w": np.arange(8)}, how, overwrite=False)
    np.testing.assert_array_equal(ss.load(p)["w"], np.arange(8))


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "rename"])
@pytest.mark.parametrize("how", ["sync", "async"])
def test_an_overwrite_keeps_the_checkpoint_it_would_replace(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str, exchange: bool) -> None:
    p = tmp_path / "ckpt"
    ss.save(p, {"w": np.zeros(8)})
    if not exchange:  # the fallback: the old one renamed aside, the new one in
        monkeypatch.setattr(_local, "_renameat2", None)
    _failing_parent_sync(monkeypatch, tmp_path)
    with pytest.raises(StorageError, match="committing .*ckpt failed"):
        _save(p, {"w": np.ones(8)}, how, overwrite=True)
    np.testing.assert_array_equal(ss.load(p)["w"], np.zeros(8))
    assert _leftovers(tmp_path) == []


def test_an_interrupt_while_syncing_commits_nothing(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    p = tmp_path / "ckpt"
    ss.save(p, {"w": np.zeros(8)})
    _failing_parent_sync(monkeypatch, tmp_path, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        ss.save(p, {"w": np.ones(8)}, overwrite=True)
    np.testing.assert_array_equal(ss.load(p)["w"], np.zeros(8))
    assert _leftovers(tmp_path) == []


def test_an_undo_that_fails_says_what_the_path_holds(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    p = tmp_path / "ckpt"
    _failing_parent_sync(monkeypatch, tmp_path)
    real_rename = os.rename

    def rename(src: Any, dst: Any) -> None:
        if os.path.realpath(src) == os.path.realpath(p):  # the undo's rename
            raise OSError(errno.EROFS, "read-only now", str(src))
        real_rename(src, dst)

    monkeypatch.setattr(_local.os, "rename", rename)
    with pytest.raises(StorageError, match="after it was published.*read-only now.*holds this "
                                           "save's checkpoint"):
        ss.save(p, {"w": np.ones(8)})
    monkeypatch.undo()
    np.testing.assert_array_equal(ss.load(p)["w"], np.ones(8))  # kept, not deleted
