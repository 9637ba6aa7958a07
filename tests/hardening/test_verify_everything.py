"""Item 7: verify reports data files longer than listed and files the manifest does not list."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import statestream as ss

from .conftest import run_cli, small_state

pytestmark = pytest.mark.timeout(300)


def _data(c: Path) -> Path:
    (f,) = sorted((c / "data").iterdir())
    return f


def _assert_damaged(c: Path, needle: str) -> None:
    rep = ss.verify(c)
    assert not rep.ok, rep
    assert any(needle in p for p in rep.problems), rep.problems
    r = run_cli("verify", str(c))
    assert r.returncode == 1, r
    assert needle in r.stderr and "Traceback" not in r.stderr


def test_longer_data_file(ckpt: Path) -> None:
    with open(_data(ckpt), "ab") as f:
        f.write(b"\0" * 100)
    _assert_damaged(ckpt, f"data/{_data(ckpt).name} is")
    # load reads only what the manifest lists and still works
    np.testing.assert_array_equal(ss.load(ckpt)["params"]["w"], small_state()["params"]["w"])


@pytest.mark.parametrize("where", ["data/r9-9.bin", "data/notes.txt", "extra.bin", "sub"])
def test_unlisted_file(ckpt: Path, where: str) -> None:
    if where == "sub":
        os.mkdir(ckpt / where)
    else:
        (ckpt / where).write_bytes(b"payload")
    _assert_damaged(ckpt, where)


def test_unlisted_special_files(ckpt: Path) -> None:
    os.mkfifo(ckpt / "data" / "pipe")
    os.symlink("/etc/passwd", ckpt / "link")
    rep = ss.verify(ckpt)
    assert not rep.ok
    text = "\n".join(rep.problems)
    assert "data/pipe" in text and "/link" in text


def test_clean_checkpoint_verifies(ckpt: Path) -> None:
    rep = ss.verify(ckpt)
    assert rep.ok, rep.problems
