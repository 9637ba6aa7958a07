"""``max_arrays`` wherever a manifest is read from a checkpoint that may come from
elsewhere: ``load``, ``metadata``, ``verify``, ``convert``, ``CheckpointManager.load``
and the CLI's ``inspect``, ``verify`` and ``convert`` (``--max-arrays N``), and the
manifests of an incremental checkpoint's bases, which were read with the format's
bound whatever the caller asked (tests/hardening/test_max_arrays.py: load's own)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import statestream as ss
from statestream.format import MAX_ARRAYS

from .conftest import run_cli

K = 3  # arrays of _state()


def _state(extra: int = 0) -> dict[str, Any]:
    s: dict[str, Any] = {"w": np.arange(4.0), "b": {"x": np.ones(2), "y": np.zeros(3)},
                         "step": 7}
    s.update({f"more{i}": np.full(2, float(i)) for i in range(extra)})
    return s


def refusal(manifest: Path, n: int, limit: int, cli: bool = False) -> str:
    """The refusal's text: the API's, or the CLI's (its option's name)."""
    if cli:
        return (f"manifest {manifest} declares {n} arrays, over the caller's limit of {limit} "
                "(--max-arrays); nothing was read. A checkpoint you trust with more arrays "
                f"is read with --max-arrays set higher (at most {MAX_ARRAYS}, the format's "
                "limit)")
    return (f"manifest {manifest} declares {n} arrays, over the caller's limit of {limit} "
            "(max_arrays); nothing was read. A checkpoint you trust with more arrays loads "
            f"with max_arrays= set higher (at most {MAX_ARRAYS}, the format's limit)")


def _manager(tmp: Path, tier: bool) -> ss.CheckpointManager:
    return ss.CheckpointManager(tmp / "run", async_save=False,
                                local_tier=str(tmp / "local") if tier else None)


#: entry point -> a call of it with ``max_arrays`` on the checkpoint at ``path``
_CALLS: dict[str, Callable[[Path, Path, Any], Any]] = {
    "load": lambda tmp, path, n: ss.load(path, max_arrays=n),
    "metadata": lambda tmp, path, n: ss.metadata(path, max_arrays=n),
    "verify": lambda tmp, path, n: ss.verify(path, max_arrays=n),
    "convert": lambda tmp, path, n: ss.convert(path, tmp / "out", max_arrays=n),
    "convert-safetensors": lambda tmp, path, n: ss.convert(path, tmp / "out.safetensors",
                                                           max_arrays=n),
}


def _check_result(call: str, out: Any, tmp: Path) -> None:
    if call == "load":
        assert out["w"].tolist() == [0.0, 1.0, 2.0, 3.0]
    elif call == "metadata":
        assert out.num_arrays == K
    elif call == "verify":
        assert out.ok and out.checked_chunks == K
    else:
        assert ss.load(out)["w"].tolist() == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize("call", sorted(_CALLS))
def test_each_entry_point_refuses_more_arrays(tmp_path: Path, call: str) -> None:
    """K arrays with max_arrays=K-1: the plain CheckpointError naming the manifest (not
    damage; verify raises it rather than report it); with K the call goes through."""
    ss.save(tmp_path / "ck", _state())
    with pytest.raises(ss.CheckpointError) as e:
        _CALLS[call](tmp_path, tmp_path / "ck", K - 1)
    assert type(e.value) is ss.CheckpointError
    assert str(e.value) == refusal(tmp_path / "ck" / "manifest.json", K, K - 1)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.safetensors").exists()
    _check_result(call, _CALLS[call](tmp_path, tmp_path / "ck", K), tmp_path)


@pytest.mark.parametrize("call", ["load", "verify", "convert"])
def test_a_bases_manifest_is_bounded_too(tmp_path: Path, call: str) -> None:
    """An incremental checkpoint within the bound whose base declares more arrays: the
    base's manifest is refused, named, before its entries are built (it was read with
    the format's bound, so max_arrays bounded only the checkpoint named)."""
    ss.save(tmp_path / "base", _state(extra=2), hashes=True)  # K + 2 arrays
    ss.save(tmp_path / "ck", _state(), base=tmp_path / "base")
    assert ss.metadata(tmp_path / "ck").bases == ["base"]
    with pytest.raises(ss.CheckpointError) as e:
        _CALLS[call](tmp_path, tmp_path / "ck", K + 1)
    assert type(e.value) is ss.CheckpointError
    assert str(e.value) == refusal(tmp_path / "base" / "manifest.json", K + 2, K + 1)
    assert not (tmp_path / "out").exists()
    _check_result(call, _CALLS[call](tmp_path, tmp_path / "ck", K + 2), tmp_path)
    # metadata reads the checkpoint's own manifest only: its bases are not opened
    assert ss.metadata(tmp_path / "ck", max_arrays=K).bases == ["base"]


@pytest.mark.parametrize("tier", [False, True])
def test_manager_load_passes_it_on(tmp_path: Path, tier: bool) -> None:
    """A step asked for by number and a resume (no step) are both refused, naming the
    newest step's manifest: over the bound is not damage, so no older step is tried."""
    with _manager(tmp_path, tier) as mgr:
        mgr.save(1, _state())
        mgr.save(2, _state())
        where = tmp_path / "run" / "step_0000000002" / "manifest.json"
        if tier:
            where = tmp_path / "local" / "step_0000000002" / "manifest.json"
        for step in (2, None):
            with pytest.raises(ss.CheckpointError) as e:
                mgr.load(step, max_arrays=K - 1)
            assert type(e.value) is ss.CheckpointError
            assert str(e.value) == refusal(where, K, K - 1)
        assert mgr.load(max_arrays=K)["w"].tolist() == [0.0, 1.0, 2.0, 3.0]
        assert mgr.load(1, max_arrays=K)["b"]["y"].tolist() == [0.0, 0.0, 0.0]


def test_an_incremental_managers_bases_are_bounded(tmp_path: Path) -> None:
    """A manager's incremental step whose base (the step before) declares more arrays
    than the step: refused at the base's manifest."""
    with ss.CheckpointManager(tmp_path / "run", async_save=False, incremental=True) as mgr:
        mgr.save(1, _state(extra=2))
        mgr.save(2, _state())
        assert ss.metadata(mgr.step_path(2)).bases == ["step_0000000001"]
        with pytest.raises(ss.CheckpointError) as e:
            mgr.load(2, max_arrays=K)
        assert str(e.value) == refusal(Path(mgr.step_path(1)) / "manifest.json", K + 2, K)
        assert mgr.load(max_arrays=K + 2)["w"].tolist() == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize("command", ["inspect", "verify", "convert"])
def test_the_cli_takes_max_arrays(tmp_path: Path, command: str) -> None:
    """Over the bound: exit 2 (an error, not damage: verify's 1), the refusal in the
    command's words; at the bound the command runs."""
    ss.save(tmp_path / "ck", _state())
    dst = [str(tmp_path / "out")] if command == "convert" else []
    r = run_cli(command, str(tmp_path / "ck"), *dst, "--max-arrays", str(K - 1))
    assert r.returncode == 2, r
    assert r.stderr == f"error: {refusal(tmp_path / 'ck' / 'manifest.json', K, K - 1, True)}\n"
    assert not (tmp_path / "out").exists()
    r = run_cli(command, str(tmp_path / "ck"), *dst, "--max-arrays", str(K))
    assert r.returncode == 0, r
    assert (tmp_path / "out").exists() == (command == "convert")


@pytest.mark.parametrize("bad", ["0", "-1", str(MAX_ARRAYS + 1), "3.0", "many"])
@pytest.mark.parametrize("command", ["inspect", "verify", "convert"])
def test_the_cli_refuses_a_bad_max_arrays(tmp_path: Path, command: str, bad: str) -> None:
    ss.save(tmp_path / "ck", _state())
    dst = [str(tmp_path / "out")] if command == "convert" else []
    r = run_cli(command, str(tmp_path / "ck"), *dst, f"--max-arrays={bad}")
    assert r.returncode == 2, r
    assert "argument --max-arrays:" in r.stderr and repr(bad) in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def _ls_and_diff_args(tmp: Path, command: str) -> list[str]:
    """``ls`` of the directory holding ``ck``; ``diff`` of ``ck`` against a checkpoint of
    fewer arrays (``small``) in both orders: each side is bounded."""
    ss.save(tmp / "small", {"w": np.arange(4.0)})
    return {"ls": [str(tmp)], "diff": [str(tmp / "small"), str(tmp / "ck")],
            "diff-reversed": [str(tmp / "ck"), str(tmp / "small")]}[command]


@pytest.mark.parametrize("command", ["ls", "diff", "diff-reversed"])
def test_ls_and_diff_take_max_arrays(tmp_path: Path, command: str) -> None:
    """K arrays with --max-arrays K-1: exit 2, the refusal naming the manifest and
    --max-arrays (ls does not list it as damaged); with K the command runs."""
    ss.save(tmp_path / "ck", _state())
    args = _ls_and_diff_args(tmp_path, command)
    r = run_cli(command.split("-")[0], *args, "--max-arrays", str(K - 1))
    assert r.returncode == 2, r
    assert r.stderr == f"error: {refusal(tmp_path / 'ck' / 'manifest.json', K, K - 1, True)}\n"
    assert r.stdout == ""
    r = run_cli(command.split("-")[0], *args, "--max-arrays", str(K), "--json")
    assert r.returncode == (0 if command == "ls" else 1), r  # diff: they differ
    if command == "ls":
        assert [e["state"] for e in json.loads(r.stdout)["entries"]] == ["committed"] * 2


def test_diff_bounds_the_bases_it_reads(tmp_path: Path) -> None:
    """An incremental checkpoint within the bound whose base declares more arrays: its
    metadata reads (no base), its arrays' reads follow the base and are refused there."""
    ss.save(tmp_path / "base", _state(extra=2), hashes=True)  # K + 2 arrays
    ss.save(tmp_path / "ck", _state(), base=tmp_path / "base")
    ss.save(tmp_path / "other", _state())
    args = [str(tmp_path / "other"), str(tmp_path / "ck")]
    r = run_cli("diff", *args, "--max-arrays", str(K + 1))
    assert r.returncode == 2, r
    assert r.stderr == (f"error: "
                        f"{refusal(tmp_path / 'base' / 'manifest.json', K + 2, K + 1, True)}\n")
    assert run_cli("diff", *args, "--max-arrays", str(K + 2)).returncode == 0


@pytest.mark.parametrize("bad", ["0", "-1", str(MAX_ARRAYS + 1), "3.0", "many"])
@pytest.mark.parametrize("command", ["ls", "diff"])
def test_ls_and_diff_refuse_a_bad_max_arrays(tmp_path: Path, command: str, bad: str) -> None:
    ss.save(tmp_path / "ck", _state())
    args = _ls_and_diff_args(tmp_path, command)
    r = run_cli(command, *args, f"--max-arrays={bad}")
    assert r.returncode == 2 and r.stdout == "", r
    assert "usage: statestream" in r.stderr, r.stderr
    assert "argument --max-arrays:" in r.stderr and repr(bad) in r.stderr, r.stderr
