"""A leftover that cannot be removed is a failure, reported; one kept on purpose is not.

``collect_garbage`` (and ``statestream gc``) skipped every error removing a leftover,
so permission denied, or a store that refused or did not answer, read as "0 leftover
staging directories removed", exit 0. Local storage with ``shutil.rmtree`` patched
stands for any failing backend; test_s3_faults.py has an object store's.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

import statestream as ss
from statestream.cli import main
from statestream.storage import Leftover, LocalStorage, collect_garbage
from statestream.storage._base import LeftoverKeptError

#: staging directories of another host's saves: unverifiable writers, removed by age
_OTHER_HOST = "-w0123456789abcdef-1-1"


def _leftover(parent: Path, target: str) -> Path:
    d = parent / f".{target}.tmp-00112233aabb{_OTHER_HOST}"
    (d / "data").mkdir(parents=True)
    (d / "data" / "r0-0.bin").write_bytes(b"x")
    return d


def _failing_rmtree(monkeypatch: pytest.MonkeyPatch, failing: set[str],
                    code: int = errno.EACCES) -> list[str]:
    """``shutil.rmtree`` that fails with ``code`` for the paths in ``failing``; the
    paths it was asked to remove are returned (the list fills as it is called)."""
    real = shutil.rmtree
    calls: list[str] = []

    def rmtree(path: Any, *args: Any, **kwargs: Any) -> None:
        calls.append(str(path))
        if str(path) in failing:
            raise OSError(code, os.strerror(code), str(path))
        real(path, *args, **kwargs)

    monkeypatch.setattr("statestream.storage._local.shutil.rmtree", rmtree)
    return calls


def test_a_leftover_that_cannot_be_removed_is_raised_after_the_others(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stuck, other = _leftover(tmp_path, "a"), _leftover(tmp_path, "b")
    _failing_rmtree(monkeypatch, {str(stuck)})
    with pytest.raises(ss.StoragePermissionError) as ei:
        collect_garbage(LocalStorage(), str(tmp_path), max_age_s=0)
    assert isinstance(ei.value, PermissionError) and ei.value.errno == errno.EACCES
    assert str(stuck) in str(ei.value) and "1 other(s) were removed" in str(ei.value)
    assert stuck.is_dir() and not other.exists()  # the failure did not stop the other


def test_gc_exits_2_naming_a_leftover_it_cannot_remove(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    stuck, other = _leftover(tmp_path, "a"), _leftover(tmp_path, "b")
    _failing_rmtree(monkeypatch, {str(stuck)})
    assert main(["gc", str(tmp_path), "--max-age-hours", "0"]) == 2
    out, err = capsys.readouterr()
    assert f"removed {other}" in out and "1 leftover staging directory removed" in out
    (line,) = err.splitlines()
    assert line.startswith("error: ") and str(stuck) in line and "Permission denied" in line
    assert stuck.is_dir()


def test_a_store_that_does_not_answer_ends_the_collection(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    left = {str(_leftover(tmp_path, n)) for n in ("a", "b", "c")}
    calls = _failing_rmtree(monkeypatch, left, errno.ETIMEDOUT)
    with pytest.raises(ss.StorageTimeoutError) as ei:
        collect_garbage(LocalStorage(), str(tmp_path), max_age_s=0)
    assert len(calls) == 1  # the others would only wait as long, to fail as well
    assert calls[0] in str(ei.value) and "not tried" in str(ei.value)
    assert all(os.path.isdir(p) for p in left)


def test_the_manager_warns_of_a_leftover_it_cannot_remove_and_opens(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with ss.CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, {"w": 1})
    stuck = _leftover(tmp_path, "step_0000000002")  # the holder's to remove, at any age
    _failing_rmtree(monkeypatch, {str(stuck)})
    with pytest.warns(RuntimeWarning, match=f"could not remove {stuck}.*Permission denied"):
        with ss.CheckpointManager(tmp_path) as mgr:
            assert mgr.steps() == [1]
    assert stuck.is_dir()
    monkeypatch.undo()
    with ss.CheckpointManager(tmp_path):  # tried again, and removed this time
        pass
    assert not stuck.exists()


def test_refusals_on_purpose_are_skipped_not_reported(tmp_path: Path) -> None:
    class Refusing(LocalStorage):
        def remove_leftover(self, leftover: Leftover) -> str | None:
            if leftover.target == "kept":
                raise LeftoverKeptError(f"{leftover.path} was committed meanwhile")
            if leftover.target == "gone":
                raise FileNotFoundError(leftover.path)
            return super().remove_leftover(leftover)

    kept, gone, dead = (_leftover(tmp_path, n) for n in ("kept", "gone", "dead"))
    assert collect_garbage(Refusing(), str(tmp_path), max_age_s=0) == [str(dead)]
    assert kept.is_dir() and gone.is_dir()


def test_local_storage_refuses_a_link_as_a_refusal_not_a_failure(tmp_path: Path) -> None:
    target = tmp_path / "precious"
    target.mkdir()
    link = tmp_path / f".x.tmp-00112233aabb{_OTHER_HOST}"
    link.symlink_to(target)
    with pytest.raises(LeftoverKeptError, match="not a statestream staging directory"):
        LocalStorage().remove_leftover(Leftover(str(link), "x", None, 0.0))
    assert target.is_dir()
