"""A conversion never replaces a symbolic link at its destination. A link to a checkpoint
directory was told 'pass --overwrite to replace it', and with --overwrite was called 'a
file'; a file output replaced a link to a file by the file."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import statestream as ss
from statestream.cli import main


@pytest.mark.parametrize("to", ["dcp", "safetensors", "statestream", "torch"])
@pytest.mark.parametrize("overwrite", [False, True])
def test_a_link_is_named_and_never_replaced(tmp_path: Path, to: str, overwrite: bool) -> None:
    src = tmp_path / "src"
    ss.save(src, {"w": np.ones(4, np.float32)})
    ss.save(tmp_path / "old", {"w": np.zeros(4, np.float32)})
    file_out = to == "torch"
    real = tmp_path / ("real.pt" if file_out else "real")
    ss.convert(tmp_path / "old", real, to=to)
    link = tmp_path / "latest"
    link.symlink_to(real)
    with pytest.raises(ss.CheckpointExistsError,
                       match=f"is a symbolic link \\(to {real}\\); .* never replaces a link"):
        ss.convert(src, link, to=to, overwrite=overwrite)
    assert os.readlink(link) == str(real)
    assert ss.load(real)["w"].tolist() == [0.0] * 4
    args = ["convert", str(src), str(link), "--to", to] + ["--overwrite"] * overwrite
    assert main(args) == 2
    assert os.readlink(link) == str(real)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["src", "old", real.name,
                                                                 "latest"])


def test_a_dangling_link_is_not_replaced(tmp_path: Path) -> None:
    ss.save(tmp_path / "src", {"w": np.ones(4, np.float32)})
    (tmp_path / "m.safetensors").symlink_to(tmp_path / "nowhere")
    with pytest.raises(ss.CheckpointExistsError, match="symbolic link"):
        ss.convert(tmp_path / "src", tmp_path / "m.safetensors", overwrite=True)
    assert os.path.islink(tmp_path / "m.safetensors")
