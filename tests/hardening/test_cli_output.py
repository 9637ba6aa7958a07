"""Item 5: ``statestream inspect`` shows whatever ss.save writes, and escapes it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import statestream as ss

from .conftest import run_cli

pytestmark = pytest.mark.timeout(300)

_EVIL_KEY = "evil\x1b[31mRED\x1b[0m\nchecksum OK  forged\r\u202eline\x07"


@pytest.fixture
def weird(tmp_path: Path) -> Path:
    c = tmp_path / "weird"
    ss.save(c, {
        "huge": 7 ** 6000,                    # about 5,000 decimal digits
        "neg": -(3 ** 9000),
        "lone\ud800surrogate": np.zeros(2, np.int8),
        _EVIL_KEY: {"s": "value\x1b]0;title\x07\nnext", "t": "\udcff", "a": np.ones(3)},
        "ok": 1,
    })
    return c


def _assert_clean(text: str) -> None:
    for ch in text:
        if ch in "\n":
            continue
        assert ch.isprintable(), (repr(ch), text)


def test_inspect_table_escapes_everything(weird: Path) -> None:
    r = run_cli("inspect", "--all", str(weird))
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    _assert_clean(r.stdout)
    lines = r.stdout.splitlines()
    # header (3 lines) + 7 leaves + total: a key's newline forged no extra line
    assert len(lines) == 11, r.stdout
    assert not any(ln.startswith("checksum OK") for ln in lines)
    assert "evil\\x1b[31mRED\\x1b[0m\\nchecksum OK  forged\\r\\u202eline\\x07/s" in r.stdout
    assert "lone\\ud800surrogate" in r.stdout
    huge = next(ln for ln in lines if ln.startswith("huge "))
    assert "-bit int" in huge and "0x" in huge
    neg = next(ln for ln in lines if ln.startswith("neg "))
    assert "-0x" in neg


def test_inspect_json_round_trips_keys(weird: Path) -> None:
    r = run_cli("inspect", "--json", str(weird))
    assert r.returncode == 0, r.stderr
    _assert_clean(r.stdout)
    assert r.stdout.isascii()
    doc = json.loads(r.stdout)
    keys = {leaf["key"] for leaf in doc["leaves"]}
    assert f"{_EVIL_KEY}/s" in keys and "lone\ud800surrogate" in keys


def test_verify_and_errors_escape(weird: Path) -> None:
    r = run_cli("verify", str(weird))
    assert r.returncode == 0, r.stderr
    _assert_clean(r.stdout)
    # damage every array: the problems name their key paths, escaped
    (f,) = sorted((weird / "data").iterdir())
    f.write_bytes(bytes(b ^ 1 for b in f.read_bytes()))
    r = run_cli("verify", str(weird))
    assert r.returncode == 1
    _assert_clean(r.stderr)
    assert "lone\\ud800surrogate" in r.stderr
    assert "evil\\x1b[31mRED\\x1b[0m\\nchecksum OK" in r.stderr
    assert len(r.stderr.splitlines()) == 3, r.stderr
