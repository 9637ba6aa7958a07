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
        (lambda tmp: ss.KeepLatest(-1), "KeepLatest needs n >= 0"),
        (lambda tmp: ss.KeepEvery(0), "KeepEvery needs k >= 1"),
        (lambda tmp: ss.EveryNSeconds(-5.0), "EveryNSeconds needs seconds >= 0"),
        (lambda tmp: _manager_load(tmp, step=-1), "step must be >= 0"),
        (lambda tmp: ss.KeepBest(2, "loss", mode="median"), "'min' or 'max'"),
        (lambda tmp: ss.IOOptions(max_chunk_bytes=0), "must be positive"),
        (lambda tmp: ss.MemoryOptions(memory_budget_bytes=0),
         r"memory_budget_bytes must be positive \(bytes\), or None .*, not 0"),
        (lambda tmp: ss.MemoryOptions(memory_budget_bytes=np.int64(-5)),
         "memory_budget_bytes must be positive"),
        (lambda tmp: ss.convert(_saved(tmp), str(tmp / "out"), to="zip"), "known formats"),
        (lambda tmp: ss.convert(_saved(tmp), str(tmp / "out"), to="safetensors",
                                max_shard_bytes=0), "max_shard_bytes must be positive"),
        # other formats are not sharded: the option was silently ignored
        (lambda tmp: ss.convert(_saved(tmp), str(tmp / "out.pt"), max_shard_bytes=10),
         r"max_shard_bytes=...\) shards safetensors output; torch is not sharded"),
        (lambda tmp: ss.convert(_saved(tmp), str(tmp / "out"), max_shard_bytes=10),
         "statestream is not sharded"),
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


def _manager_save(tmp: Path, **kw: Any) -> None:
    with ss.CheckpointManager(tmp / "run", async_save=False) as mgr:
        mgr.save(1, {"w": np.ones(2)}, **kw)


def _manager_load(tmp: Path, **kw: Any) -> None:
    with ss.CheckpointManager(tmp / "run", async_save=False) as mgr:
        mgr.save(1, {"w": np.ones(2)})
        mgr.load(**kw)


def _saved(tmp: Path) -> str:
    path = str(tmp / "ck")
    ss.save(path, {"w": np.arange(3.0)})
    return path


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda tmp: ss.save(tmp / "a", {"w": np.ones(2)}, io=5), "io must be an ss.IOOptions"),
        (lambda tmp: ss.save_async(tmp / "a", {"w": np.ones(2)}, memory=5),
         "memory must be an ss.MemoryOptions"),
        (lambda tmp: ss.load(_saved(tmp), io="fast"),
         r"io must be an ss.IOOptions .*, not str 'fast'"),
        (lambda tmp: ss.load(_saved(tmp), items=[1]), "items takes key paths"),
        (lambda tmp: ss.verify(_saved(tmp), memory=1 << 20), "memory must be an ss.MemoryOptions"),
        (lambda tmp: ss.convert(_saved(tmp), str(tmp / "o"), io=4), "io must be an ss.IOOptions"),
        (lambda tmp: ss.save(tmp / "a", {"w": np.ones(2)}, pickle_paths=[("w",)]),
         "pickle_paths takes key paths"),
        (lambda tmp: ss.CheckpointManager(tmp / "r", keep_policy=3),
         r"keep_policy must be a policy object with a keep\(\) method \(e.g. ss.KeepLatest"),
        (lambda tmp: ss.CheckpointManager(tmp / "r", keep_policy=ss.KeepLatest),
         "an instance, not the class"),
        (lambda tmp: ss.CheckpointManager(tmp / "r", save_policy=100),
         r"save_policy must be a policy object with a should_save\(\) method"),
        (lambda tmp: ss.CheckpointManager(tmp / "r", io=ss.MemoryOptions()),
         r"io must be an ss.IOOptions .*, not MemoryOptions"),
        (lambda tmp: ss.MemoryOptions(memory_budget_bytes="1GB"),
         "memory_budget_bytes must be an int"),
        (lambda tmp: ss.IOOptions(num_threads=2.0), "num_threads must be an int"),
        (lambda tmp: ss.IOOptions(map_files="no"), "map_files must be a bool"),
        (lambda tmp: ss.KeepLatest("3"), "KeepLatest needs an int n, not str"),
        (lambda tmp: ss.EveryNSteps(2.5), "EveryNSteps needs an int n"),
        (lambda tmp: ss.KeepBest(2, metric=None), "KeepBest needs a metric name"),
        (lambda tmp: ss.AtSteps(100), "AtSteps takes a collection of steps"),
        (lambda tmp: ss.AnyOf(ss.EveryNSteps(2), 5), r"AnyOf takes policy objects"),
        (lambda tmp: ss.KeepUnion(ss.KeepLatest), "an instance, .* not the class"),
        (lambda tmp: ss.EveryNSeconds("60"), "EveryNSeconds needs a number of seconds"),
        (lambda tmp: ss.save(tmp / "a", {"w": np.ones(2)}, progress=5),
         r"progress must be a callable progress\(bytes_done, bytes_total\)"),
        (lambda tmp: ss.load(_saved(tmp), progress="bar"), "progress must be a callable"),
        (lambda tmp: ss.save(tmp / "a", {"w": np.ones(2)}, collective=2),
         "collective must be a statestream Collective"),
        (lambda tmp: ss.save(tmp / "a", {"w": np.ones(2)}, base=3),
         "base must be a path or URL"),
        (lambda tmp: ss.convert(_saved(tmp), str(tmp / "o"), to="safetensors",
                                max_shard_bytes="5GB"), "max_shard_bytes must be an int"),
        (lambda tmp: _manager_save(tmp, metrics=[0.5]), "metrics must be a mapping"),
    ],
)
def test_options_of_the_wrong_type_are_named_before_anything_runs(
        tmp_path: Path, make: Callable[[Path], Any], match: str) -> None:
    """They were AttributeErrors from inside the engine ('int' object has no attribute
    'write_threads'), or, for a manager's policies and options, errors at the first
    save; nothing is written."""
    with pytest.raises(InvalidOptionTypeError, match=match) as ei:
        make(tmp_path)
    assert isinstance(ei.value, TypeError)
    assert not (tmp_path / "a").exists() and not (tmp_path / "o").exists()


def test_one_key_path_may_be_a_str_and_numpy_numbers_are_options(tmp_path: Path) -> None:
    """A single key path as a str is that key path (it was taken one character at a
    time: 'extra/tok' as 'e', 'x', ...); NumPy integers and bools are accepted."""
    ss.save(tmp_path / "p", {"extra": {"tok": object()}, "w": np.ones(2)},
            pickle_paths="extra/tok")
    out = ss.load(tmp_path / "p", items="w", allow_pickle="extra/tok")
    assert list(out) == ["w"]
    mem = ss.MemoryOptions(memory_budget_bytes=np.int64(1 << 20), keep_staging=np.bool_(True))
    assert type(mem.memory_budget_bytes) is int and mem.keep_staging is True


@pytest.mark.parametrize("bad", [3, None, 1.5, [b"w"]])
def test_load_allow_pickle_neither_a_bool_nor_key_paths(tmp_path: Path, bad: Any) -> None:
    """A number or None was a plain TypeError from inside the pickle check ('int'
    object is not iterable), raised only once the checkpoint was open: now it is named
    before anything is read (a missing checkpoint is not even looked at)."""
    with pytest.raises(InvalidOptionTypeError, match="allow_pickle takes True, False or key"):
        ss.load(_saved(tmp_path), allow_pickle=bad)
    with pytest.raises(InvalidOptionTypeError, match="allow_pickle"):
        ss.load(tmp_path / "missing", allow_pickle=bad)


def test_load_allow_pickle_takes_a_numpy_bool(tmp_path: Path) -> None:
    ss.save(tmp_path / "p", {"tok": object()}, pickle_paths=["tok"])
    assert type(ss.load(tmp_path / "p", allow_pickle=np.bool_(True))["tok"]) is object


@pytest.mark.parametrize("bad", [3, "yes", ["w"], None])
@pytest.mark.parametrize("call", ["verify", "metadata", "convert"])
def test_allow_pickle_of_verify_metadata_convert_is_a_bool(tmp_path: Path, call: str,
                                                           bad: Any) -> None:
    """Their allow_pickle is True or False (docstrings); any truthy value was taken as
    True, key paths too."""
    path = _saved(tmp_path)
    run: dict[str, Callable[[], Any]] = {
        "verify": lambda: ss.verify(path, allow_pickle=bad),
        "metadata": lambda: ss.metadata(path, allow_pickle=bad),
        "convert": lambda: ss.convert(path, str(tmp_path / "o"), allow_pickle=bad),
    }
    with pytest.raises(InvalidOptionTypeError, match="allow_pickle must be True or False"):
        run[call]()
    assert not (tmp_path / "o").exists()
    assert ss.verify(path, allow_pickle=np.bool_(True)).ok


_PATH_TAKERS: dict[str, tuple[str, Callable[[Path, Any], Any]]] = {
    "load": ("path", lambda tmp, bad: ss.load(bad)),
    "load-io": ("path", lambda tmp, bad: ss.load(bad, io=ss.IOOptions())),
    "metadata": ("path", lambda tmp, bad: ss.metadata(bad)),
    "verify": ("path", lambda tmp, bad: ss.verify(bad)),
    "save": ("path", lambda tmp, bad: ss.save(bad, {"w": np.ones(1)})),
    "save_async": ("path", lambda tmp, bad: ss.save_async(bad, {"w": np.ones(1)}).result()),
    "convert-src": ("src", lambda tmp, bad: ss.convert(bad, tmp / "o")),
    "convert-dst": ("dst", lambda tmp, bad: ss.convert(_saved(tmp), bad)),
    "manager": ("directory", lambda tmp, bad: ss.CheckpointManager(bad)),
    "manager-tier": ("local_tier", lambda tmp, bad: ss.CheckpointManager(tmp / "r",
                                                                         local_tier=bad)),
}


@pytest.mark.parametrize(("call", "bad"), [
    (call, bad) for call in sorted(_PATH_TAKERS) for bad in (None, 5)
    if (call, bad) != ("manager-tier", None)])  # no local tier: the default
def test_a_path_that_is_no_path_is_named(tmp_path: Path, call: str, bad: Any) -> None:
    """None or a number as a checkpoint path was a plain TypeError from os.fspath
    ('expected str, bytes or os.PathLike object'), naming no argument."""
    name, run = _PATH_TAKERS[call]
    with pytest.raises(InvalidOptionTypeError,
                       match=f"^{name} must be a path or URL .*, not {type(bad).__name__}"):
        run(tmp_path, bad)
    assert not (tmp_path / "o").exists() and not (tmp_path / "r").exists()


@pytest.mark.parametrize("bad", [5, [("epoch", 3)], "epoch=3"])
def test_meta_that_is_not_a_mapping(tmp_path: Path, bad: Any) -> None:
    """It was a plain TypeError ('int' object is not iterable), or a list of pairs taken
    as a dict, from the check of its JSON."""
    for run in (ss.save, lambda p, s, **kw: ss.save_async(p, s, **kw).result()):
        with pytest.raises(InvalidOptionTypeError, match="meta must be a mapping"):
            run(tmp_path / "a", {"w": np.ones(1)}, meta=bad)
    assert not (tmp_path / "a").exists()


_FLAG_TAKERS: dict[str, Callable[[Path, Any], Any]] = {
    "save-overwrite": lambda tmp, bad: ss.save(tmp / "a", {"w": np.ones(1)}, overwrite=bad),
    "save-hashes": lambda tmp, bad: ss.save(tmp / "a", {"w": np.ones(1)}, hashes=bad),
    "save-node_local": lambda tmp, bad: ss.save(tmp / "a", {"w": np.ones(1)}, node_local=bad),
    "save_async-lazy": lambda tmp, bad: ss.save_async(tmp / "a", {"w": np.ones(1)},
                                                      lazy=bad).result(),
    "save_async-overwrite": lambda tmp, bad: ss.save_async(tmp / "a", {"w": np.ones(1)},
                                                           overwrite=bad).result(),
    "convert-overwrite": lambda tmp, bad: ss.convert(_saved(tmp), tmp / "a", overwrite=bad),
    "load-in_place": lambda tmp, bad: ss.load(_saved(tmp), target={"w": np.ones(1)},
                                              in_place=bad),
}


@pytest.mark.parametrize("bad", ["no", 1, None])
@pytest.mark.parametrize("call", sorted(_FLAG_TAKERS))
def test_a_flag_is_true_or_false(tmp_path: Path, call: str, bad: Any) -> None:
    """A truthy non-bool was taken as True: overwrite="no" replaced a checkpoint,
    in_place="no" loaded into the target."""
    name = call.split("-")[1]
    with pytest.raises(InvalidOptionTypeError, match=f"^{name} must be True or False"):
        _FLAG_TAKERS[call](tmp_path, bad)
    assert not (tmp_path / "a").exists()


def test_manager_metadata_that_is_not_a_mapping(tmp_path: Path) -> None:
    """It was a plain TypeError from dict(5)."""
    with ss.CheckpointManager(tmp_path / "r") as mgr:
        with pytest.raises(InvalidOptionTypeError, match="^metadata must be a mapping"):
            mgr.save(1, {"w": np.ones(1)}, metadata=5)
        assert mgr.save(1, {"w": np.ones(1)}, metadata={"epoch": 3})
        mgr.wait()
        assert mgr.steps() == [1]


@pytest.mark.parametrize(("bad", "err"), [(-1, InvalidOptionError), (0, InvalidOptionError),
                                          (float("nan"), InvalidOptionError),
                                          (float("inf"), InvalidOptionError),
                                          ("60", InvalidOptionTypeError)])
def test_collective_timeouts_are_positive_seconds(bad: Any, err: type[Exception]) -> None:
    """TorchCollective(timeout_s=-1) raised torch's own ValueError from timedelta
    arithmetic; NaN made every wait end at once; JaxCollective took any of them."""
    pytest.importorskip("torch")
    with pytest.raises(err, match="^timeout_s must be"):
        ss.TorchCollective(timeout_s=bad)
    pytest.importorskip("jax")
    with pytest.raises(err, match="^timeout_s must be"):
        ss.JaxCollective(timeout_s=bad)
    with pytest.raises(err, match="^dead_after_s must be"):
        ss.JaxCollective(dead_after_s=bad)


@pytest.mark.parametrize(("bad", "err"), [(-1, InvalidOptionError),
                                          (float("nan"), InvalidOptionError),
                                          ("60", InvalidOptionTypeError)])
def test_manager_lease_ttl_is_positive_seconds(tmp_path: Path, bad: Any,
                                               err: type[Exception]) -> None:
    """-1 or NaN was taken: an object store's lease that never holds (renewed every
    third of it, taken over at once)."""
    with pytest.raises(err, match="^lease_ttl_s must be"):
        ss.CheckpointManager(tmp_path / "r", lease_ttl_s=bad)
    with ss.CheckpointManager(tmp_path / "r", lease_ttl_s=30) as mgr:  # not left locked
        assert mgr.steps() == []


_MAX_ARRAYS_TAKERS: dict[str, Callable[[Path, Any], Any]] = {
    "load": lambda tmp, bad: ss.load(_saved(tmp), max_arrays=bad),
    "metadata": lambda tmp, bad: ss.metadata(_saved(tmp), max_arrays=bad),
    "verify": lambda tmp, bad: ss.verify(_saved(tmp), max_arrays=bad),
    "convert": lambda tmp, bad: ss.convert(_saved(tmp), tmp / "o", max_arrays=bad),
    "manager-load": lambda tmp, bad: _manager_load(tmp, max_arrays=bad),
}


@pytest.mark.parametrize(("bad", "err"), [
    (0, InvalidOptionError), (-1, InvalidOptionError), (1 << 24 | 1, InvalidOptionError),
    (True, InvalidOptionTypeError), ("3", InvalidOptionTypeError),
    (3.0, InvalidOptionTypeError)])
@pytest.mark.parametrize("call", sorted(_MAX_ARRAYS_TAKERS))
def test_max_arrays_is_checked_by_every_taker(tmp_path: Path, call: str, bad: Any,
                                              err: type[Exception]) -> None:
    """load's ``max_arrays`` check, where metadata, verify, convert and a manager's
    load take it too: named before anything is read or written."""
    with pytest.raises(err, match="^max_arrays must be (from 1 to 16777216|an int)") as ei:
        _MAX_ARRAYS_TAKERS[call](tmp_path, bad)
    assert isinstance(ei.value, ValueError if err is InvalidOptionError else TypeError)
    assert not (tmp_path / "o").exists()
