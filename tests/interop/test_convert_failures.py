"""``convert`` when writing fails part-way: a real full file system (a small tmpfs, root
only) and a damaged source. The error names the file being written and carries its
errno, nothing is left at ``dst`` or beside it, and no descriptor stays open on the
staging files (a deleted file held open keeps its space: on a full disk every failed
conversion would have made it fuller)."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import statestream as ss

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")

# (to, dst name, extra convert arguments)
_TARGETS = [
    ("statestream", "out", {}),
    ("statestream", "out", {"compression": "zstd"}),
    ("safetensors", "out.safetensors", {}),
    ("safetensors", "out", {"max_shard_bytes": 1 << 20}),
    ("torch", "out.pt", {}),
    ("dcp", "out", {}),
    ("orbax", "out", {}),
]
_IDS = ["statestream", "statestream-zstd", "safetensors", "safetensors-shards", "torch", "dcp",
        "orbax"]


def _source(path: Path) -> dict[str, np.ndarray]:
    g = np.random.default_rng(0)
    state = {"w": g.standard_normal((1024, 1024)).astype(np.float32),  # 4 MiB, incompressible
             "b": np.arange(1000, dtype=np.float32)}
    ss.save(path, state)
    return state


def _open_under(d: Path) -> list[str]:
    """What this process holds open under ``d`` (deleted files included)."""
    held = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed since the listing
            continue
        if target.startswith(str(d) + os.sep):
            held.append(target)
    return held


def _free(d: Path) -> int:
    st = os.statvfs(d)
    return st.f_bavail * st.f_frsize


@pytest.mark.parametrize(("to", "name", "kw"), _TARGETS, ids=_IDS)
def test_a_full_disk_names_the_file_and_holds_nothing(
        mount_tmpfs: Callable[[str], Path], tmp_path: Path, to: str, name: str,
        kw: dict[str, object]) -> None:
    _needs(to)
    _source(tmp_path / "src")
    d = mount_tmpfs("2m")
    free = _free(d)
    with pytest.raises(ss.StorageError) as ei:
        ss.convert(tmp_path / "src", d / name, to=to, **kw)
    assert ei.value.errno == errno.ENOSPC, ei.value
    assert str(d) in str(ei.value), ei.value  # the file it was writing, not a bare OSError
    assert os.listdir(d) == []
    assert _open_under(d) == []
    assert _free(d) == free  # the space the failed conversion wrote is free again


def _needs(to: str) -> None:
    if to in ("torch", "dcp"):
        pytest.importorskip("torch")
    if to == "orbax":
        pytest.importorskip("orbax.checkpoint")


@pytest.mark.skipif(sys.platform != "linux" or os.geteuid() != 0, reason="chattr needs root")
@pytest.mark.parametrize(("to", "name", "kw"), _TARGETS, ids=_IDS)
def test_a_directory_that_refuses_writes_is_a_storage_error(
        tmp_path: Path, to: str, name: str, kw: dict[str, object]) -> None:
    """An immutable parent (EPERM even for root): every target raises the same
    StoragePermissionError (the non-statestream ones raised a bare PermissionError)."""
    _needs(to)
    _source(tmp_path / "src")
    d = tmp_path / "locked"
    d.mkdir()
    r = subprocess.run(["chattr", "+i", str(d)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"chattr is not available here: {r.stderr.strip()!r}")
    try:
        with pytest.raises(ss.StoragePermissionError) as ei:
            ss.convert(tmp_path / "src", d / name, to=to, **kw)
    finally:
        subprocess.run(["chattr", "-i", str(d)], check=True)
    assert ei.value.errno == errno.EPERM and str(d) in str(ei.value), ei.value
    assert os.listdir(d) == []


def test_a_damaged_source_leaves_no_descriptor_open(tmp_path: Path) -> None:
    """A statestream output being written when the source fails (a chunk whose checksum
    does not match) is removed and its data file closed."""
    _source(tmp_path / "src")
    data = next((tmp_path / "src" / "data").iterdir())
    with open(data, "r+b") as f:  # a byte of the last chunk: read after the first slabs
        f.seek(os.path.getsize(data) - 100)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))
    out = tmp_path / "out"
    mem = ss.MemoryOptions(memory_budget_bytes=1 << 20)  # several slabs
    with pytest.raises(ss.CheckpointCorruptError, match=str(data.name)):
        ss.convert(tmp_path / "src", out, to="statestream", memory=mem)
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["src"]
    assert _open_under(tmp_path) == []


_REPLACE_KILLED = """
import os, signal, sys
import statestream as ss
import statestream.interop._writers as writers
real = os.rename
def rename(src, dst):
    real(src, dst)
    if ".old-" in os.path.basename(dst):  # the old output moved aside, the new not in
        os.kill(os.getpid(), signal.SIGKILL)
writers.os.rename = rename
ss.convert(sys.argv[1], sys.argv[2], to=sys.argv[3], overwrite=True)
print("converted")
"""


@pytest.mark.parametrize(("to", "kw"), [("dcp", {}), ("safetensors", {"max_shard_bytes": 1 << 20})],
                         ids=["dcp", "safetensors-shards"])
def test_a_directory_output_replaced_and_killed_keeps_one_in_place(
        tmp_path: Path, to: str, kw: dict[str, object]) -> None:
    """Replacing a directory output moved the old one aside, then renamed the new one in:
    killed between the two, nothing was left at ``dst`` (the new output in a staging
    directory that gc removes, the old one under ``dst.old-<pid>``). Now one swap."""
    _needs(to)
    state = _source(tmp_path / "src")
    dst = tmp_path / "out"
    ss.convert(tmp_path / "src", dst, to=to, items=["b"], **kw)  # the old output: b only
    proc = subprocess.run([sys.executable, "-c", _REPLACE_KILLED, str(tmp_path / "src"),
                           str(dst), to], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == 0 and "converted" in proc.stdout, proc.stderr[-3000:]
    got = ss.load(dst)  # the new output, whole
    np.testing.assert_array_equal(got["w"], state["w"])
    np.testing.assert_array_equal(got["b"], state["b"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]


@pytest.mark.parametrize(("to", "name", "kw"), [t for t in _TARGETS if t[0] != "statestream"],
                         ids=[i for i in _IDS if not i.startswith("statestream")])
def test_a_failed_sync_after_the_swap_replaces_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, to: str, name: str,
        kw: dict[str, object]) -> None:
    """The output's parent directory failing to sync (EIO) after the new output moved in:
    the conversion raised naming the output, yet the new output stayed and, with
    overwrite, the old one was already deleted. Now the swap is undone first."""
    _needs(to)
    import statestream.storage._local as local  # whose sync_or_swap_back syncs the parent

    old = _source(tmp_path / "src")
    dst = tmp_path / name
    ss.convert(tmp_path / "src", dst, to=to, **kw)  # the old output
    ss.save(tmp_path / "new", {k: v + 1 for k, v in old.items()})
    real = local.fsync_dir

    def fsync_dir(path: str) -> None:
        if os.path.realpath(path) == os.path.realpath(tmp_path):
            raise OSError(errno.EIO, "injected", path)
        real(path)

    monkeypatch.setattr(local, "fsync_dir", fsync_dir)
    with pytest.raises(ss.StorageError, match=f"{name}.*injected") as ei:
        ss.convert(tmp_path / "new", dst, to=to, overwrite=True, **kw)
    assert ei.value.errno == errno.EIO
    monkeypatch.undo()
    got = ss.load(dst)  # the old output, whole
    for k, v in old.items():
        np.testing.assert_array_equal(got[k], v)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([name, "new", "src"])
