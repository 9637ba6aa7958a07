"""Hostile foreign checkpoints (torch.save files, DCP): no allocation or state from a pickle's word."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

import statestream as ss
from statestream.interop._torchfile import RestrictedUnpickler, StorageType

_CHILD = textwrap.dedent("""
    import json, resource, sys
    limit = 2 << 30  # the bombs below ask for far more: they fail here rather than swap
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    import statestream as ss
    try:
        out = ["ok", repr(ss.load(sys.argv[1]))[:200]]
    except BaseException as exc:
        out = [type(exc).__name__, str(exc)]
    print(json.dumps(out))
""")


def _load_capped(path: Path) -> list[str]:
    r = subprocess.run([sys.executable, "-c", _CHILD, str(path)], capture_output=True,
                       text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    out: list[str] = json.loads(r.stdout.splitlines()[-1])
    return out


def _torch_file(path: Path, data_pkl: bytes) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", data_pkl)
        z.writestr("archive/version", "3\n")
    return path


def test_a_memo_index_far_past_the_pickle_is_refused(tmp_path: Path) -> None:
    """LONG_BINPUT 2**31 in a 15-byte pickle: Python's unpickler would first grow its
    memo table to 2**32 entries (32 GiB)."""
    bomb = b"\x80\x02}r" + (1 << 31).to_bytes(4, "little") + b"."
    p = _torch_file(tmp_path / "memo.pt", bomb)
    kind, msg = _load_capped(p)
    assert kind == "CheckpointCorruptError" and "memo entry 2147483648" in msg, msg
    assert "memo.pt" in msg


def test_a_bytearray_of_a_count_is_refused(tmp_path: Path) -> None:
    """builtins.bytearray is admitted (pickles rebuild bytearrays with it), but called
    with an int it would allocate that many zeroed bytes: 8 GiB from a 60-byte file."""
    bomb = (b"\x80\x02}X\x01\x00\x00\x00xcbuiltins\nbytearray\n\x8a\x05"
            + (8 << 30).to_bytes(5, "little") + b"\x85Rs.")
    p = _torch_file(tmp_path / "bytearray.pt", bomb)
    kind, msg = _load_capped(p)
    assert kind == "CheckpointCorruptError" and "bytearray(8589934592,)" in msg, msg


@pytest.mark.parametrize("proto", [2, 3, 4, 5])
def test_bytearrays_pickles_write_still_unpickle(proto: int) -> None:
    value = [bytearray(b"ab\xff\x00"), bytearray(), {1, 2}, complex(1, 2)]
    data = pickle.dumps(value, proto).replace(b"__builtin__", b"builtins")
    assert RestrictedUnpickler(data, "x").load() == value


def test_a_pickle_cannot_change_the_stand_ins_of_later_loads() -> None:
    """BUILD on a global sets attributes on what find_class returned: a shared
    stand-in would carry a hostile file's dtype into every later file."""
    poison = (b"\x80\x02ctorch.storage\nUntypedStorage\n}X\x05\x00\x00\x00dtype"
              b"X\x07\x00\x00\x00float64sb.")
    assert RestrictedUnpickler(poison, "hostile").load() == StorageType("float64")
    clean = b"\x80\x02ctorch.storage\nUntypedStorage\n."
    assert RestrictedUnpickler(clean, "later").load() == StorageType("uint8")


def test_garbage_in_a_pickle_is_corrupt_naming_the_file() -> None:
    with pytest.raises(ss.CheckpointCorruptError, match="where.pkl"):
        RestrictedUnpickler(b"\x80\x02}q\x00(", "where.pkl").load()
