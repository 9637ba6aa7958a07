"""Error messages for paths that are not what the caller thought (issue 12)."""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import statestream as ss
from statestream.cli import main
from statestream.storage import S3Options, S3Storage, set_backend


def test_a_file_is_not_called_a_missing_directory(tmp_path: Path) -> None:
    f = tmp_path / "model.ckpt"
    f.write_bytes(b"torch.save output")
    with pytest.raises(ss.CheckpointNotFoundError, match="it is a file") as ei:
        ss.load(f)
    assert "does not exist" not in str(ei.value) and str(f) in str(ei.value)
    assert "safetensors and torch.save files" in str(ei.value)  # which files it would read
    with pytest.raises(ss.CheckpointNotFoundError, match="the directory does not exist"):
        ss.load(tmp_path / "nothing")
    with pytest.raises(ss.CheckpointNotFoundError, match="the directory does not exist"):
        ss.metadata(f / "below-a-file")


@pytest.mark.parametrize("kind", ["dir", "file"])
def test_no_overwrite_hint_where_overwrite_would_refuse(tmp_path: Path, kind: str) -> None:
    p = tmp_path / "results"
    if kind == "dir":
        p.mkdir()
        (p / "notes.txt").write_text("mine")
    else:
        p.write_text("mine")
    for overwrite in (False, True):
        with pytest.raises(ss.CheckpointExistsError) as ei:
            ss.save(p, {"w": np.ones(2)}, overwrite=overwrite)
        msg = str(ei.value)
        assert "not even with overwrite=True" in msg and "pass overwrite=True" not in msg
        assert ("a file" in msg) == (kind == "file")
    # a committed checkpoint still gets the hint, and overwrite=True works there
    ss.save(tmp_path / "ck", {"w": np.ones(2)})
    with pytest.raises(ss.CheckpointExistsError, match="pass overwrite=True"):
        ss.save(tmp_path / "ck", {"w": np.ones(2)})
    ss.save(tmp_path / "ck", {"w": np.zeros(2)}, overwrite=True)


def test_a_manager_directory_lists_its_steps(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    with ss.CheckpointManager(tmp_path / "run", async_save=False) as mgr:
        for s in (10, 20, 30):
            mgr.save(s, {"w": np.full(2, s)})
    with pytest.raises(ss.CheckpointNotFoundError) as ei:
        ss.load(tmp_path / "run")
    msg = str(ei.value)
    assert "CheckpointManager directory" in msg and "10, 20, 30" in msg
    assert "step_0000000030" in msg and "interrupted or foreign" not in msg
    assert main(["inspect", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "CheckpointManager directory" in err and "10, 20, 30" in err
    # an empty directory is still "no marker"
    (tmp_path / "empty").mkdir()
    with pytest.raises(ss.CheckpointNotFoundError, match="interrupted or foreign"):
        ss.load(tmp_path / "empty")


def test_a_manager_prefix_on_s3_lists_its_steps(s3_server: dict[str, Any]) -> None:
    opts = S3Options(endpoint=s3_server["endpoint"], region="us-east-1",
                     access_key_id=s3_server["aws_access_key_id"],
                     secret_access_key=s3_server["aws_secret_access_key"])
    set_backend("s3", S3Storage(opts))
    try:
        url = f"s3://{s3_server['bucket']}/m-{uuid.uuid4().hex[:8]}"
        with ss.CheckpointManager(url, async_save=False) as mgr:
            for s in (1, 2):
                mgr.save(s, {"w": np.full(2, s)})
        with pytest.raises(ss.CheckpointNotFoundError, match=r"CheckpointManager .* 1, 2"):
            ss.metadata(url)
    finally:
        set_backend("s3", None)


def test_a_file_where_a_parent_directory_should_be_is_named(tmp_path: Path) -> None:
    """It said '[Errno 17] File exists' (or 'Not a directory') of the path's parent."""
    (tmp_path / "afile").write_text("x")
    for dst in (tmp_path / "afile" / "ck", tmp_path / "afile" / "a" / "b" / "ck"):
        with pytest.raises(ss.StorageError,
                           match=re.escape(f"{tmp_path / 'afile'} is a file, not a directory")):
            ss.save(dst, {"w": np.ones(2)})


def test_a_trainer_checkpoint_names_the_statestream_checkpoint_in_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # StatestreamTrainer's layout (integrations/transformers.py): output_dir/checkpoint-<step>/
    # holds trainer_state.json and the statestream checkpoint "statestream"
    out = tmp_path / "out"
    for step in (3, 6):
        ss.save(out / f"checkpoint-{step}" / "statestream", {"w": np.full(2, step)})
        (out / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
    (out / ".checkpoint-9.partial").mkdir()
    with pytest.raises(ss.CheckpointNotFoundError) as ei:
        ss.load(out / "checkpoint-6")
    msg = str(ei.value)
    assert "Trainer checkpoint" in msg and str(out / "checkpoint-6" / "statestream") in msg
    with pytest.raises(ss.CheckpointNotFoundError) as ei:
        ss.load(out)
    msg = str(ei.value)
    assert "Trainer output directory" in msg and "steps 3, 6" in msg
    assert str(out / "checkpoint-6" / "statestream") in msg
    assert main(["inspect", str(out / "checkpoint-3")]) == 2
    assert str(out / "checkpoint-3" / "statestream") in capsys.readouterr().err


def test_a_fifo_or_device_is_named_not_called_a_missing_directory(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """It said 'no checkpoint at ...: the directory does not exist' for an existing FIFO
    (named like a safetensors file) and for /dev/null; nothing there is opened."""
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    cases = [(fifo, "a FIFO (named pipe)")]
    if os.path.exists("/dev/null"):
        cases.append((Path("/dev/null"), "a character device"))
    for path, what in cases:
        with pytest.raises(ss.CheckpointNotFoundError) as ei:
            ss.load(path)  # would block forever if the FIFO were opened
        msg = str(ei.value)
        assert f"it is {what}, not a directory or a regular file" in msg and str(path) in msg
        assert "does not exist" not in msg
        assert main(["inspect", str(path)]) == 2
        err = capsys.readouterr().err
        assert what in err and "does not exist" not in err
