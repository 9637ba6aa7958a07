"""Items 1 and 2 of the hardening issue: special files never block, every I/O failure is a
CheckpointError, and the CLI reports both cleanly (no traceback, non-zero exit)."""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

import statestream as ss

from .conftest import run_cli

pytestmark = pytest.mark.timeout(120)  # a FIFO that blocks fails the test instead of hanging


def _data_file(c: Path) -> str:
    (f,) = sorted((c / "data").iterdir())
    return f"data/{f.name}"


def _replace_with_fifo(c: Path, name: str) -> None:
    os.unlink(c / name)
    os.mkfifo(c / name)


def _replace_with_dir(c: Path, name: str) -> None:
    os.unlink(c / name)
    os.mkdir(c / name)
    (c / name / "x").write_bytes(b"{}")


def _replace_with_socket(c: Path, name: str) -> None:
    import socket

    os.unlink(c / name)
    s = socket.socket(socket.AF_UNIX)
    try:
        s.bind(str(c / name))
    except OSError:  # path too long for AF_UNIX
        pytest.skip("cannot bind a unix socket at this path")
    finally:
        s.close()


def _replace_with_chardev(c: Path, name: str) -> None:
    """A character device with /dev/null's numbers: reads end at once, writes vanish."""
    os.unlink(c / name)
    try:
        os.mknod(c / name, 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    except PermissionError:  # not root (or no CAP_MKNOD)
        pytest.skip("this process may not create device files")
    assert stat.S_ISCHR(os.lstat(c / name).st_mode)


_MAKERS: dict[str, Callable[[Path, str], None]] = {
    "fifo": _replace_with_fifo, "dir": _replace_with_dir, "socket": _replace_with_socket,
    "chardev": _replace_with_chardev,
}
#: how the refusal names each kind ("it is a FIFO (named pipe), not a regular file")
_WORDS = {"fifo": "a FIFO", "dir": "a directory", "socket": "a socket",
          "chardev": "a character device"}


@pytest.mark.parametrize("kind", sorted(_MAKERS))
@pytest.mark.parametrize("which", ["manifest.json", "COMMITTED", "data"])
def test_special_file_is_refused(ckpt: Path, kind: str, which: str) -> None:
    name = _data_file(ckpt) if which == "data" else which
    _MAKERS[kind](ckpt, name)
    with pytest.raises(ss.CheckpointError) as ei:
        ss.load(ckpt)
    assert name in str(ei.value) and f"it is {_WORDS[kind]}" in str(ei.value)  # not read
    rep = ss.verify(ckpt)
    assert not rep.ok and any(name in p and _WORDS[kind] in p for p in rep.problems), rep.problems
    if which != "data":
        with pytest.raises(ss.CheckpointError) as ei:
            ss.metadata(ckpt)
        assert name in str(ei.value)
    else:  # metadata reads no data
        assert ss.metadata(ckpt).num_arrays == 1
    if kind != "socket":  # the CLI runs are slow; FIFO and directory are the cases
        for cmd in ("inspect", "verify"):
            r = run_cli(cmd, str(ckpt))
            if which == "data" and cmd == "inspect":
                assert r.returncode == 0, r.stderr
                continue
            assert r.returncode != 0, r
            assert "Traceback" not in r.stderr, r.stderr
            assert name in r.stderr, r.stderr


def test_fifo_items_not_touching_it_load(ckpt: Path) -> None:
    _replace_with_fifo(ckpt, _data_file(ckpt))
    assert ss.load(ckpt, items=["step"]) == {"step": 7}


def test_unreadable_manifest_is_storage_error(ckpt: Path) -> None:
    if os.geteuid() == 0:
        pytest.skip("root reads files without read permission")
    os.chmod(ckpt / "manifest.json", 0)
    with pytest.raises(ss.StorageError) as ei:
        ss.load(ckpt)
    assert isinstance(ei.value, PermissionError) or "Permission" in str(ei.value)


def test_data_dir_replaced_by_file(ckpt: Path) -> None:
    shutil.rmtree(ckpt / "data")
    (ckpt / "data").write_bytes(b"x")
    with pytest.raises(ss.CheckpointError) as ei:
        ss.load(ckpt)
    assert "data" in str(ei.value)
    assert not ss.verify(ckpt).ok


def test_checkpoint_path_is_a_fifo(tmp_path: Path) -> None:
    p = tmp_path / "pipe"
    os.mkfifo(p)
    with pytest.raises(ss.CheckpointNotFoundError):
        ss.load(p)
    r = run_cli("inspect", str(p))
    assert r.returncode != 0 and "Traceback" not in r.stderr
