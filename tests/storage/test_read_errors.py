"""Issue 10 item 11, read side: a StorageError from an OS error carries its errno and is
the matching builtin (EIO an OSError, EACCES a PermissionError), like the write side.

Root ignores permissions and a healthy disk never fails a read, so the OS call
itself is made to fail: ``os.preadv`` / ``os.scandir`` raise the OSError the
kernel would, for the checkpoint's files only.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import statestream as ss
from statestream.storage import LocalStorage


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    path = tmp_path / "ckpt"
    ss.save(path, {"w": np.arange(1000.0), "step": 3})
    return path


def _failing(real: Callable[..., Any], code: int,
             when: Callable[[Any], bool]) -> Callable[..., Any]:
    def fake(target: Any, *args: Any) -> Any:
        if when(target):
            raise OSError(code, os.strerror(code))
        return real(target, *args)

    return fake


def _fd_under(root: Path, part: str) -> Callable[[Any], bool]:
    def check(fd: Any) -> bool:
        try:
            return os.readlink(f"/proc/self/fd/{fd}").startswith(str(root) + part)
        except OSError:
            return False

    return check


def _assert_os_error(exc: BaseException, code: int, builtin: type[OSError], where: str) -> None:
    assert isinstance(exc, ss.StorageError) and isinstance(exc, builtin), type(exc).__mro__
    assert exc.errno == code and exc.strerror == os.strerror(code), exc
    assert where in str(exc), exc


@pytest.mark.parametrize(("code", "builtin"), [(errno.EIO, OSError),
                                               (errno.EACCES, PermissionError)])
def test_manifest_read_error_carries_errno(ckpt: Path, monkeypatch: pytest.MonkeyPatch,
                                           code: int, builtin: type[OSError]) -> None:
    monkeypatch.setattr(os, "preadv", _failing(os.preadv, code, _fd_under(ckpt, "/manifest")))
    for call in (ss.load, ss.metadata):
        with pytest.raises(ss.StorageError) as ei:
            call(ckpt)
        _assert_os_error(ei.value, code, builtin, "manifest.json")


def test_data_read_error_carries_errno(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "preadv", _failing(os.preadv, errno.EIO, _fd_under(ckpt, "/data/")))
    with pytest.raises(ss.StorageError) as ei:
        ss.load(ckpt, io=ss.IOOptions(map_files=False))  # mapped arrays are not read
    _assert_os_error(ei.value, errno.EIO, OSError, "data/")


def test_listing_error_carries_errno(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reader = LocalStorage().open_read(str(ckpt))
    try:
        monkeypatch.setattr(os, "scandir", _failing(os.scandir, errno.EACCES,
                                                    lambda t: isinstance(t, int)))
        with pytest.raises(ss.StorageError) as ei:
            reader.list_files()  # type: ignore[attr-defined]
        _assert_os_error(ei.value, errno.EACCES, PermissionError, str(ckpt))
    finally:
        monkeypatch.undo()
        reader.close()
