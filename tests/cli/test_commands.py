"""Tests for ``statestream convert | ls | diff`` and the JSON of inspect / verify."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import statestream as ss
from statestream.cli import main
from statestream.cli._convert import parse_size
from statestream.format import COMMIT_NAME, MANIFEST_NAME, encode_commit
from statestream.tree import format_keypath

ENV = {**os.environ, "PYTHONPATH": str(Path(ss.__file__).parents[1])}


def state(scale: float = 1.0) -> dict[str, Any]:
    return {"model": {"w": np.arange(6, dtype=np.float32).reshape(2, 3) * scale,
                      "b": np.ones(4, np.float64)},
            "step": 7}


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "statestream", *args], capture_output=True,
                          text=True, timeout=120, check=False, env=ENV)


def out_json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, Any]:
    rc = main(argv)
    return rc, json.loads(capsys.readouterr().out)


# ----------------------------------------------------------------------- convert


def test_convert_to_safetensors_and_back(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    ss.save(tmp_path / "ck", state())
    assert main(["convert", str(tmp_path / "ck"), str(tmp_path / "m.safetensors"),
                 "--items", "model"]) == 0
    assert "m.safetensors" in capsys.readouterr().out
    got = ss.load(tmp_path / "m.safetensors")
    np.testing.assert_array_equal(got["w"], state()["model"]["w"])
    assert set(got) == {"w", "b"}
    assert main(["convert", str(tmp_path / "m.safetensors"), str(tmp_path / "back")]) == 0
    assert ss.metadata(tmp_path / "back").format == "statestream"


def test_convert_shards_with_max_shard_size(tmp_path: Path) -> None:
    ss.save(tmp_path / "ck", {"a": np.zeros(1000, np.float32), "b": np.zeros(1000, np.float32)})
    assert main(["convert", str(tmp_path / "ck"), str(tmp_path / "hf"), "--to", "safetensors",
                 "--max-shard-size", "5KB"]) == 0
    assert len(list((tmp_path / "hf").glob("*.safetensors"))) == 2
    assert list((tmp_path / "hf").glob("*.index.json"))


def test_convert_errors_are_one_line(tmp_path: Path) -> None:
    ss.save(tmp_path / "ck", state())
    (tmp_path / "exists.safetensors").write_bytes(b"x")
    r = run_cli("convert", str(tmp_path / "ck"), str(tmp_path / "exists.safetensors"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.startswith("error: ") and r.stderr.count("\n") == 1
    assert "pass --overwrite" in r.stderr and "overwrite=True" not in r.stderr
    ss.save(tmp_path / "ck2", state())  # a statestream destination says the same
    r = run_cli("convert", str(tmp_path / "ck"), str(tmp_path / "ck2"))
    assert r.returncode == 2 and "pass --overwrite" in r.stderr


def test_parse_size() -> None:
    assert parse_size("5GB") == 5 * 10**9 and parse_size("512MiB") == 512 << 20
    assert parse_size("100") == 100
    with pytest.raises(Exception, match="not a size"):
        parse_size("lots")
    assert parse_size("1.5KB") == 1500 and parse_size("0.5KiB") == 512


def test_a_size_too_large_for_a_float_is_a_usage_error(tmp_path: Path) -> None:
    """float("1" + "0" * 400) is infinity: --max-shard-size and --memory-budget ended in
    an OverflowError traceback; they are a usage error (exit 2) like any bad size."""
    ss.save(tmp_path / "ck", {"w": np.zeros(2)})
    for opt in ("--max-shard-size", "--memory-budget"):
        r = run_cli("convert", str(tmp_path / "ck"), str(tmp_path / "out"), opt, "1" + "0" * 400)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert f"argument {opt}: not a size" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------- ls


def test_ls_manager_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "run"
    mgr = ss.CheckpointManager(d)
    for s in (10, 20):
        mgr.save(s, {"w": np.full(3, s, np.float32)}, metrics={"loss": 1 / s})
    mgr.close()
    # a step that never committed, as a killed save leaves it
    (d / "step_0000000030").mkdir()
    (d / "step_0000000030" / "manifest.json").write_text("{")
    rc, out = out_json(capsys, ["ls", str(d), "--json"])
    assert rc == 0 and out["kind"] == "manager"
    by_step = {e["step"]: e for e in out["entries"]}
    assert by_step[10]["state"] == by_step[20]["state"] == "committed"
    assert by_step[20]["metrics"] == {"loss": 0.05} and by_step[20]["nbytes"] == 12
    assert isinstance(by_step[10]["time"], float)
    assert by_step[30]["state"] == "uncommitted"
    assert set(out["entries"][0]) == {"name", "path", "step", "state", "format", "time",
                                      "nbytes", "disk_bytes", "metrics", "error", "bases"}
    assert by_step[20]["disk_bytes"] >= 12 and by_step[30]["disk_bytes"] is None
    assert main(["ls", str(d)]) == 0
    text = capsys.readouterr().out
    assert "loss=0.05" in text and "uncommitted" in text and "2 committed" in text


def test_ls_is_read_only_beside_a_live_manager(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "run"
    mgr = ss.CheckpointManager(d)  # holds the lease
    mgr.save(1, {"w": np.zeros(2)})
    mgr.wait()  # the save is asynchronous: its staging directory must be gone first
    before = sorted(p.name for p in d.iterdir())
    assert main(["ls", str(d)]) == 0
    assert sorted(p.name for p in d.iterdir()) == before
    mgr.save(2, {"w": np.zeros(2)})  # the manager still owns the directory
    mgr.close()
    assert "step_0000000001" in capsys.readouterr().out


def test_ls_plain_directory_escapes_names(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    ss.save(tmp_path / "good", state())
    ss.save(tmp_path / "evil\x1b[2J", state())
    (tmp_path / "not-a-checkpoint").mkdir()
    assert main(["ls", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "\x1b" not in text and "evil\\x1b[2J" in text and "good" in text
    assert "not-a-checkpoint" not in text
    rc, out = out_json(capsys, ["ls", str(tmp_path), "--json"])
    assert out["kind"] == "directory" and len(out["entries"]) == 2


# -------------------------------------------------------------------------- diff


def test_diff_equal_and_changed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ss.save(tmp_path / "a", state())
    ss.save(tmp_path / "a2", state())
    ss.save(tmp_path / "b", state(scale=1.5))
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "a2")]) == 0
    assert "equal" in capsys.readouterr().out
    rc, out = out_json(capsys, ["diff", str(tmp_path / "a"), str(tmp_path / "b"), "--json"])
    assert rc == 1 and not out["equal"]
    (c,) = out["changed"]
    assert c["key"] == "model/w" and c["max_abs_diff"] == pytest.approx(2.5)
    assert c["a"] == {"dtype": "float32", "shape": [2, 3]}
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b"), "--atol", "3"]) == 0
    capsys.readouterr()
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b"), "--rtol", "0.5"]) == 0
    capsys.readouterr()
    for bad in (["--atol", "-1"], ["--rtol", "nan"], ["--atol", "inf"]):
        with pytest.raises(SystemExit) as ei:  # argparse refuses it: usage, exit 2
            main(["diff", str(tmp_path / "a"), str(tmp_path / "b"), *bad])
        assert ei.value.code == 2
        assert "a tolerance is a finite number >= 0" in capsys.readouterr().err


def test_diff_added_removed_dtype_shape(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    ss.save(tmp_path / "a", {"x": np.zeros(3, np.float32), "gone": 1, "s": np.zeros(2)})
    ss.save(tmp_path / "b", {"x": np.zeros(3, np.float64), "new": "hi", "s": np.zeros(3)})
    rc, out = out_json(capsys, ["diff", str(tmp_path / "a"), str(tmp_path / "b"), "--json"])
    assert rc == 1
    assert [e["key"] for e in out["added"]] == ["new"]
    assert [e["key"] for e in out["removed"]] == ["gone"]
    assert {c["key"] for c in out["changed"]} == {"x", "s"}
    assert set(out) == {"a", "b", "equal", "added", "removed", "changed"}


@pytest.mark.parametrize("keys", [("", "b"), ("<root>", "b"), ("/", "~1"), ("~1", "/"),
                                  ("a/b", "a~1b")])
def test_diff_top_level_keys_whose_key_path_reads_otherwise(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], keys: tuple[str, str]) -> None:
    """A top-level key "" or "<root>" has a key path that parse_keypath reads as the root,
    and of the top-level keys "/" and "~1" the key path of "/" ("~1") is spelled as the
    other key, which items= then picks: diff read the wrong value (a whole tree, a
    missing key) and crashed with a ValueError from NumPy or int() (found by
    tests/fuzz/test_randomized_roundtrip.py, seed 800024)."""
    k1, k2 = keys
    ss.save(tmp_path / "a", {k1: np.arange(3.0), k2: np.ones(2), "n": {k1: np.zeros(2)}})
    ss.save(tmp_path / "b", {k1: np.arange(3.0) + 1, k2: np.ones(2), "n": {k1: np.zeros(2)}})
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "a")]) == 0
    capsys.readouterr()
    rc, out = out_json(capsys, ["diff", str(tmp_path / "a"), str(tmp_path / "b"), "--json"])
    assert rc == 1 and [(c["key"], c["max_abs_diff"]) for c in out["changed"]] == [
        (format_keypath((k1,)), 1.0)]


def test_diff_of_lone_arrays(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A checkpoint whose root is one array (``ss.save(p, array)``): diff failed with
    "items= names an empty key path '<root>'" (exit 2); it compares the arrays, and a
    lone array against a tree is the root added and the tree's keys removed."""
    ss.save(tmp_path / "a", np.arange(3.0))
    ss.save(tmp_path / "b", np.arange(3.0) + 2)
    ss.save(tmp_path / "t", {"x": np.zeros(2)})
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "a")]) == 0
    assert "equal" in capsys.readouterr().out
    rc, out = out_json(capsys, ["diff", str(tmp_path / "a"), str(tmp_path / "b"), "--json"])
    assert rc == 1 and [(c["key"], c["max_abs_diff"]) for c in out["changed"]] == [
        ("<root>", 2.0)]
    rc, out = out_json(capsys, ["diff", str(tmp_path / "a"), str(tmp_path / "t"), "--json"])
    assert rc == 1 and [e["key"] for e in out["removed"]] == ["<root>"]
    assert [e["key"] for e in out["added"]] == ["x"]


def test_diff_across_formats(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ss.save(tmp_path / "ck", {"w": np.arange(5, dtype=np.float32), "v": np.ones(2)})
    ss.convert(tmp_path / "ck", tmp_path / "m.safetensors")
    assert main(["diff", str(tmp_path / "m.safetensors"), str(tmp_path / "ck")]) == 0
    assert capsys.readouterr().out == "equal\n"
    ss.save(tmp_path / "ck2", {"w": np.arange(5, dtype=np.float32) + 1, "v": np.ones(2)})
    rc, out = out_json(capsys, ["diff", str(tmp_path / "m.safetensors"),
                                str(tmp_path / "ck2"), "--json"])
    assert rc == 1 and out["a"]["format"] == "safetensors"
    assert out["changed"][0]["max_abs_diff"] == 1.0


def test_diff_large_integers_exactly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Integers above 2**53 differ by 1 (float64 would round both to one value), and
    the extremes of int64/uint64 (``a - b`` would overflow) give the exact distance."""
    i64 = np.iinfo(np.int64)
    ss.save(tmp_path / "a", {"ids": np.array([2**60, 5], np.int64),
                             "u": np.array([2**63 + 2], np.uint64),
                             "ext": np.array([i64.min], np.int64), "same": np.arange(3)})
    ss.save(tmp_path / "b", {"ids": np.array([2**60 + 1, 5], np.int64),
                             "u": np.array([2**63 + 1], np.uint64),
                             "ext": np.array([i64.max], np.int64), "same": np.arange(3)})
    rc, out = out_json(capsys, ["diff", str(tmp_path / "a"), str(tmp_path / "b"), "--json"])
    assert rc == 1
    got = {c["key"]: c["max_abs_diff"] for c in out["changed"]}
    assert got == {"ids": 1.0, "u": 1.0, "ext": float(2**64 - 1)}
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b"), "--atol", "1"]) == 1
    assert "~ ext" in capsys.readouterr().out
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "a")]) == 0


def test_diff_of_an_int_too_long_to_print(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """An int leaf past Python's 4,300-digit repr limit (which the format holds) is
    described by its size and hex ends, as ``inspect`` does; ``diff`` ended in a
    ValueError traceback with exit 1 (which also means "different")."""
    ss.save(tmp_path / "a", {"x": 10**5000, "w": np.arange(3.0)})
    ss.save(tmp_path / "b", {"x": 1, "w": np.arange(3.0)})
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    rc, out = out_json(capsys, ["diff", a, b, "--json"])
    assert rc == 1
    (change,) = out["changed"]
    assert change["key"] == "x" and "16610-bit int" in json.dumps(change)
    assert main(["diff", a, b]) == 1
    assert "16610-bit int" in capsys.readouterr().out
    assert main(["diff", a, a]) == 0


def test_json_output_of_deeply_nested_meta(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """A manifest's ``meta`` may nest hundreds of levels (JSON holds it; ``save`` no
    longer writes it): ``--json`` shows 64 and says what it left out; it died of a
    RecursionError."""
    ss.save(tmp_path / "a", {"w": np.zeros(2)})
    doc = json.loads((tmp_path / "a" / MANIFEST_NAME).read_bytes())
    deep: Any = 1
    for _ in range(600):
        deep = [deep]
    doc["meta"]["deep"] = deep
    raw = json.dumps(doc).encode()
    (tmp_path / "a" / MANIFEST_NAME).write_bytes(raw)
    (tmp_path / "a" / COMMIT_NAME).write_bytes(encode_commit(raw))
    rc, out = out_json(capsys, ["inspect", str(tmp_path / "a"), "--json"])
    assert rc == 0
    assert "nested deeper than 64 levels, not shown" in json.dumps(out)


def test_diff_escapes_hostile_keys(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ss.save(tmp_path / "a", {"k\x1b]0;pwn\x07": np.zeros(2), "v": "a\nb"})
    ss.save(tmp_path / "b", {"other": np.zeros(2), "v": "c\x1b[31m"})
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 1
    text = capsys.readouterr().out
    assert "\x1b" not in text and "\x07" not in text
    assert all(line.startswith(("+", "-", "~", "0", "1", "2")) for line in text.splitlines())


def test_diff_error_exit_2(tmp_path: Path) -> None:
    r = run_cli("diff", str(tmp_path / "missing"), str(tmp_path / "other"))
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "Traceback" not in r.stderr


def test_diff_refuses_two_leaves_at_one_key_path(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """The int key 5 and the str key "5" share the key path ``5``: diff kept one leaf per
    key path, so a[5] != b[5] went unseen and it said ``equal`` (exit 0). It names leaves
    by key path and cannot tell the two apart, so it is an error (exit 2) naming it."""
    ss.save(tmp_path / "a", {5: np.zeros(3), "5": np.ones(3), "x": 1})
    ss.save(tmp_path / "b", {5: np.ones(3), "5": np.ones(3), "x": 1})
    ss.save(tmp_path / "c", {"5": np.ones(3), "x": 1})
    for a, b in (("a", "b"), ("c", "b"), ("a", "a")):
        assert main(["diff", str(tmp_path / a), str(tmp_path / b)]) == 2
        cap = capsys.readouterr()
        assert cap.out == "" and cap.err.count("\n") == 1
        assert cap.err.startswith("error: ") and "at key path '5'" in cap.err


def test_diff_names_a_key_whose_type_changed(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """{5: x} against {"5": x}: the same key path, another key (a load gives back a dict
    keyed 5 in one, "5" in the other); diff said ``equal`` (exit 0)."""
    ss.save(tmp_path / "a", {"m": {5: np.ones(3)}, "x": 1})
    ss.save(tmp_path / "b", {"m": {"5": np.ones(3)}, "x": 1})
    ss.save(tmp_path / "c", {"m": {"5": np.zeros(3)}, "x": 1})
    rc, out = out_json(capsys, ["diff", str(tmp_path / "a"), str(tmp_path / "b"), "--json"])
    assert rc == 1 and not out["equal"]
    (c,) = out["changed"]
    assert c["key"] == "m/5" and c["key_types"] == {"a": ["str", "int"], "b": ["str", "str"]}
    rc, out = out_json(capsys, ["diff", str(tmp_path / "a"), str(tmp_path / "c"), "--json"])
    (c,) = out["changed"]
    assert c["max_abs_diff"] == 1.0 and c["key_types"]["b"] == ["str", "str"]
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 1
    assert "key types str/int -> str/str" in capsys.readouterr().out
    rc, out = out_json(capsys, ["diff", str(tmp_path / "b"), str(tmp_path / "b"), "--json"])
    assert rc == 0 and out["equal"] and out["changed"] == []


# ------------------------------------------------------------ inspect / verify JSON


def test_inspect_json_keys_are_stable(tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    ss.save(tmp_path / "ck", state())
    rc, out = out_json(capsys, ["inspect", str(tmp_path / "ck"), "--json"])
    assert rc == 0
    assert set(out) == {"path", "format", "format_version", "total_bytes", "num_arrays",
                        "files", "meta", "bases", "referenced_bytes", "leaves"}
    assert out["format"] == "statestream"
    assert set(out["leaves"][0]) == {"key", "kind", "dtype", "shape", "nbytes", "stored_bytes",
                                     "codec"}


def test_verify_json_keys_are_stable(tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    ss.save(tmp_path / "ck", state())
    rc, out = out_json(capsys, ["verify", str(tmp_path / "ck"), "--json"])
    assert rc == 0
    assert out == {"path": str(tmp_path / "ck"), "ok": True, "checked_chunks": 2,
                   "checked_bytes": 56, "problems": []}
    (f,) = sorted((tmp_path / "ck" / "data").iterdir())
    raw = bytearray(f.read_bytes())
    raw[1] ^= 0xFF
    f.write_bytes(bytes(raw))
    rc, out = out_json(capsys, ["verify", str(tmp_path / "ck"), "--json"])
    assert rc == 1 and not out["ok"] and len(out["problems"]) == 1


def test_inspect_foreign_file_prints_its_format(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    ss.save(tmp_path / "ck", state())
    ss.convert(tmp_path / "ck", tmp_path / "m.safetensors")
    assert main(["inspect", str(tmp_path / "m.safetensors")]) == 0
    text = capsys.readouterr().out
    assert "safetensors" in text.splitlines()[1] and "statestream v1" not in text


# ------------------------------------------------------------------ shell manners


@pytest.mark.parametrize("command", ["inspect", "verify", "gc", "convert", "ls", "diff"])
def test_help_shows_an_example(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert "example" in text and f"statestream {command} " in text


def test_closed_pipe_ends_quietly(tmp_path: Path) -> None:
    ss.save(tmp_path / "ck", {f"k{i}": np.zeros(1) for i in range(2000)})
    cmd = [sys.executable, "-m", "statestream", "inspect", "--json", str(tmp_path / "ck")]
    producer = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV)
    assert producer.stdout is not None and producer.stderr is not None
    head = subprocess.run(["head", "-c", "10"], stdin=producer.stdout, capture_output=True,
                          timeout=120, check=True)
    producer.stdout.close()
    err = producer.stderr.read().decode()
    producer.wait(timeout=120)
    assert head.stdout == b'{\n  "path"'
    assert err == "", err  # no traceback, no "error: [Errno 32] Broken pipe"
    assert producer.returncode == 141  # 128 + SIGPIPE, as a shell reports for cat


def test_no_progress_output_when_piped(tmp_path: Path) -> None:
    ss.save(tmp_path / "ck", {"w": np.zeros(20 << 20, np.uint8)})
    r = run_cli("verify", str(tmp_path / "ck"))
    assert r.returncode == 0 and r.stdout.count("\n") == 1 and r.stderr == ""
    assert "\x1b" not in r.stdout


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_on_a_terminal_for_large_work(monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Path) -> None:
    from statestream.cli import _progress

    ss.save(tmp_path / "ck", {"w": np.zeros(1 << 16, np.uint8)})
    term = _Terminal()
    monkeypatch.setattr(sys, "stdout", term)
    seen: list[tuple[int, int]] = []
    real = _progress.progress_bar

    @contextlib.contextmanager
    def spy(label: str, total: int | None = None) -> Iterator[Any]:
        with real(label, total) as cb:
            assert cb is not None  # a terminal and (with the threshold lowered) large work

            def both(done: int, tot: int) -> None:
                seen.append((done, tot))
                cb(done, tot)
            yield both

    monkeypatch.setattr(_progress, "LARGE_BYTES", 1)
    monkeypatch.setattr(_progress, "progress_bar", spy)
    assert main(["verify", str(tmp_path / "ck")]) == 0
    assert seen and seen[-1] == (1 << 16, 1 << 16)
    assert "OK" in term.getvalue()
    with real("x", total=10) as some:
        assert some is not None  # threshold lowered: even 10 bytes get a bar
    monkeypatch.setattr(_progress, "LARGE_BYTES", 64 << 20)
    with real("x", total=10) as small:
        assert small is None


def test_diff_torch_checkpoints_with_bfloat16(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    torch = pytest.importorskip("torch")
    torch.save({"w": torch.ones(4, dtype=torch.bfloat16), "n": torch.arange(3)},
               tmp_path / "a.pt")
    torch.save({"w": torch.full((4,), 3.0, dtype=torch.bfloat16), "n": torch.arange(3)},
               tmp_path / "b.pt")
    rc, out = out_json(capsys, ["diff", str(tmp_path / "a.pt"), str(tmp_path / "b.pt"),
                                "--json"])
    assert rc == 1 and [c["key"] for c in out["changed"]] == ["w"]
    assert out["changed"][0]["max_abs_diff"] == 2.0
    assert main(["diff", str(tmp_path / "a.pt"), str(tmp_path / "a.pt")]) == 0


def test_diff_reads_arrays_in_bounded_batches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    from statestream.cli import _diff

    arrays = {f"a{i}": np.full(1000, i, np.float32) for i in range(6)}  # 4000 B each
    ss.save(tmp_path / "a", {"xs": list(arrays.values()), "d": arrays})
    changed = dict(arrays, a3=np.full(1000, 99, np.float32))
    ss.save(tmp_path / "b", {"xs": list(changed.values()), "d": changed})
    calls: list[list[str]] = []
    real_load = ss.load

    def spy(path: Any, **kw: Any) -> Any:
        calls.append(list(kw["items"]))
        return real_load(path, **kw)

    monkeypatch.setattr(ss, "load", spy)
    monkeypatch.setattr(_diff, "BATCH_BYTES", 8000)
    rc, out = out_json(capsys, ["diff", str(tmp_path / "a"), str(tmp_path / "b"), "--json"])
    assert rc == 1 and {c["key"] for c in out["changed"]} == {"xs/3", "d/a3"}
    assert all(len(items) <= 2 for items in calls) and len(calls) == 12  # 6 batches a side
    assert out["changed"][0]["max_abs_diff"] == 96.0


def test_diff_nan_is_valid_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ss.save(tmp_path / "a", {"x": np.array([1.0, np.nan]), "y": np.array([np.nan])})
    ss.save(tmp_path / "b", {"x": np.array([1.0, 2.0]), "y": np.array([np.nan])})
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b"), "--json"]) == 1
    text = capsys.readouterr().out
    out = json.loads(text, parse_constant=lambda c: pytest.fail(f"bare {c} in JSON"))
    assert [c["key"] for c in out["changed"]] == ["x"]  # NaN == NaN in y
    assert out["changed"][0]["max_abs_diff"] == "nan"


def test_diff_equal_infinities_are_equal(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """An attention mask of -inf, or best_loss = inf, on both sides is no change (inf - inf
    is NaN); an infinity against a finite value is one, whatever the tolerance."""
    mask = np.array([[0.0, -np.inf], [0.0, 0.0]], np.float32)
    ss.save(tmp_path / "a", {"mask": mask, "best": np.array([np.inf]), "x": np.ones(2)})
    ss.save(tmp_path / "b", {"mask": mask.copy(), "best": np.array([np.inf]), "x": np.ones(2)})
    ss.save(tmp_path / "c", {"mask": mask.copy(), "best": np.array([1.0]), "x": np.ones(2)})
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    assert capsys.readouterr().out == "equal\n"
    assert main(["diff", str(tmp_path / "c"), str(tmp_path / "a"), "--rtol", "0.5"]) == 1
    capsys.readouterr()
    rc, out = out_json(capsys, ["diff", str(tmp_path / "a"), str(tmp_path / "c"), "--json"])
    assert rc == 1 and [(c["key"], c["max_abs_diff"]) for c in out["changed"]] == [
        ("best", "inf")]


def test_diff_equal_nan_plain_values_are_equal(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    ss.save(tmp_path / "a", {"best_loss": float("nan"), "lr": 0.1, "x": np.ones(2)})
    ss.save(tmp_path / "b", {"best_loss": float("nan"), "lr": 0.1, "x": np.ones(2)})
    ss.save(tmp_path / "c", {"best_loss": 1.0, "lr": 0.1, "x": np.ones(2)})
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    assert capsys.readouterr().out == "equal\n"
    rc, out = out_json(capsys, ["diff", str(tmp_path / "a"), str(tmp_path / "c"), "--json"])
    assert rc == 1 and [c["key"] for c in out["changed"]] == ["best_loss"]


def test_ls_shows_leftovers_of_killed_saves(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "run"
    mgr = ss.CheckpointManager(d)
    mgr.save(1, {"w": np.zeros(2)})
    mgr.close()
    # the staging area a killed save of step 2 leaves (local backend's naming)
    (d / ".step_0000000002.tmp-0123456789ab").mkdir()
    rc, out = out_json(capsys, ["ls", str(d), "--json"])
    states = [(e["step"], e["state"]) for e in out["entries"]]
    assert states == [(1, "committed"), (2, "leftover")]
    assert (d / ".step_0000000002.tmp-0123456789ab").is_dir()  # ls removes nothing


_KILLED_CONVERT = """
import os, signal, sys
import statestream as ss
def die(done, total):
    os.kill(os.getpid(), signal.SIGKILL)
ss.convert(sys.argv[1], sys.argv[2], to=sys.argv[3], progress=die)
"""


@pytest.mark.parametrize("to", ["safetensors", "dcp"])
def test_gc_removes_what_a_killed_convert_left(tmp_path: Path, to: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """A conversion killed mid-way leaves its staging area beside DST: ls shows it as a
    leftover and gc removes it (its writer is provably dead); a live one's is kept."""
    ss.save(tmp_path / "ck", {"w": np.arange(1000, dtype=np.float32)})
    out = tmp_path / "out"
    out.mkdir()
    r = subprocess.run([sys.executable, "-c", _KILLED_CONVERT, str(tmp_path / "ck"),
                        str(out / "export"), to], env=ENV, capture_output=True, timeout=120,
                       check=False)
    assert r.returncode == -9 and not (out / "export").exists()
    left = os.listdir(out)
    assert len(left) == 1  # the killed conversion's staging area
    rc, listed = out_json(capsys, ["ls", str(out), "--json"])
    assert [(e["name"], e["state"]) for e in listed["entries"]] == [("export", "leftover")]
    assert main(["gc", str(out)]) == 0
    assert "1 leftover staging directory removed" in capsys.readouterr().out
    assert os.listdir(out) == []

    def gc_now(done: int, total: int) -> None:  # this conversion is alive: gc keeps it
        from statestream.storage import LocalStorage, collect_garbage

        assert collect_garbage(LocalStorage(), str(out), max_age_s=0) == []

    ss.convert(tmp_path / "ck", out / "export", to=to, progress=gc_now)
    assert os.listdir(out) == ["export"]


def test_gc_of_a_missing_directory_is_an_error(tmp_path: Path) -> None:
    """A mistyped path is exit 2 with one line, not '0 leftover staging directories removed'."""
    for path in (tmp_path / "mising", tmp_path / "file"):
        if path.name == "file":
            path.write_bytes(b"x")
        r = run_cli("gc", str(path))
        assert r.returncode == 2 and r.stdout == ""
        assert r.stderr == f"error: no directory at {path}\n"
    assert run_cli("gc", str(tmp_path)).returncode == 0


@pytest.mark.parametrize("argv", [["ls", ""], ["gc", ""], ["inspect", ""], ["verify", ""],
                                  ["diff", "", "ck"], ["convert", "ck", ""]])
def test_an_empty_path_is_an_error(argv: list[str], tmp_path: Path,
                                   monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    """``""`` (an unset shell variable) resolved to the current directory: ``ls ""`` listed
    it and ``gc ""`` collected in it, exit 0. It is a usage error (exit 2)."""
    monkeypatch.chdir(tmp_path)
    ss.save("ck", state())
    with pytest.raises(SystemExit) as ei:
        main(argv)
    assert ei.value.code == 2
    cap = capsys.readouterr()
    assert cap.out == "" and "an empty path" in cap.err


def test_converted_directories_have_the_umask_mode(tmp_path: Path) -> None:
    """A DCP or sharded safetensors export is readable by the group and others, as any
    directory made under umask 022 is (it was 0700, from a temporary directory)."""
    ss.save(tmp_path / "ck", {"w": np.arange(10, dtype=np.float32)})
    old = os.umask(0o022)
    try:
        ss.convert(tmp_path / "ck", tmp_path / "hf", to="safetensors")
        ss.convert(tmp_path / "ck", tmp_path / "dcp", to="dcp")
    finally:
        os.umask(old)
    assert (tmp_path / "hf").stat().st_mode & 0o777 == 0o755
    assert (tmp_path / "dcp").stat().st_mode & 0o777 == 0o755


def test_ls_missing_directory_and_a_checkpoint(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    r = run_cli("ls", str(tmp_path / "missing"))
    assert r.returncode == 2 and r.stderr.startswith("error: no directory")
    ss.save(tmp_path / "ck", state())
    rc, out = out_json(capsys, ["ls", str(tmp_path / "ck"), "--json"])
    assert out["kind"] == "checkpoint" and out["entries"][0]["nbytes"] == 56


def test_ls_shows_what_each_checkpoint_keeps_on_disk(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """``disk_bytes``: a checkpoint's own data files. A compressed one takes less than its
    raw size; an incremental one only what changed (the rest stays in its base)."""
    d = tmp_path / "runs"
    d.mkdir()
    w = np.zeros((256, 1024), np.float32)  # 1 MiB of zeros: compresses to almost nothing
    noise = np.random.default_rng(0).standard_normal(64 << 10).astype(np.float32)
    ss.save(d / "plain", {"w": w, "noise": noise}, hashes=True)
    ss.save(d / "packed", {"w": w, "noise": noise}, compression="zstd")
    ss.save(d / "delta", {"w": w, "noise": noise + 1}, base=d / "plain")
    rc, out = out_json(capsys, ["ls", str(d), "--json"])
    assert rc == 0 and out["kind"] == "directory"
    by = {e["name"]: e for e in out["entries"]}
    raw = w.nbytes + noise.nbytes
    assert by["plain"]["nbytes"] == by["packed"]["nbytes"] == by["delta"]["nbytes"] == raw
    assert by["plain"]["disk_bytes"] >= raw
    assert by["packed"]["disk_bytes"] < noise.nbytes + (64 << 10)  # w nearly vanished
    assert noise.nbytes <= by["delta"]["disk_bytes"] < w.nbytes  # only the changed array
    assert by["delta"]["bases"] and not by["plain"]["bases"]
    assert main(["ls", str(d)]) == 0
    text = capsys.readouterr().out
    assert "on disk" in text


def test_ls_says_so_when_a_directory_holds_another_formats_checkpoints(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An Orbax CheckpointManager directory: ls lists no statestream steps, and says that
    the steps it holds are Orbax checkpoints that inspect reads by path."""
    ocp = pytest.importorskip("orbax.checkpoint")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with ocp.CheckpointManager(tmp_path / "orbax_run") as mgr:
            for s in (1, 2):
                mgr.save(s, args=ocp.args.StandardSave({"w": np.arange(4.0) + s}))
    assert main(["ls", str(tmp_path / "orbax_run")]) == 0
    out = capsys.readouterr().out
    assert "0 committed checkpoints" in out
    assert "2 orbax checkpoints here (1, 2): ls lists statestream's" in out
    assert main(["inspect", str(tmp_path / "orbax_run" / "2")]) == 0
    ss.save(tmp_path / "plain" / "ck", state())  # statestream's own: no hint
    assert main(["ls", str(tmp_path / "plain")]) == 0
    assert "here (" not in capsys.readouterr().out


# an overwrite on a file system without renameat2, SIGKILLed between moving the old
# checkpoint aside (<staging>.old) and renaming the new one in
_KILLED_OVERWRITE = """
import os, signal, sys
import numpy as np
import statestream as ss
import statestream.storage._local as local
local._renameat2 = None
real = os.rename
def rename(a, b):
    real(a, b)
    if b.endswith(".old"):
        os.kill(os.getpid(), signal.SIGKILL)
local.os.rename = rename
ss.save(sys.argv[1], {"w": np.ones(4)}, overwrite=True)
"""


def test_gc_says_it_restored_a_checkpoint_an_overwrite_moved_aside(tmp_path: Path) -> None:
    # gc printed "removed <staging>.old" for the checkpoint it had put back in place
    # (and Python's warning text with a source line on stderr)
    ck = tmp_path / "ck"
    ss.save(ck, {"w": np.zeros(4)})
    proc = subprocess.run([sys.executable, "-c", _KILLED_OVERWRITE, str(ck)])
    assert proc.returncode == -9, proc.stderr
    (old,) = [n for n in os.listdir(tmp_path) if n.endswith(".old")]
    r = run_cli("gc", str(tmp_path))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith(f"restored {ck} from {tmp_path / old}: an overwrite was killed")
    assert lines[1:] == [f"removed {tmp_path / old[:-4]}", "1 leftover staging directory removed"]
    assert r.stderr == ""
    assert ss.load(ck)["w"].tolist() == [0.0] * 4


@pytest.mark.parametrize("name, carried", [("o.safetensors", True), ("o", True),
                                           ("o.pt", False)])
def test_convert_of_a_source_whose_meta_holds_nan(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, carried: bool) -> None:
    """A manifest's meta may hold NaN (JSON readers take it; no save writes it): a
    conversion whose output keeps the metadata raised a bare ValueError (a traceback,
    exit 1) after writing all the data; now exit 2 naming the value, nothing written.
    An output without metadata (torch.save) converts as before."""
    ss.save(tmp_path / "a", {"w": np.zeros(2)}, meta={"lr": 0.5})
    raw = (tmp_path / "a" / MANIFEST_NAME).read_bytes().replace(b'"lr":0.5', b'"lr":NaN')
    (tmp_path / "a" / MANIFEST_NAME).write_bytes(raw)
    (tmp_path / "a" / COMMIT_NAME).write_bytes(encode_commit(raw))
    rc = main(["convert", str(tmp_path / "a"), str(tmp_path / name)])
    err = capsys.readouterr().err
    if carried:
        assert rc == 2 and "meta['user']['lr'] is nan" in err, err
        assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]
    else:
        assert rc == 0, err
        np.testing.assert_array_equal(ss.load(tmp_path / name)["w"], np.zeros(2))
