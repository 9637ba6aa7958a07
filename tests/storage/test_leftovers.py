"""Staging directories of killed saves: removed once their writer is provably dead."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import statestream as ss
from statestream.cli import main
from statestream.storage import LocalStorage, collect_garbage
from statestream.storage._leftovers import this_writer, writer_alive

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc")

_KILLED_SAVE = """
import sys
import numpy as np
import statestream as ss
from statestream.testing import faults
faults.kill_at("save.chunk_written")
ss.save(sys.argv[1], {"w": np.ones((256, 1024))}, io=ss.IOOptions(max_chunk_bytes=64 << 10))
"""

_LIVE_WRITER = """
import sys, time
from statestream.storage import LocalStorage
txn = LocalStorage().begin_write(sys.argv[1], overwrite=False)
w = txn.create_file("data/r0-0.bin", 3)
w.write_at([b"abc"], 0)
print("WRITING", flush=True)
time.sleep(600)
"""


def staging(d: Path) -> list[str]:
    return sorted(n for n in os.listdir(d) if ".tmp-" in n)


def killed_save(path: Path) -> None:
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(_KILLED_SAVE), str(path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == -signal.SIGKILL, r.stderr


def test_a_killed_save_is_collected_by_the_next_save(tmp_path: Path) -> None:
    killed_save(tmp_path / "a")
    (left,) = staging(tmp_path)
    assert left.startswith(".a.tmp-")
    assert os.listdir(tmp_path / left / "data")  # it had written data
    ss.save(tmp_path / "b", {"x": np.arange(3)})
    assert staging(tmp_path) == []
    assert sorted(os.listdir(tmp_path)) == ["b"]


def test_a_live_writer_is_never_collected(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_LIVE_WRITER),
                             str(tmp_path / "live")], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "WRITING"
        (left,) = staging(tmp_path)
        ss.save(tmp_path / "b", {"x": np.arange(3)})
        assert main(["gc", str(tmp_path)]) == 0
        assert staging(tmp_path) == [left]
        assert "0 leftover" in capsys.readouterr().out
    finally:
        proc.kill()
        proc.wait()
    # now its writer is dead (a different process may reuse the pid, never with its start time)
    assert main(["gc", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"removed {tmp_path / left}" in out and "1 leftover staging directory removed" in out
    assert staging(tmp_path) == []


def _age(path: Path, seconds: float) -> None:
    old = time.time() - seconds
    for root, dirs, files in os.walk(path):
        for n in dirs + files:
            os.utime(os.path.join(root, n), (old, old))
    os.utime(path, (old, old))


@pytest.mark.parametrize("suffix", ["-w0123456789abcdef-1-1", "", "-w0123456789abcdef-7-9.old"])
def test_unverifiable_writers_are_kept_until_stale(tmp_path: Path, suffix: str) -> None:
    """Another host's writer (or one that recorded none) cannot be checked: age decides."""
    d = tmp_path / f".ckpt.tmp-00112233aabb{suffix}"
    (d / "data").mkdir(parents=True)
    (d / "data" / "r0-0.bin").write_bytes(b"x")
    ss.save(tmp_path / "b", {"x": np.arange(3)})
    assert d.exists()
    st = LocalStorage()
    assert collect_garbage(st, str(tmp_path)) == []
    _age(d, 3600)
    assert collect_garbage(st, str(tmp_path)) == []  # within the default 24 h
    assert collect_garbage(st, str(tmp_path), max_age_s=1800) == [str(d)]
    assert not d.exists()


def test_a_nan_or_negative_age_is_refused(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """``max_age_s=nan`` or ``-1`` (``gc --max-age-hours nan``) was taken, and made the
    fresh staging area of another host's save in progress old enough to remove."""
    d = tmp_path / ".ckpt.tmp-00112233aabb-w0123456789abcdef-1-1"  # another host's
    (d / "data").mkdir(parents=True)
    (d / "data" / "r0-0.bin").write_bytes(b"being written")
    st = LocalStorage()
    for bad in (float("nan"), -1.0, -float("inf")):
        with pytest.raises(ss.InvalidOptionError, match="max_age_s must be a number of "
                           "seconds >= 0"):
            collect_garbage(st, str(tmp_path), max_age_s=bad)
    with pytest.raises(ss.InvalidOptionTypeError):
        collect_garbage(st, str(tmp_path), max_age_s="1h")  # type: ignore[arg-type]
    assert collect_garbage(st, str(tmp_path), max_age_s=float("inf")) == []  # never by age
    for bad in ("nan", "-1", "inf", "soon"):
        with pytest.raises(SystemExit) as ei:  # argparse refuses it: usage, exit 2
            main(["gc", str(tmp_path), "--max-age-hours", bad])
        assert ei.value.code == 2
        err = capsys.readouterr().err
        assert "an age is a finite number >= 0" in err or "not a number" in err
    assert d.is_dir()
    assert main(["gc", str(tmp_path), "--max-age-hours", "0"]) == 0
    assert not d.exists()


def test_only_staging_directories_are_touched(tmp_path: Path) -> None:
    target = tmp_path / "precious"
    target.mkdir()
    (target / "f").write_text("keep")
    (tmp_path / ".x.tmp-00112233aabb-w0000000000000000-1-1").symlink_to(target)
    (tmp_path / ".y.tmp-00112233aabb").write_text("a file, not a staging dir")
    (tmp_path / "z.tmp-00112233aabb").mkdir()  # not hidden: not ours
    for p in tmp_path.iterdir():
        os.utime(p, (0, 0), follow_symlinks=False)
    assert collect_garbage(LocalStorage(), str(tmp_path), max_age_s=0) == []
    assert (target / "f").read_text() == "keep"
    assert len(os.listdir(tmp_path)) == 4


def test_writer_identity() -> None:
    me = this_writer()
    assert me is not None and me.pid == os.getpid()
    assert writer_alive(me) is True
    assert writer_alive(type(me)(me.host, me.pid, me.start + 1)) is False  # a reused pid
    assert writer_alive(type(me)("0" * 16, me.pid, me.start)) is None  # another host
    assert writer_alive(None) is None


_KILLED_OVERWRITE = """
import os, signal, sys
import numpy as np
import statestream as ss
import statestream.storage._local as local
local._renameat2 = None  # a file system without renameat2: the two-rename fallback
real = os.rename
def rename(a, b):
    real(a, b)
    if b.endswith(".old"):
        os.kill(os.getpid(), signal.SIGKILL)  # between moving the old one aside and the new in
local.os.rename = rename
ss.save(sys.argv[1], {"w": np.ones(4)}, overwrite=True)
"""


@pytest.mark.parametrize("by", ["gc", "next save"])
def test_an_overwrite_killed_between_its_renames_restores_the_old_checkpoint(
        tmp_path: Path, by: str) -> None:
    # the path held no checkpoint, the old one only in <staging>.old and the new one in
    # <staging>: gc (and the next save beside it) removed both, losing every copy
    ck = tmp_path / "ck"
    ss.save(ck, {"w": np.zeros(4)})
    proc = subprocess.run([sys.executable, "-c", _KILLED_OVERWRITE, str(ck)])
    assert proc.returncode == -signal.SIGKILL
    assert not ck.exists() and any(n.endswith(".old") for n in os.listdir(tmp_path))
    old = [str(tmp_path / n) for n in os.listdir(tmp_path) if n.endswith(".old")]
    with pytest.warns(RuntimeWarning, match=f"restored {ck} from .*overwrite was killed"):
        if by == "gc":
            removed = collect_garbage(LocalStorage(), str(tmp_path))
            assert len(removed) == 1 and removed != old  # put back, not removed
        else:
            ss.save(tmp_path / "other", {"x": np.ones(2)})
    assert ss.load(ck)["w"].tolist() == [0.0] * 4  # the overwrite never committed
    assert ss.verify(ck).ok
    if by == "gc":
        assert sorted(os.listdir(tmp_path)) == ["ck"]
