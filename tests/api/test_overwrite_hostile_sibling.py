"""An overwrite checks its committed siblings for references to the checkpoint it
replaces (``bases``): it decodes a sibling's manifest only up to ``bases``, never its
arrays, so a hostile sibling declaring many arrays (up to the format's 2^24: gigabytes
of Python objects to decode) costs an overwrite about twice its manifest's text."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import statestream as ss
from statestream.format import encode_commit

N = 100_000  # the hostile sibling's arrays


def _incremental_pair(tmp: Path) -> dict[str, Any]:
    """``a`` and ``b``, an incremental checkpoint referring to it; ``b``'s manifest."""
    frozen = np.arange(1 << 12, dtype=np.float32)
    ss.save(tmp / "a", {"frozen": frozen, "lora": np.zeros(8)}, hashes=True)
    ss.save(tmp / "b", {"frozen": frozen, "lora": np.ones(8)}, base=tmp / "a")
    doc: dict[str, Any] = json.loads((tmp / "b" / "manifest.json").read_bytes())
    assert doc["bases"] == ["a"] and isinstance(doc["arrays"], list)
    return doc


def _write(c: Path, text: str, version: int) -> int:
    data = text.encode()
    (c / "manifest.json").write_bytes(data)
    # re-sealed: the CRC matches
    (c / "COMMITTED").write_bytes(encode_commit(data, version=version))
    return len(data)


def _peak(fn: Any) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_sibling_of_many_arrays_is_not_decoded(tmp_path: Path) -> None:
    """``b`` names ``a`` as its base and declares N arrays: the overwrite of ``a`` is
    refused (b refers to it) at a peak of a few times b's manifest text, where decoding
    its arrays cost tens of times the text (hundreds of bytes per array)."""
    doc = _incremental_pair(tmp_path)
    empty = '{"dtype":"float32","shape":[0],"chunks":[]}'
    head = {k: v for k, v in doc.items() if k not in ("arrays", "tree")}
    text = (json.dumps(head)[:-1] + ',"arrays":[' + ",".join([empty] * N) + '],"tree":'
            + json.dumps(doc["tree"]) + "}")
    size = _write(tmp_path / "b", text, doc["version"])
    del text

    refused: list[ss.CheckpointError] = []

    def overwrite() -> None:
        try:
            ss.save(tmp_path / "a", {"x": np.ones(3)}, overwrite=True)
        except ss.CheckpointError as exc:
            refused.append(exc)

    # its bytes and text (2x); decoding its arrays too was 5x (~200 bytes an array:
    # gigabytes at 2^24, in a manifest under the format's 1 GiB)
    assert _peak(overwrite) < 3 * size
    (exc,) = refused
    assert "a is the base of the incremental checkpoint(s) b next to it" in str(exc)
    assert ss.load(tmp_path / "a")["lora"].tolist() == [0.0] * 8  # not replaced


def _order(doc: dict[str, Any], first: str) -> str:
    """``doc``'s text with ``first`` (``arrays`` or ``tree``) before ``bases``."""
    keys = [k for k in doc if k != first]
    keys.insert(keys.index("bases"), first)
    return "{" + ",".join(f"{json.dumps(k)}:{json.dumps(doc[k])}" for k in keys) + "}"


@pytest.mark.parametrize("first", ["arrays", "tree"])
def test_a_sibling_that_names_its_bases_late(tmp_path: Path, first: str) -> None:
    """A manifest (re-sorted by hand, or hostile) whose tree comes before its bases, as
    statestream never writes it, loads: it counts as a dependent when its text names the
    checkpoint, the overwrite refused rather than risk the chunks it keeps. One whose
    arrays come first cannot load (its references name no listed base): no dependent."""
    doc = _incremental_pair(tmp_path)
    _write(tmp_path / "b", _order(doc, first), doc["version"])
    if first == "arrays":  # a reference to a base not listed before the arrays
        with pytest.raises(ss.CheckpointCorruptError, match="listed before the arrays"):
            ss.load(tmp_path / "b")
        ss.save(tmp_path / "a", {"x": np.ones(3)}, overwrite=True)  # b refers to nothing
        return
    assert ss.load(tmp_path / "b")["lora"].tolist() == [1.0] * 8  # still a checkpoint
    with pytest.raises(ss.CheckpointError, match="a is the base of"):
        ss.save(tmp_path / "a", {"x": np.ones(3)}, overwrite=True)


def test_a_sibling_that_only_mentions_the_name_is_no_dependent(tmp_path: Path) -> None:
    """The name in a sibling's metadata (not in its bases) does not block an overwrite."""
    ss.save(tmp_path / "a", {"x": np.zeros(3)})
    ss.save(tmp_path / "b", {"y": np.ones(2)}, meta={"note": "a"}, hashes=True)
    assert b'"a"' in (tmp_path / "b" / "manifest.json").read_bytes()
    ss.save(tmp_path / "a", {"x": np.ones(3)}, overwrite=True)
    assert ss.load(tmp_path / "a")["x"].tolist() == [1.0] * 3
