"""A local checkpoint overwritten or deleted while it is read: the reader says so
(``CheckpointGoneError``: load it again), never that the checkpoint is damaged, and
``verify`` raises it (the CLI's exit 2) instead of reporting damage (exit 1).

The change is made at a chosen point of the read, in this process: right after the
reader opened the checkpoint directory, or right after it read the manifest (before
any data file is opened). A delete is ``LocalStorage.delete`` (the marker first, then
the tree), an overwrite ``ss.save(overwrite=True)`` (a rename swap, then the old tree
is removed), as a manager or another job does them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import statestream as ss
from statestream import _hooks
from statestream.cli import _progress, main
from statestream.format import MANIFEST_NAME
from statestream.storage import LocalStorage, _local_read
from statestream.storage._local_read import _LocalReader


def _state(v: float) -> dict[str, Any]:
    return {"w": np.full(1000, v), "b": np.arange(10) + int(v), "step": int(v)}


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    path = tmp_path / "ckpt"
    ss.save(path, _state(1))
    return path


def _change(how: str, path: Path) -> Callable[[], None]:
    if how == "deleted":
        return lambda: LocalStorage().delete(str(path))
    return lambda: ss.save(path, _state(2), overwrite=True)


@pytest.fixture
def after_manifest(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[Callable[[], None]],
                                                                          None]]:
    """``after_manifest(fn)``: run ``fn`` once, right after a reader read a manifest."""
    real = _LocalReader.read_bytes
    pending: list[Callable[[], None]] = []

    def read_bytes(self: _LocalReader, name: str, max_bytes: int) -> bytes:
        out = real(self, name, max_bytes)
        if name == MANIFEST_NAME and pending:
            pending.pop()()
        return out

    monkeypatch.setattr(_LocalReader, "read_bytes", read_bytes)
    yield pending.append
    assert not pending, "the change was never made"


@pytest.mark.parametrize("how", ["deleted", "overwritten"])
def test_the_manifest_of_a_checkpoint_gone_after_the_open(ckpt: Path, how: str) -> None:
    reader = LocalStorage().open_read(str(ckpt))
    try:
        _change(how, ckpt)()
        with pytest.raises(ss.CheckpointGoneError,
                           match="manifest.json is gone: .* overwritten or deleted while being "
                                 "read .*load it again"):
            reader.read_bytes(MANIFEST_NAME, 1 << 20)
    finally:
        reader.close()


@pytest.mark.parametrize("map_files", [True, False])
@pytest.mark.parametrize("how", ["deleted", "overwritten"])
def test_a_load_of_a_checkpoint_gone_after_its_manifest(
        ckpt: Path, after_manifest: Callable[[Callable[[], None]], None], how: str,
        map_files: bool) -> None:
    after_manifest(_change(how, ckpt))
    with pytest.raises(ss.CheckpointGoneError) as ei:
        ss.load(ckpt, io=ss.IOOptions(map_files=map_files))
    assert isinstance(ei.value, ss.TruncatedFileError)  # as before, for code catching that
    text = str(ei.value)
    assert f"{ckpt}/data/r0-0.bin is gone" in text and "damaged" not in text, text
    if how == "overwritten":
        assert ss.load(ckpt)["step"] == 2  # loading again reads the new one


def test_a_checkpoint_overwritten_while_being_opened_is_opened_again(
        ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Replaced between the open of its directory and the look at its marker: the
    reader opens the new one (a reader sees the old or the new one)."""
    real = _local_read._open_root
    opened: list[str] = []

    def open_root(path: str, follow_links: bool) -> int:
        fd = real(path, follow_links)
        if not opened:
            opened.append(path)
            ss.save(path, _state(2), overwrite=True)
        return fd

    monkeypatch.setattr(_local_read, "_open_root", open_root)
    assert ss.load(ckpt)["step"] == 2
    assert opened == [str(ckpt)]


@pytest.mark.parametrize("how", ["deleted", "overwritten"])
def test_verify_of_a_checkpoint_gone_while_read_raises_not_damage(
        ckpt: Path, after_manifest: Callable[[Callable[[], None]], None], how: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    after_manifest(_change(how, ckpt))
    with pytest.raises(ss.CheckpointGoneError, match="overwritten or deleted while being read"):
        ss.verify(ckpt)
    if how == "overwritten":
        assert ss.verify(ckpt).ok
    else:
        ss.save(ckpt, _state(1))
    after_manifest(_change(how, ckpt))
    assert main(["verify", str(ckpt)]) == 2  # an error, not 1 (damaged)
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "overwritten or deleted while being read" in err, err
    assert "DAMAGED" not in err


def test_cli_verify_of_a_checkpoint_deleted_before_its_open_exits_2(
        ckpt: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Deleted after the command started, before verify opened it (as its progress bar
    is set up): nothing to verify, an error (exit 2), not damage (exit 1). ``ss.verify``
    raises it too (it reported it as a problem: ok False, as if damaged)."""
    real = _progress.progress_bar

    def progress_bar(label: str, total: int | None = None) -> Any:
        LocalStorage().delete(str(ckpt))
        return real(label, total)

    monkeypatch.setattr(_progress, "progress_bar", progress_bar)
    assert main(["verify", str(ckpt)]) == 2
    assert capsys.readouterr().err.startswith(f"error: no checkpoint at {ckpt}")
    with pytest.raises(ss.CheckpointNotFoundError, match=f"no checkpoint at {ckpt}"):
        ss.verify(ckpt)


@pytest.mark.parametrize("when", ["directory opened", "delete under way"])
def test_verify_of_a_checkpoint_deleted_while_being_opened_raises_as_the_cli_exits_2(
        ckpt: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        when: str) -> None:
    """Deleted while verify opened it: right after it opened the directory, or seen
    between a delete's removal of the marker and of the tree. Not damage: ``ss.verify``
    raised nothing and reported "no committed checkpoint" (ok False) where the CLI
    exits 2; both raise CheckpointNotFoundError now, as ``ss.load`` does."""
    results: list[Any] = []

    def check() -> None:
        with pytest.raises(ss.CheckpointNotFoundError) as ei:
            ss.verify(ckpt)
        results.append(str(ei.value))
        results.append(main(["verify", str(ckpt)]))

    if when == "directory opened":
        real = _local_read._open_root

        def open_root(path: str, follow_links: bool) -> int:
            fd = real(path, follow_links)
            LocalStorage().delete(path)
            return fd

        monkeypatch.setattr(_local_read, "_open_root", open_root)
        check()
    else:
        _hooks.register("delete.uncommitted", check)
        try:
            LocalStorage().delete(str(ckpt))
        finally:
            _hooks.clear()
    assert len(results) == 2 and str(ckpt) in results[0], results
    assert results[1] == 2  # an error, not 1 (damaged)
    assert "DAMAGED" not in capsys.readouterr().err


def test_a_missing_file_of_a_checkpoint_still_there_is_damage(ckpt: Path) -> None:
    (ckpt / "data" / "r0-0.bin").unlink()
    with pytest.raises(ss.TruncatedFileError, match="missing; the checkpoint is damaged") as ei:
        ss.load(ckpt)
    assert not isinstance(ei.value, ss.CheckpointGoneError)
    rep = ss.verify(ckpt)
    assert not rep.ok and "damaged" in rep.problems[0]
    assert main(["verify", str(ckpt)]) == 1
