"""Tests for statestream.storage._local (LocalStorage): transactions, commit, safe reads."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from statestream.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    TruncatedFileError,
    UnsafeCheckpointError,
)
from statestream.format import COMMIT_NAME
from statestream.storage import LocalStorage, StorageCapabilities, storage_for
from statestream.storage._local import _LocalWriteTransaction


def write_checkpoint(st: LocalStorage, path: Path, payload: bytes = b"hello world",
                     *, overwrite: bool = False, commit: bool = True) -> _LocalWriteTransaction:
    txn = st.begin_write(str(path), overwrite=overwrite)
    w = txn.create_file("data/r0-0.bin", len(payload))
    w.write_at([payload[:5], memoryview(payload[5:])], 0)
    w.finish()
    txn.write_bytes("manifest.json", b"{}")
    txn.write_bytes(COMMIT_NAME, b"marker")
    if commit:
        txn.commit()
    return txn


def read_all(st: LocalStorage, path: Path, name: str = "data/r0-0.bin") -> bytes:
    r = st.open_read(str(path))
    try:
        buf = bytearray(r.file_size(name))
        r.read_into(name, 0, [buf])
        return bytes(buf)
    finally:
        r.close()


def entries(d: Path) -> list[str]:
    return sorted(os.listdir(d))


@pytest.fixture()
def st() -> LocalStorage:
    return LocalStorage()


def test_capabilities(st: LocalStorage) -> None:
    assert st.capabilities == StorageCapabilities(atomic_rename=True, random_write=True)
    assert st.capabilities.ranged_read


def test_storage_for_local_paths(tmp_path: Path) -> None:
    backend, p = storage_for(tmp_path / "c")
    assert isinstance(backend, LocalStorage) and p == str(tmp_path / "c")
    backend, p = storage_for(f"file://{tmp_path}/c")
    assert isinstance(backend, LocalStorage) and p == str(tmp_path / "c")


def test_storage_for_unknown_scheme() -> None:
    from statestream.errors import StorageError

    with pytest.raises(StorageError, match="hdfs://"):
        storage_for("hdfs://bucket/ckpt")


# ----------------------------------------------------------------------------- write


def test_transaction_invisible_until_commit(st: LocalStorage, tmp_path: Path) -> None:
    final = tmp_path / "ckpt"
    txn = write_checkpoint(st, final, commit=False)
    assert not final.exists()
    assert not st.is_committed(str(final))
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        st.open_read(str(final))
    # the work happens in a hidden temporary sibling
    (tmp,) = entries(tmp_path)
    assert tmp.startswith(".ckpt.tmp-")
    txn.commit()
    assert st.is_committed(str(final))
    assert entries(tmp_path) == ["ckpt"]
    assert entries(final) == [COMMIT_NAME, "data", "manifest.json"]
    assert read_all(st, final) == b"hello world"


def test_abort_removes_temp_dir(st: LocalStorage, tmp_path: Path) -> None:
    txn = write_checkpoint(st, tmp_path / "ckpt", commit=False)
    txn.abort()
    assert entries(tmp_path) == []
    txn.abort()  # idempotent


def test_abort_after_commit_keeps_checkpoint(st: LocalStorage, tmp_path: Path) -> None:
    txn = write_checkpoint(st, tmp_path / "ckpt")
    txn.abort()
    assert st.is_committed(str(tmp_path / "ckpt"))


def test_creates_missing_parents(st: LocalStorage, tmp_path: Path) -> None:
    final = tmp_path / "a" / "b" / "ckpt"
    write_checkpoint(st, final)
    assert st.is_committed(str(final))


def test_write_at_offsets_and_padding(st: LocalStorage, tmp_path: Path) -> None:
    txn = st.begin_write(str(tmp_path / "c"), overwrite=False)
    w = txn.create_file("data/x.bin", 0)
    w.write_at([b"BB"], 4)
    w.write_at([b"AA", b"", np.array([1, 2], dtype=np.uint8)], 0)
    w.finish()
    txn.write_bytes(COMMIT_NAME, b"m")
    txn.commit()
    assert read_all(st, tmp_path / "c", "data/x.bin") == b"AA\x01\x02BB"


def test_many_small_buffers_in_one_write(st: LocalStorage, tmp_path: Path) -> None:
    bufs = [bytes([i % 256]) * 3 for i in range(3000)]  # more than IOV_MAX
    txn = st.begin_write(str(tmp_path / "c"), overwrite=False)
    w = txn.create_file("data/x.bin", 9000)
    w.write_at(bufs, 0)
    w.finish()
    txn.write_bytes(COMMIT_NAME, b"m")
    txn.commit()
    assert read_all(st, tmp_path / "c", "data/x.bin") == b"".join(bufs)


def test_create_file_twice_fails(st: LocalStorage, tmp_path: Path) -> None:
    txn = st.begin_write(str(tmp_path / "c"), overwrite=False)
    txn.create_file("data/x.bin", 0).finish()
    with pytest.raises(FileExistsError):
        txn.create_file("data/x.bin", 0)
    txn.abort()


@pytest.mark.parametrize("name", ["../x", "data/../../x", "data/sub/x", "/abs", "..", "", "a/b"])
def test_transaction_refuses_names_outside_checkpoint(st: LocalStorage, tmp_path: Path,
                                                      name: str) -> None:
    txn = st.begin_write(str(tmp_path / "c"), overwrite=False)
    try:
        with pytest.raises(UnsafeCheckpointError):
            if name.startswith("data/"):
                txn.create_file(name, 0)
            else:
                txn.write_bytes(name, b"x")
    finally:
        txn.abort()
    assert entries(tmp_path) == []


def test_existing_path_without_overwrite(st: LocalStorage, tmp_path: Path) -> None:
    write_checkpoint(st, tmp_path / "ckpt", b"old")
    with pytest.raises(CheckpointExistsError, match="overwrite=True") as ei:
        st.begin_write(str(tmp_path / "ckpt"), overwrite=False)
    assert isinstance(ei.value, FileExistsError) and isinstance(ei.value, CheckpointError)
    assert read_all(st, tmp_path / "ckpt") == b"old"


def test_commit_over_path_created_meanwhile(st: LocalStorage, tmp_path: Path) -> None:
    final = tmp_path / "ckpt"
    txn = write_checkpoint(st, final, b"mine", commit=False)
    write_checkpoint(st, final, b"theirs")  # someone else commits first
    with pytest.raises(CheckpointExistsError):
        txn.commit()
    assert read_all(st, final) == b"theirs"
    assert entries(tmp_path) == ["ckpt"]  # our temp dir is gone


def test_overwrite_replaces_a_path_created_just_before_the_rename(
        st: LocalStorage, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With overwrite=True the last writer wins, even in the window between the
    commit's existence check and its rename (there it used to raise)."""
    final = tmp_path / "ckpt"
    txn = write_checkpoint(st, final, b"mine", overwrite=True, commit=False)
    real = os.path.lexists
    raced: list[bool] = []

    def lexists_then_race(p: Any) -> bool:
        if os.fspath(p) == str(final) and not raced:
            raced.append(True)
            write_checkpoint(st, final, b"theirs")  # commits right after our check
            return False
        return real(p)

    monkeypatch.setattr(os.path, "lexists", lexists_then_race)
    txn.commit()
    monkeypatch.undo()
    assert raced and read_all(st, final) == b"mine"
    assert entries(tmp_path) == ["ckpt"]


def test_overwrite_swaps_atomically(st: LocalStorage, tmp_path: Path) -> None:
    final = tmp_path / "ckpt"
    write_checkpoint(st, final, b"version one")
    txn = write_checkpoint(st, final, b"version two!", overwrite=True, commit=False)
    # until commit the old checkpoint is what readers see
    assert read_all(st, final) == b"version one"
    txn.commit()
    assert read_all(st, final) == b"version two!"
    assert entries(tmp_path) == ["ckpt"]  # old copy and temp dir cleaned up


def test_overwrite_of_empty_dir(st: LocalStorage, tmp_path: Path) -> None:
    (tmp_path / "ckpt").mkdir()
    with pytest.raises(CheckpointExistsError):
        st.begin_write(str(tmp_path / "ckpt"), overwrite=False)
    write_checkpoint(st, tmp_path / "ckpt", overwrite=True)
    assert st.is_committed(str(tmp_path / "ckpt"))


def test_overwrite_refuses_non_checkpoint_dir(st: LocalStorage, tmp_path: Path) -> None:
    d = tmp_path / "precious"
    d.mkdir()
    (d / "thesis.tex").write_text("do not delete")
    with pytest.raises(CheckpointExistsError, match="not a statestream checkpoint"):
        st.begin_write(str(d), overwrite=True)
    assert (d / "thesis.tex").read_text() == "do not delete"
    assert entries(tmp_path) == ["precious"]


def test_overwrite_refuses_regular_file_and_symlink(st: LocalStorage, tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(CheckpointExistsError, match="not a statestream checkpoint"):
        st.begin_write(str(f), overwrite=True)
    write_checkpoint(st, tmp_path / "real")
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "real")
    # a link to a checkpoint was "not a statestream checkpoint": it says what it is
    with pytest.raises(CheckpointExistsError, match=f"is a symbolic link \\(to {tmp_path}/real\\); "
                       "statestream never replaces a link"):
        st.begin_write(str(link), overwrite=True)
    assert f.read_text() == "x" and link.is_symlink()


def test_commit_rechecks_target_is_replaceable(st: LocalStorage, tmp_path: Path) -> None:
    final = tmp_path / "ckpt"
    txn = write_checkpoint(st, final, commit=False, overwrite=True)
    final.mkdir()
    (final / "other.txt").write_text("keep")
    with pytest.raises(CheckpointExistsError, match="not a statestream checkpoint"):
        txn.commit()
    assert (final / "other.txt").read_text() == "keep"
    assert entries(tmp_path) == ["ckpt"]


# ----------------------------------------------------------------------------- read


def test_open_read_requires_commit_marker(st: LocalStorage, tmp_path: Path) -> None:
    final = tmp_path / "ckpt"
    write_checkpoint(st, final)
    (final / COMMIT_NAME).unlink()
    assert not st.is_committed(str(final))
    with pytest.raises(CheckpointNotFoundError, match="no COMMITTED marker") as ei:
        st.open_read(str(final))
    assert isinstance(ei.value, FileNotFoundError)


def test_open_read_on_a_file(st: LocalStorage, tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(CheckpointNotFoundError):
        st.open_read(str(tmp_path / "f"))


def test_read_into_several_buffers_and_offsets(st: LocalStorage, tmp_path: Path) -> None:
    write_checkpoint(st, tmp_path / "c", bytes(range(100)))
    r = st.open_read(str(tmp_path / "c"))
    try:
        assert r.location == str(tmp_path / "c")
        a, b = bytearray(10), np.empty(20, dtype=np.uint8)
        r.read_into("data/r0-0.bin", 30, [a, bytearray(0), b])
        assert bytes(a) == bytes(range(30, 40)) and bytes(b) == bytes(range(40, 60))
        f32 = np.empty(2, dtype=np.float32)
        r.read_into("data/r0-0.bin", 0, [f32])  # any writable buffer, cast to bytes
        assert f32.tobytes() == bytes(range(8))
        assert r.file_size("data/r0-0.bin") == 100
    finally:
        r.close()
    r.close()  # idempotent


def test_read_into_past_eof_is_truncation(st: LocalStorage, tmp_path: Path) -> None:
    write_checkpoint(st, tmp_path / "c", b"0123456789")
    r = st.open_read(str(tmp_path / "c"))
    try:
        with pytest.raises(TruncatedFileError, match=r"ends at byte 10.*truncated"):
            r.read_into("data/r0-0.bin", 5, [bytearray(8)])
        with pytest.raises(TruncatedFileError):
            r.read_into("data/r0-0.bin", 100, [bytearray(1)])
    finally:
        r.close()


def test_missing_data_file_is_truncation(st: LocalStorage, tmp_path: Path) -> None:
    write_checkpoint(st, tmp_path / "c")
    r = st.open_read(str(tmp_path / "c"))
    try:
        with pytest.raises(TruncatedFileError, match="data/r0-1.bin is missing"):
            r.file_size("data/r0-1.bin")
    finally:
        r.close()


@pytest.mark.parametrize("name", ["data/../manifest.json", "manifest.json", "data/a/b"])
def test_reader_validates_data_file_names(st: LocalStorage, tmp_path: Path, name: str) -> None:
    write_checkpoint(st, tmp_path / "c")
    r = st.open_read(str(tmp_path / "c"))
    try:
        with pytest.raises(UnsafeCheckpointError):
            r.read_into(name, 0, [bytearray(1)])
    finally:
        r.close()


def test_reader_rejects_symlinked_data_file(st: LocalStorage, tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(b"top secret bytes")
    final = tmp_path / "c"
    write_checkpoint(st, final)
    data_file = final / "data" / "r0-0.bin"
    data_file.unlink()
    data_file.symlink_to(secret)
    r = st.open_read(str(final))
    try:
        with pytest.raises(UnsafeCheckpointError, match="symbolic link"):
            r.read_into("data/r0-0.bin", 0, [bytearray(3)])
        with pytest.raises(UnsafeCheckpointError):
            r.file_size("data/r0-0.bin")
    finally:
        r.close()


def test_reader_rejects_symlinked_data_dir(st: LocalStorage, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "r0-0.bin").write_bytes(b"outside bytes")
    final = tmp_path / "c"
    write_checkpoint(st, final)
    shutil.rmtree(final / "data")
    (final / "data").symlink_to(outside, target_is_directory=True)
    r = st.open_read(str(final))
    try:
        with pytest.raises(UnsafeCheckpointError, match="symbolic link"):
            r.read_into("data/r0-0.bin", 0, [bytearray(3)])
    finally:
        r.close()


def test_read_bytes(st: LocalStorage, tmp_path: Path) -> None:
    write_checkpoint(st, tmp_path / "c")
    r = st.open_read(str(tmp_path / "c"))
    try:
        assert r.read_bytes(COMMIT_NAME, 6) == b"marker"
        assert r.read_bytes("manifest.json", 100) == b"{}"
        with pytest.raises(CheckpointCorruptError, match="6 bytes, over the 5-byte limit"):
            r.read_bytes(COMMIT_NAME, 5)
        with pytest.raises(CheckpointCorruptError, match="missing"):
            r.read_bytes("nothing.json", 100)
    finally:
        r.close()


def test_read_bytes_refuses_symlinks(st: LocalStorage, tmp_path: Path) -> None:
    (tmp_path / "evil.json").write_text("{}")
    final = tmp_path / "c"
    write_checkpoint(st, final)
    (final / "manifest.json").unlink()
    (final / "manifest.json").symlink_to(tmp_path / "evil.json")
    r = st.open_read(str(final))
    try:
        with pytest.raises(UnsafeCheckpointError, match="safely"):
            r.read_bytes("manifest.json", 100)
    finally:
        r.close()


def test_reader_keeps_reading_after_overwrite(st: LocalStorage, tmp_path: Path) -> None:
    final = tmp_path / "c"
    write_checkpoint(st, final, b"first")
    r = st.open_read(str(final))
    try:
        buf = bytearray(5)
        r.read_into("data/r0-0.bin", 0, [buf])  # opens the file handle
        write_checkpoint(st, final, b"second", overwrite=True)
        r.read_into("data/r0-0.bin", 0, [buf])
        assert bytes(buf) == b"first"
    finally:
        r.close()
    assert read_all(st, final) == b"second"


# ----------------------------------------------------------------------------- list / delete


def test_list(st: LocalStorage, tmp_path: Path) -> None:
    assert st.list(str(tmp_path / "nothing")) == []
    write_checkpoint(st, tmp_path / "b")
    write_checkpoint(st, tmp_path / "a")
    assert st.list(str(tmp_path)) == ["a", "b"]


def test_delete_removes_marker_first(st: LocalStorage, tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    final = tmp_path / "c"
    write_checkpoint(st, final)
    seen: list[Any] = []
    real_rmtree = shutil.rmtree

    def spy(path: Any, *args: Any, **kwargs: Any) -> None:
        seen.append((str(path), os.path.exists(os.path.join(path, COMMIT_NAME)),
                     os.path.exists(os.path.join(path, "data", "r0-0.bin"))))
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", spy)
    st.delete(str(final))
    # when the data starts to go, the checkpoint is already uncommitted
    assert seen == [(str(final), False, True)]
    assert not final.exists()
    assert not st.is_committed(str(final))


def test_delete_missing_and_uncommitted(st: LocalStorage, tmp_path: Path) -> None:
    st.delete(str(tmp_path / "nothing"))
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "x").write_text("x")
    st.delete(str(tmp_path / "half"))
    assert entries(tmp_path) == []
