"""convert(overwrite=True) replaces a directory only when it holds a checkpoint and nothing
else: a Hugging Face model directory (one *.safetensors or shards, beside config.json and
a tokenizer) was replaced whole, its other files deleted without a word."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest

import statestream as ss
from statestream.cli import main
from statestream.interop._publish import checkpoint_strays

USER_FILES = ("README.md", "config.json", "tokenizer.json")


def _model_dir(tmp_path: Path, src: Path, *, sharded: bool) -> Path:
    hf = tmp_path / "hf"
    if sharded:
        ss.convert(src, hf, to="safetensors")
    else:
        hf.mkdir()
        ss.convert(src, hf / "model.safetensors")
    for name in USER_FILES:
        (hf / name).write_text("{}")
    return hf


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("to", ["safetensors", "statestream", "dcp"])
def test_a_model_directory_with_other_files_is_not_replaced(tmp_path: Path, to: str,
                                                            sharded: bool) -> None:
    src = tmp_path / "ck"
    ss.save(src, {"w": np.ones(4, np.float32)})
    hf = _model_dir(tmp_path, src, sharded=sharded)
    before = sorted(p.name for p in hf.iterdir())
    with pytest.raises(ss.CheckpointExistsError, match="'README.md', 'config.json'"):
        ss.convert(src, hf, to=to, overwrite=True)
    assert sorted(p.name for p in hf.iterdir()) == before
    assert main(["convert", str(src), str(hf), "--to", to, "--overwrite"]) == 2
    assert sorted(p.name for p in hf.iterdir()) == before
    assert ss.load(hf)["w"].tolist() == [1.0] * 4
    for name in USER_FILES:  # what the checkpoint's format holds alone is replaced
        (hf / name).unlink()
    ss.convert(src, hf, to=to, overwrite=True)
    assert ss.load(hf)["w"].tolist() == [1.0] * 4


def test_strays_of_each_layout(tmp_path: Path) -> None:
    src = tmp_path / "ck"
    ss.save(src, {"w": np.ones(4, np.float32)})
    ss.convert(src, tmp_path / "d", to="dcp")
    ss.convert(src, tmp_path / "sh", to="safetensors", max_shard_bytes=8)
    assert checkpoint_strays(str(tmp_path / "d")) == []
    assert checkpoint_strays(str(tmp_path / "sh")) == []
    assert checkpoint_strays(str(src)) == []  # a statestream checkpoint: replaced whole
    (tmp_path / "d" / "notes.txt").write_text("x")
    (tmp_path / "sh" / "model-00009-of-00009.safetensors").write_bytes(b"")  # not indexed
    assert checkpoint_strays(str(tmp_path / "d")) == ["notes.txt"]
    assert checkpoint_strays(str(tmp_path / "sh")) == ["model-00009-of-00009.safetensors"]
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "a.txt").write_text("x")
    assert checkpoint_strays(str(tmp_path / "other")) is None


def test_orbax_layouts_are_replaced_and_strays_refused(tmp_path: Path) -> None:
    ocp = pytest.importorskip("orbax.checkpoint")
    state = {"a": np.ones(4, np.float32), "b": {"c": np.arange(3)}, "n": 3}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ck = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False))
        ck.save(tmp_path / "plain", state)  # a directory per array (.zarray)
        with ocp.CheckpointManager(tmp_path / "mgr", item_names=("state", "extra")) as mgr:
            mgr.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                extra=ocp.args.JsonSave({"x": 1})))
            mgr.wait_until_finished()
    src = tmp_path / "ck"
    ss.save(src, {"w": np.ones(4, np.float32)})
    ss.convert(src, tmp_path / "ours", to="orbax")
    for d in ("plain", "mgr/1", "mgr/1/state", "ours"):
        assert checkpoint_strays(str(tmp_path / d)) == [], d
    (tmp_path / "mgr" / "1" / "extra" / "notes.txt").write_text("x")
    (tmp_path / "plain" / "README.md").write_text("x")
    assert checkpoint_strays(str(tmp_path / "mgr" / "1")) == ["extra"]
    with pytest.raises(ss.CheckpointExistsError, match="'README.md'"):
        ss.convert(src, tmp_path / "plain", to="dcp", overwrite=True)
    (tmp_path / "plain" / "README.md").unlink()
    ss.convert(src, tmp_path / "plain", to="dcp", overwrite=True)
    assert ss.metadata(tmp_path / "plain").format == "dcp"
