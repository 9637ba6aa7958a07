"""``verify`` tells damage (reported: ``ok`` False, ``statestream verify`` exits 1) from
what it cannot check as given (raised: the CLI exits 2 with ``error: ...``): a path that
names the wrong thing (an Orbax CheckpointManager step of several items, a data file),
a format it does not read (a legacy torch.save file, a newer format version)."""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import statestream as ss
from statestream.cli import main


def _ckpt(tmp: Path) -> Path:
    ss.save(tmp / "ck", {"w": np.arange(6.0), "b": np.ones(3, np.float32), "step": 2})
    return tmp / "ck"


def _data(ck: Path) -> Path:
    (f,) = sorted((ck / "data").iterdir())
    return f


def _orbax_step_of_two_items(tmp: Path) -> Path:
    ocp = pytest.importorskip("orbax.checkpoint")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with ocp.CheckpointManager(tmp / "run", item_names=("state", "extra")) as mgr:
            mgr.save(1, args=ocp.args.Composite(
                state=ocp.args.StandardSave({"w": np.arange(6.0)}),
                extra=ocp.args.JsonSave({"a": 1})))
    return tmp / "run" / "1"


def _future_version(tmp: Path) -> Path:
    ck = _ckpt(tmp)
    marker = json.loads((ck / "COMMITTED").read_text())
    marker["version"] = 99
    (ck / "COMMITTED").write_text(json.dumps(marker))
    return ck


def _legacy_torch(tmp: Path) -> Path:
    (tmp / "old.pt").write_bytes(b"\x80\x02\x8a\x0alegacy torch.save pickle stream")
    return tmp / "old.pt"


#: what verify cannot check as given -> (make it, the error, words its message holds)
_NOT_DAMAGE: dict[str, tuple[Callable[[Path], Path], type[Exception], str]] = {
    "orbax-step-of-two-items": (_orbax_step_of_two_items, ss.InvalidOptionError,
                                "pass one item's directory"),
    "a-data-file": (lambda tmp: _data(_ckpt(tmp)), ss.UnsupportedTypeError,
                    "statestream does not read it"),
    "legacy-torch-save": (_legacy_torch, ss.UnsupportedTypeError, "a legacy torch.save file"),
    "future-format-version": (_future_version, ss.FormatVersionError, "format version 99"),
}


def _truncate(ck: Path) -> str:
    f = _data(ck)
    f.write_bytes(f.read_bytes()[:10])
    return "truncated"


def _flip(ck: Path) -> str:
    f = _data(ck)
    raw = bytearray(f.read_bytes())
    raw[1] ^= 0xFF
    f.write_bytes(bytes(raw))
    return "checksum mismatch in array at key path 'w'"


def _remove(ck: Path) -> str:
    os.unlink(_data(ck))
    return "r0-0.bin"


def _malformed_manifest(ck: Path) -> str:
    m = ck / "manifest.json"
    m.write_bytes(m.read_bytes().replace(b"float32", b"float33"))
    return "manifest"


def _damaged_torch_zip(tmp: Path) -> str:
    torch = pytest.importorskip("torch")
    torch.save({"w": torch.arange(4.0)}, tmp / "m.pt")
    raw = (tmp / "m.pt").read_bytes()
    (tmp / "m.pt").write_bytes(raw[:len(raw) // 2])  # the zip's directory is gone
    return "not a readable torch.save file"


#: damage -> what does it (returns words of the problem)
_DAMAGE: dict[str, Callable[[Path], str]] = {
    "truncated": _truncate, "checksum": _flip, "missing-file": _remove,
    "malformed-manifest": _malformed_manifest,
}


@pytest.mark.parametrize("case", sorted(_NOT_DAMAGE))
def test_what_verify_cannot_check_as_given_is_raised(tmp_path: Path, case: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    make, err, words = _NOT_DAMAGE[case]
    path = make(tmp_path)
    with pytest.raises(err, match=words) as e:
        ss.verify(path)
    assert str(path) in str(e.value)
    assert main(["verify", str(path)]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.startswith("error: ") and words in out.err
    assert "DAMAGED" not in out.err


def test_an_orbax_steps_item_verifies(tmp_path: Path) -> None:
    """The refusal's suggestion is what verify then checks."""
    step = _orbax_step_of_two_items(tmp_path)
    assert ss.verify(step / "state").ok


@pytest.mark.parametrize("case", sorted(_DAMAGE))
def test_damage_stays_in_the_report(tmp_path: Path, case: str,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    ck = _ckpt(tmp_path)
    assert ss.verify(ck).ok
    words = _DAMAGE[case](ck)
    report = ss.verify(ck)
    assert not report.ok and any(words in p for p in report.problems), report.problems
    assert main(["verify", str(ck)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("DAMAGED") and words in err


def test_a_damaged_torch_zip_is_damage(tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    """A zip archive cut short is damage; a file that is no zip at all is a format
    statestream does not read (above)."""
    words = _damaged_torch_zip(tmp_path)
    report = ss.verify(tmp_path / "m.pt")
    assert not report.ok and words in report.problems[0], report.problems
    assert main(["verify", str(tmp_path / "m.pt")]) == 1
    assert words in capsys.readouterr().err


def test_a_missing_optional_library_is_raised(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """An Orbax checkpoint where orbax-checkpoint is not installed: nothing was checked,
    nothing is damaged."""
    pytest.importorskip("orbax.checkpoint")
    import statestream.interop._orbax as orbax_reader
    from statestream.interop import MissingDependencyError

    ss.save(tmp_path / "ck", {"w": np.arange(6.0)})
    ss.convert(tmp_path / "ck", tmp_path / "o", to="orbax")

    def missing(module: str, extra: str, what: str) -> None:
        raise MissingDependencyError(f"{what} needs orbax, which is not installed")

    monkeypatch.setattr(orbax_reader, "require", missing)
    with pytest.raises(MissingDependencyError, match="not installed"):
        ss.verify(tmp_path / "o")
