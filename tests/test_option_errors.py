"""A caller's bad argument raises an error of statestream's tree that is also the builtin.

``InvalidOptionError`` is a ``ValueError``, ``InvalidOptionTypeError`` a
``TypeError``; both are ``CheckpointError`` (issue 13 item 5).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import statestream as ss
from statestream.errors import CheckpointError, InvalidOptionError, InvalidOptionTypeError
from statestream.testing import faults


def test_classes_sit_in_the_tree() -> None:
    assert issubclass(InvalidOptionError, CheckpointError)
    assert issubclass(InvalidOptionError, ValueError)
    assert issubclass(InvalidOptionTypeError, CheckpointError)
    assert issubclass(InvalidOptionTypeError, TypeError)
    assert ss.InvalidOptionError is InvalidOptionError
    assert ss.InvalidOptionTypeError is InvalidOptionTypeError


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda tmp: ss.EveryNSteps(0), "n >= 1"),
        (lambda tmp: ss.KeepBest(2, "loss", mode="median"), "'min' or 'max'"),
        (lambda tmp: ss.IOOptions(max_chunk_bytes=0), "must be positive"),
        (lambda tmp: ss.convert(_saved(tmp), str(tmp / "out"), to="zip"), "known formats"),
        (lambda tmp: faults.on("no.such.point", lambda: None), "unknown fault point"),
        (lambda tmp: faults.StorageFault(kind="gremlins"), "unknown fault kind"),
    ],
)
def test_bad_values_raise_invalid_option(tmp_path: Path, make: Callable[[Path], Any],
                                         match: str) -> None:
    with pytest.raises(InvalidOptionError, match=match) as ei:
        make(tmp_path)
    assert isinstance(ei.value, ValueError)


def test_manager_bad_values_raise_invalid_option(tmp_path: Path) -> None:
    with ss.CheckpointManager(tmp_path / "run", async_save=False) as mgr:
        with pytest.raises(InvalidOptionError, match="step must be >= 0"):
            mgr.save(-1, {"w": np.zeros(2)})
        with pytest.raises(InvalidOptionError, match="'min' or 'max'"):
            mgr.best_step("loss", mode="avg")


def test_allow_pickle_of_the_wrong_type(tmp_path: Path) -> None:
    with pytest.raises(InvalidOptionTypeError, match="allow_pickle"):
        ss.load(_saved(tmp_path), allow_pickle=[1])  # type: ignore[list-item]


def test_lightning_storage_options(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    from statestream.integrations.lightning import StatestreamCheckpointIO

    with pytest.raises(InvalidOptionTypeError, match="storage_options"):
        StatestreamCheckpointIO().save_checkpoint({"a": 1}, tmp_path / "s.ckpt",
                                                  storage_options={"x": 1})


def _saved(tmp: Path) -> str:
    path = str(tmp / "ck")
    ss.save(path, {"w": np.arange(3.0)})
    return path
