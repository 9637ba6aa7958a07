"""A load's bound on the arrays a manifest declares (``max_arrays``, default the
format's ``MAX_ARRAYS``; a caller picks a tighter one for checkpoints from elsewhere),
checked while the manifest is parsed, before an entry is built, in each form a manifest takes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import statestream as ss
from statestream.api._options import max_arrays_option
from statestream.format import MAX_ARRAYS

from .conftest import read_doc, write_doc


def _empty_arrays(c: Path, n: int, version: int) -> None:
    """Re-sealed manifest of ``n`` empty float32 arrays ``a0``... (no data at all): the
    list form (format v1; over 1 MiB it is parsed entry by entry) or a v3 table."""
    doc = read_doc(c)
    doc["version"], doc["files"] = version, []
    keys = [f"a{i}" for i in range(n)]
    if version == 1:
        doc["arrays"] = [{"dtype": "float32", "shape": [0], "chunks": []}] * n
        doc["tree"] = {"t": "dict", "k": keys,
                       "c": [{"t": "array", "a": i, "x": {"kind": "numpy"}} for i in range(n)]}
    else:
        doc["arrays"] = {"dtypes": ["float32"], "dtype": [0] * n, "ndim": [1] * n,
                         "shape": [0] * n, "nchunks": [0] * n, "chunks": [], "boxes": []}
        doc["tree"] = {"t": "dict", "k": keys, "ak": "numpy", "c": list(range(n))}
    write_doc(c, doc)


@pytest.mark.parametrize(("version", "n"), [(1, 300), (1, 30_000), (3, 3000)])
def test_a_manifest_of_more_arrays_than_max_arrays_is_refused(ckpt: Path, version: int,
                                                               n: int) -> None:
    """A small list (one parse), a list over 1 MiB (entry by entry: refused at the
    first entry over the limit) and a table: each refused naming the manifest and the
    limit; at the limit it loads."""
    _empty_arrays(ckpt, n, version)
    if version == 1 and n > 1000:
        assert (ckpt / "manifest.json").stat().st_size > 1 << 20
    many = f"more than {n - 1}" if n > 1000 and version == 1 else str(n)
    with pytest.raises(ss.CheckpointError) as e:
        ss.load(ckpt, max_arrays=n - 1)
    assert type(e.value) is ss.CheckpointError  # not damage: a manager would skip the step
    assert str(e.value) == (
        f"manifest {ckpt}/manifest.json declares {many} arrays, over the caller's limit of "
        f"{n - 1} (max_arrays); nothing was read. A checkpoint you trust with more arrays "
        f"loads with max_arrays= set higher (at most {MAX_ARRAYS}, the format's limit)")
    out = ss.load(ckpt, max_arrays=n)
    assert len(out) == n and out[f"a{n - 1}"].shape == (0,)


def test_the_default_bound_is_the_formats(ckpt: Path) -> None:
    """By default a load admits what the format admits: a checkpoint a save could write
    (up to 2^24 arrays) never needs an option to load, through a manager or a trainer
    integration that passes none; ``max_arrays`` is the tighter bound a caller picks for
    checkpoints from elsewhere. (The default was 2^20 for a while on 2026-12-06.)"""
    assert max_arrays_option(None) == MAX_ARRAYS
    _empty_arrays(ckpt, 3000, 3)
    assert len(ss.load(ckpt)) == 3000


def test_a_real_checkpoint_within_the_bound_loads(tmp_path: Path) -> None:
    ss.save(tmp_path / "c", {"w": np.ones(3), "b": {"x": np.zeros(2)}})
    with pytest.raises(ss.CheckpointError, match="declares 2 arrays.*limit of 1"):
        ss.load(tmp_path / "c", max_arrays=1)
    assert ss.load(tmp_path / "c", max_arrays=2)["w"].tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize(("value", "err"), [
    (0, ss.InvalidOptionError), (MAX_ARRAYS + 1, ss.InvalidOptionError),
    (True, ss.InvalidOptionTypeError), ("10", ss.InvalidOptionTypeError),
    (1.5, ss.InvalidOptionTypeError)])
def test_max_arrays_is_checked_where_it_enters(ckpt: Path, value: Any,
                                               err: type[Exception]) -> None:
    with pytest.raises(err, match="max_arrays must be"):
        ss.load(ckpt, max_arrays=value)


def test_a_table_is_counted_before_the_tree_is_parsed(ckpt: Path) -> None:
    """A table's arrays are counted as soon as it is parsed: the tree after it (as many
    nodes again, the larger part of a hostile manifest) is not decoded at all; here it
    is malformed, and the load still reports the limit."""
    _empty_arrays(ckpt, 3000, 3)
    doc = read_doc(ckpt)
    doc["tree"] = {"t": "not a node"}
    write_doc(ckpt, doc)
    with pytest.raises(ss.CheckpointError, match="declares 3000 arrays, over the caller's limit"):
        ss.load(ckpt, max_arrays=2999)
    with pytest.raises(ss.CheckpointCorruptError, match="unknown tree node type"):
        ss.load(ckpt)


def test_a_foreign_checkpoint_over_max_arrays_is_named_as_a_checkpoint(tmp_path: Path) -> None:
    """A safetensors file of more arrays than ``max_arrays``: the error said "manifest",
    which a foreign file has none of; it names the file as a checkpoint."""
    st = pytest.importorskip("safetensors.numpy")
    path = tmp_path / "w.safetensors"
    st.save_file({f"t{i}": np.zeros(2, np.float32) for i in range(3)}, str(path))
    with pytest.raises(ss.CheckpointError) as e:
        ss.load(path, max_arrays=2)
    assert type(e.value) is ss.CheckpointError
    assert str(e.value).startswith(f"checkpoint {path} declares 3 arrays, over the caller's "
                                   "limit of 2 (max_arrays)")
    assert len(ss.load(path, max_arrays=3)) == 3
