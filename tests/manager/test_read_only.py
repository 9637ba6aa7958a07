"""Read-only directories (an evaluation job's mount): list and load, never write."""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import statestream as ss
from statestream.errors import storage_error
from statestream.storage import LocalStorage


def _remount_ro(d: Path) -> None:
    r = subprocess.run(["mount", "-o", "remount,ro", str(d)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot remount read-only here: {r.stderr.strip()}")


@pytest.fixture
def ro_dir(mount_tmpfs: Callable[[str], Path]) -> Path:
    """A directory holding steps 1 and 2 (and a manager's lock), then mounted read-only."""
    d = mount_tmpfs("16m")
    with ss.CheckpointManager(d / "run", async_save=False) as mgr:
        for step in (1, 2):
            mgr.save(step, {"w": np.full(8, step, dtype=np.int32)})
    ss.save(d / "plain", {"x": np.arange(4)})
    _remount_ro(d)
    return d


def test_manager_lists_and_loads_a_read_only_directory(ro_dir: Path) -> None:
    with ss.CheckpointManager(ro_dir / "run") as mgr:
        assert mgr.read_only
        assert mgr.steps() == [1, 2] and mgr.latest_step() == 2
        np.testing.assert_array_equal(mgr.load()["w"], np.full(8, 2, dtype=np.int32))
        assert mgr.step_info(1)["step"] == 1
        with pytest.raises(ss.StorageError, match="read-only") as ei:
            mgr.save(3, {"w": np.zeros(8)})
        assert ei.value.errno == errno.EROFS and isinstance(ei.value, OSError)
        assert mgr.steps() == [1, 2]


def test_keep_policy_deletes_nothing_without_the_lease(ro_dir: Path) -> None:
    with ss.CheckpointManager(ro_dir / "run", keep_policy=ss.KeepLatest(1)) as mgr:
        mgr.wait()
        assert mgr.steps() == [1, 2]


def test_manager_on_a_missing_directory_of_a_read_only_mount(ro_dir: Path) -> None:
    with ss.CheckpointManager(ro_dir / "never-created") as mgr:
        assert mgr.read_only and mgr.steps() == [] and mgr.latest_step() is None


def test_writes_to_a_read_only_mount_carry_erofs(ro_dir: Path) -> None:
    with pytest.raises(ss.StorageError) as ei:
        ss.save(ro_dir / "new", {"x": np.arange(4)})
    assert ei.value.errno == errno.EROFS
    with pytest.raises(ss.StorageError) as ei:
        LocalStorage().delete(str(ro_dir / "plain"))
    assert ei.value.errno == errno.EROFS
    np.testing.assert_array_equal(ss.load(ro_dir / "plain")["x"], np.arange(4))
    assert ss.verify(ro_dir / "plain").ok


def test_a_full_disk_carries_enospc(mount_tmpfs: Callable[[str], Path]) -> None:
    d = mount_tmpfs("1m")
    with pytest.raises(ss.StorageError) as ei:
        ss.save(d / "big", {"x": np.ones(1 << 20)})
    assert ei.value.errno == errno.ENOSPC, ei.value
    assert [n for n in os.listdir(d) if not n.startswith(".")] == []


@pytest.mark.parametrize(("code", "builtin"), [
    (errno.EACCES, PermissionError), (errno.EPERM, PermissionError),
    (errno.EEXIST, FileExistsError), (errno.ENOENT, FileNotFoundError),
    (errno.ETIMEDOUT, TimeoutError), (errno.EROFS, OSError), (errno.ENOSPC, OSError),
    (errno.EIO, OSError),
])
def test_storage_errors_are_the_matching_builtin(code: int, builtin: type[OSError]) -> None:
    exc = storage_error("writing /x failed", OSError(code, os.strerror(code)))
    assert isinstance(exc, builtin) and isinstance(exc, ss.StorageError)
    assert exc.errno == code and exc.strerror == os.strerror(code)
    assert str(exc) == "writing /x failed"
    assert isinstance(storage_error("x", code), builtin)


def test_a_local_tier_in_front_of_a_read_only_directory_says_why(ro_dir: Path,
                                                                  tmp_path: Path) -> None:
    with pytest.raises(ss.CheckpointError, match="could never be persisted") as ei:
        ss.CheckpointManager(ro_dir / "run", local_tier=tmp_path / "tier")
    assert "Read-only file system" in str(ei.value) or "EROFS" in str(ei.value), ei.value
