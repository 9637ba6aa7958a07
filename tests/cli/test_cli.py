"""Tests for statestream.cli (``python -m statestream inspect|verify``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import statestream as ss
from statestream.cli import main


@pytest.fixture()
def ckpt(tmp_path: Path) -> Path:
    path = tmp_path / "step-1"
    ss.save(path, {
        "params": {"w/x": np.ones((2, 3), np.float32), "b": np.arange(5, dtype=np.int64)},
        "step": 3,
        "name": "run",
    })
    return path


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "statestream", *args], capture_output=True,
                          text=True, timeout=120, check=False)


def data_file(path: Path) -> Path:
    (f,) = sorted((path / "data").iterdir())
    return f


def damage(path: Path) -> None:
    f = data_file(path)
    raw = bytearray(f.read_bytes())
    raw[1] ^= 0xFF  # inside the first array's first chunk
    f.write_bytes(bytes(raw))


def test_inspect_table(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert str(ckpt) in out
    assert "statestream v1" in out
    lines = {ln.split()[0]: ln for ln in out.splitlines() if ln.strip()}
    w = lines["params/w~1x"].split()
    assert w[1:4] == ["numpy", "float32", "(2,"] and "24 B" in lines["params/w~1x"]
    assert "(5,)" in lines["params/b"] and "int64" in lines["params/b"]
    assert "40 B" in lines["params/b"]
    assert "value" in lines["step"] and "3" in lines["step"].split()
    assert "'run'" in lines["name"]
    assert "2 arrays, 64 B in 1 data file" in lines["total"]
    assert "4 leaves" in lines["total"]


def test_inspect_json(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "--json", str(ckpt)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["format_version"] == 1
    assert doc["path"] == str(ckpt)
    assert doc["total_bytes"] == 64 and doc["num_arrays"] == 2
    assert len(doc["files"]) == 1 and doc["files"][0][0] == "data/r0-0.bin"
    leaves = {leaf["key"]: leaf for leaf in doc["leaves"]}
    assert leaves["params/w~1x"] == {"key": "params/w~1x", "kind": "numpy", "dtype": "float32",
                                     "shape": "(2, 3)", "nbytes": 24, "stored_bytes": 24,
                                     "codec": None}
    assert leaves["params/b"]["shape"] == "(5,)" and leaves["params/b"]["nbytes"] == 40
    assert leaves["step"]["kind"] == "value" and leaves["step"]["dtype"] == "int"
    assert doc["meta"]["library"].startswith("statestream")


def test_verify_ok(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("OK") and str(ckpt) in out and "2 chunks" in out


def test_verify_damaged(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    damage(ckpt)
    assert main(["verify", str(ckpt)]) == 1
    err = capsys.readouterr().err
    assert "DAMAGED" in err and "1 problem" in err
    assert "key path 'params/w~1x'" in err
    assert "data/r0-0.bin" in err


def test_verify_truncated(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = data_file(ckpt)
    f.write_bytes(f.read_bytes()[:10])
    assert main(["verify", str(ckpt)]) == 1
    err = capsys.readouterr().err
    assert "truncated" in err and "data/r0-0.bin" in err


def test_verify_damaged_manifest(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    m = ckpt / "manifest.json"
    m.write_bytes(m.read_bytes().replace(b"float32", b"float33"))
    assert main(["verify", str(ckpt)]) == 1
    assert "manifest" in capsys.readouterr().err


@pytest.mark.parametrize("cmd", [["inspect"], ["inspect", "--json"], ["verify"]])
def test_missing_path_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                              cmd: list[str]) -> None:
    missing = tmp_path / "nope"
    assert main([*cmd, str(missing)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("error: no checkpoint at") and str(missing) in captured.err


def test_uncommitted_dir_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "half").mkdir()
    assert main(["verify", str(tmp_path / "half")]) == 2
    assert "COMMITTED" in capsys.readouterr().err


def test_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as ei:
        main([])
    assert ei.value.code == 2
    with pytest.raises(SystemExit) as ei:
        main(["--version"])
    assert ei.value.code == 0
    assert ss.__version__ in capsys.readouterr().out


def test_subprocess_inspect_and_verify(ckpt: Path) -> None:
    r = run_cli("inspect", str(ckpt))
    assert r.returncode == 0, r.stderr
    assert "params/w~1x" in r.stdout and "float32" in r.stdout and "(2, 3)" in r.stdout
    assert "statestream v1" in r.stdout
    r = run_cli("inspect", "--json", str(ckpt))
    assert r.returncode == 0 and json.loads(r.stdout)["num_arrays"] == 2
    r = run_cli("verify", str(ckpt))
    assert r.returncode == 0 and r.stdout.startswith("OK")


def test_subprocess_damage_and_missing(ckpt: Path, tmp_path: Path) -> None:
    damage(ckpt)
    r = run_cli("verify", str(ckpt))
    assert r.returncode == 1
    assert "params/w~1x" in r.stderr and "data/r0-0.bin" in r.stderr
    r = run_cli("verify", str(tmp_path / "missing"))
    assert r.returncode == 2 and "no checkpoint at" in r.stderr


def test_verify_refused_pickle_exits_2_and_allow_pickle_admits_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A refused pickle is an error (exit 2, as inspect and diff), not damage (exit 1);
    the advice names the command's --allow-pickle, which verify takes too."""
    import argparse
    import collections

    torch = pytest.importorskip("torch")
    ns, dd = tmp_path / "ns.pt", tmp_path / "dd.pt"
    torch.save({"w": torch.ones(2), "args": argparse.Namespace(lr=0.1)}, ns)
    torch.save({"w": torch.ones(2), "d": collections.defaultdict(list, a=[1])}, dd)
    for cmd in (["verify"], ["verify", "--json"]):
        assert main([*cmd, str(ns)]) == 2
        out, err = capsys.readouterr()
        assert out == "" and "argparse.Namespace" in err and "DAMAGED" not in err
        assert "pass --allow-pickle only if you trust this file" in err
        assert "allow_pickle=True" not in err
    assert main(["inspect", str(ns)]) == 2  # no such option: says so
    assert "statestream inspect has no option that admits it" in capsys.readouterr().err
    with pytest.raises(ss.PickleNotAllowedError):
        ss.verify(ns)
    assert main(["verify", str(dd)]) == 2
    assert "collections.defaultdict" in capsys.readouterr().err
    assert main(["verify", "--allow-pickle", str(dd)]) == 0
    assert capsys.readouterr().out.startswith("OK")
    assert ss.verify(dd, allow_pickle=True).ok
    # diff read both sides' metadata without it: --allow-pickle was refused all the same
    assert main(["diff", str(dd), str(dd)]) == 2
    assert "pass --allow-pickle" in capsys.readouterr().err
    assert main(["diff", "--allow-pickle", str(dd), str(dd)]) == 0
    assert ss.metadata(dd, allow_pickle=True).tree["w"].shape == (2,)
