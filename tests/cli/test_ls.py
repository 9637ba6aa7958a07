"""Tests for ``statestream ls``: which entries it lists, in which state, and its output
on odd metadata (more in test_commands.py)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import statestream as ss
from statestream.cli import main


def out_json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, Any]:
    rc = main(argv)
    return rc, json.loads(capsys.readouterr().out)


def test_a_committed_staging_directory_is_a_leftover_only(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A save killed after writing its commit marker, before the rename, leaves a committed
    staging directory: ls listed it twice, as a leftover and as a committed checkpoint
    named ``.ck.tmp-...`` (which ``gc`` removes)."""
    ss.save(tmp_path / "ck", {"w": np.ones(4)})
    ss.save(tmp_path / "next", {"w": np.zeros(4)})
    (tmp_path / "next").rename(tmp_path / ".next.tmp-0123456789ab")  # as a kill leaves it
    rc, out = out_json(capsys, ["ls", str(tmp_path), "--json"])
    assert rc == 0 and out["kind"] == "directory"
    assert [(e["name"], e["state"]) for e in out["entries"]] == [
        ("ck", "committed"), ("next", "leftover")]
    assert main(["ls", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert ".tmp-" not in text and "1 committed checkpoint, 1 other" in text


def reseal(path: Path, edit: Callable[[str], str]) -> None:
    """Rewrite ``path``'s manifest text through ``edit`` and its commit marker to match,
    as a hostile writer would."""
    from statestream.format import encode_commit

    raw = edit((path / "manifest.json").read_text()).encode()
    (path / "manifest.json").write_bytes(raw)
    (path / "COMMITTED").write_bytes(encode_commit(raw))


def test_a_time_out_of_range_is_shown_as_a_dash(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """``meta={"time": 1e300}``, or a manifest whose created_unix is NaN, an infinity or
    a 400-digit int, ended ls in a traceback (OverflowError, ValueError; exit 1). Such a
    time shows as ``-`` (``null`` in JSON); a readable one still shows."""
    ss.save(tmp_path / "ok", {"w": np.ones(2)}, meta={"time": 1.5e9})
    ss.save(tmp_path / "far", {"w": np.ones(2)}, meta={"time": 1e300})
    for name, bad in (("nan", "NaN"), ("inf", "1e999"), ("huge", "1" + "0" * 400),
                      ("text", '"x"'), ("bool", "true")):
        ss.save(tmp_path / name, {"w": np.ones(2)})
        reseal(tmp_path / name,
               lambda raw, bad=bad: re.sub(r'"created_unix":[^,}]*', f'"created_unix":{bad}',
                                           raw))
    assert main(["ls", str(tmp_path)]) == 0
    lines = {ln.split()[0]: ln.split() for ln in capsys.readouterr().out.splitlines()[1:-1]}
    assert set(lines) == {"ok", "far", "nan", "inf", "huge", "text", "bool"}
    assert lines["ok"][1:3] == ["committed", "2017-07-14"]
    assert all(ln[1:3] == ["committed", "-"] for n, ln in lines.items() if n != "ok")
    rc, out = out_json(capsys, ["ls", str(tmp_path), "--json"])
    times = {e["name"]: e["time"] for e in out["entries"]}
    assert times == {"ok": 1.5e9, "far": 1e300, "nan": None, "inf": None, "huge": None,
                     "text": None, "bool": None}


def _strict(text: str) -> Any:
    return json.loads(text, parse_constant=lambda c: pytest.fail(f"bare {c} in JSON"))


def test_json_is_strict_with_nan_and_infinite_numbers(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A step's NaN or infinite metric (ls) and a hostile manifest's NaN created_unix
    (inspect) came out as bare NaN / Infinity, which strict parsers refuse; they are the
    strings "nan" / "inf" / "-inf", as in ``diff --json``."""
    d = tmp_path / "run"
    with ss.CheckpointManager(d, async_save=False) as m:
        m.save(1, {"w": np.ones(2)},
               metrics={"loss": float("nan"), "gnorm": float("inf"), "m": -float("inf")})
    assert main(["ls", str(d), "--json"]) == 0
    (e,) = _strict(capsys.readouterr().out)["entries"]
    assert e["metrics"] == {"loss": "nan", "gnorm": "inf", "m": "-inf"}
    assert main(["ls", str(d)]) == 0
    assert "loss=nan gnorm=inf m=-inf" in capsys.readouterr().out
    ck = d / "step_0000000001"
    reseal(ck, lambda raw: re.sub(r'"created_unix":[^,}]*', '"created_unix":NaN', raw))
    assert main(["inspect", str(ck), "--json"]) == 0
    assert _strict(capsys.readouterr().out)["meta"]["created_unix"] == "nan"


def test_a_step_whose_base_is_gone_is_damaged(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """An incremental step whose base was removed (by hand, a partial sync) was listed as
    ``committed``, though loading it fails; it is ``damaged``, its error naming the base.
    A base left without its commit marker counts as gone too."""
    d = tmp_path / "run"
    with ss.CheckpointManager(d, async_save=False, incremental=True) as m:
        for s in (1, 2, 3):
            m.save(s, {"w": np.arange(100_000), "b": np.full(2, s)})
    rc, out = out_json(capsys, ["ls", str(d), "--json"])
    assert [(e["step"], e["state"]) for e in out["entries"]] == [
        (1, "committed"), (2, "committed"), (3, "committed")]
    assert out["entries"][2]["bases"] == ["step_0000000001"]  # references are flattened
    (d / "step_0000000001" / "COMMITTED").unlink()
    rc, out = out_json(capsys, ["ls", str(d), "--json"])
    by = {e["step"]: e for e in out["entries"]}
    assert [by[s]["state"] for s in (1, 2, 3)] == ["uncommitted", "damaged", "damaged"]
    assert "refers to step_0000000001, which is not a committed checkpoint" in by[3]["error"]
    with pytest.raises(ss.CheckpointError):
        ss.load(d / "step_0000000003")
    import shutil

    shutil.rmtree(d / "step_0000000001")
    assert main(["ls", str(d)]) == 0
    text = capsys.readouterr().out
    assert "damaged" in text and "0 committed checkpoints, 2 other" in text


def test_the_hint_for_other_formats_names_every_command_that_reads_them(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A directory of safetensors files: ls says what reads them by path. The hint named
    inspect, verify and convert, and left out diff."""
    ss.save(tmp_path / "ck", {"w": np.ones(2)})
    (tmp_path / "exports").mkdir()
    for name in ("a", "b"):
        ss.convert(tmp_path / "ck", tmp_path / "exports" / f"{name}.safetensors")
    assert main(["ls", str(tmp_path / "exports")]) == 0
    assert capsys.readouterr().out.splitlines()[2:] == [
        "2 safetensors checkpoints here (a.safetensors, b.safetensors): ls lists "
        "statestream's; inspect, verify, diff and convert read these by path"]


def test_a_trainer_output_directory_says_where_its_checkpoints_are(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """StatestreamTrainer writes ``out/checkpoint-<N>/statestream``: ``ls out`` printed
    an empty table ("0 committed checkpoints") where ``inspect out`` said where they
    are; it says so too now."""
    out = tmp_path / "out"
    for step in (3, 6):
        ss.save(out / f"checkpoint-{step}" / "statestream", {"w": np.ones(3) * step})
        (out / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
    assert main(["ls", str(out)]) == 0
    text = capsys.readouterr().out
    assert "0 committed checkpoints" in text
    assert "Trainer output directory (StatestreamTrainer)" in text
    assert "steps 3, 6" in text and "checkpoint-6/statestream" in text
