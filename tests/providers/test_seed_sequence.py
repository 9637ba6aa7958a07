"""A NumPy generator's saved seed sequence is bounded before NumPy mixes it.

``np.random.SeedSequence`` costs ``pool_size`` x (``pool_size`` + entropy words), and
converting an entropy int costs the square of its size: a checkpoint naming a pool of
40,000 took 9 s to load, 10^6 half an hour; an int of 2^16 words 21 s.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import statestream as ss
from statestream.errors import CheckpointCorruptError
from statestream.format import encode_commit


def _saved(tmp_path: Path, **change: Any) -> Path:
    """A checkpoint of one generator whose saved seed sequence has ``change``."""
    c = tmp_path / "c"
    ss.save(c, {"rng": np.random.default_rng(0)})
    doc = json.loads((c / "manifest.json").read_bytes())
    state = doc["tree"]["c"][0]["c"][0]
    seq = state["c"][state["k"].index("seed_seq")]
    for key, value in change.items():
        seq["c"][seq["k"].index(key)] = value
    data = json.dumps(doc, separators=(",", ":")).encode()
    (c / "manifest.json").write_bytes(data)
    (c / "COMMITTED").write_bytes(encode_commit(data))
    return c


def _int(v: int) -> dict[str, Any]:
    return {"t": "int", "v": format(v, "x")}


def _ints(*vs: int) -> dict[str, Any]:
    return {"t": "list", "c": [_int(v) for v in vs]}


BIG = 1 << (32 * 1024)  # 1,025 words

REFUSED = {
    "pool-4097": ({"pool_size": _int(4097)}, "pool_size' is 4097, not an int in \\[4, 4096\\]"),
    "pool-2^70": ({"pool_size": _int(1 << 70)}, "pool_size' is 1180591620717411303424"),
    "pool-3": ({"pool_size": _int(3)}, "pool_size' is 3, not an int in \\[4, 4096\\]"),
    "pool-true": ({"pool_size": {"t": "bool", "v": True}}, "pool_size' is True"),
    "entropy-int": ({"entropy": _int(BIG)}, "entropy at key path 'rng/seed_seq/entropy' "
                    "holds more than 1024 32-bit words"),
    "entropy-list": ({"entropy": _ints(*[(1 << 64) - 1] * 513)}, "more than 1024 32-bit"),
    "entropy-str": ({"entropy": {"t": "str", "v": "1"}}, "entropy at key path "
                    "'rng/seed_seq/entropy' is not a non-negative int"),
    "spawn-key": ({"spawn_key": _ints(*range(1025))}, "spawn_key at key path "
                  "'rng/seed_seq/spawn_key' holds more than 1024"),
    "spawn-key-int": ({"spawn_key": _int(3)}, "spawn_key at key path 'rng/seed_seq/spawn_key' "
                      "is not a list of non-negative ints"),
    "children": ({"n_children_spawned": _int((1 << 32) - 1)}, "n_children_spawned' is "
                 "4294967295, not an int in \\[0, 4294967294\\]"),
    "children-2^70": ({"n_children_spawned": _int(1 << 70)}, "n_children_spawned' is 11805"),
}


@pytest.mark.parametrize(("change", "match"), list(REFUSED.values()), ids=list(REFUSED))
@pytest.mark.parametrize("target", ["none", "generator"])
def test_a_seed_sequence_outside_numpys_sizes_is_refused(
        tmp_path: Path, change: dict[str, Any], match: str, target: str) -> None:
    c = _saved(tmp_path, **change)
    like = None if target == "none" else np.random.default_rng(1)
    with pytest.raises(CheckpointCorruptError, match=match):
        ss.load(c, {"rng": like})


def test_the_largest_sizes_allowed_load(tmp_path: Path) -> None:
    entropy, key = [(1 << 64) - 1] * 512, list(range(1024))
    c = _saved(tmp_path, pool_size=_int(4096), entropy=_ints(*entropy), spawn_key=_ints(*key),
               n_children_spawned=_int((1 << 32) - 3))
    seq = ss.load(c, {"rng": None})["rng"].bit_generator.seed_seq
    want = np.random.SeedSequence(entropy, spawn_key=key, pool_size=4096,
                                  n_children_spawned=(1 << 32) - 3)
    assert seq.state == want.state
    assert seq.spawn(1)[0].generate_state(4).tolist() == want.spawn(1)[0].generate_state(4).tolist()


@pytest.mark.parametrize("seed", [np.int64(5), np.uint32(7), 2**70, [1, 2], np.array([3, 4]),
                                  None], ids=["int64", "uint32", "int", "list", "array", "none"])
def test_a_generator_seeded_with_numpy_ints_saves_and_spawns_alike(
        tmp_path: Path, seed: Any) -> None:
    """``default_rng(np.int64(5))`` (a seed drawn from a NumPy array) keeps a NumPy
    int as its entropy: saving it raised "'numpy.int64' object is not iterable"."""
    g = np.random.default_rng(seed)
    g.random()
    ss.save(tmp_path / "c", {"g": g})
    out = ss.load(tmp_path / "c", target={"g": np.random.default_rng()})["g"]
    assert out.random() == g.random()
    mine, theirs = g.spawn(1)[0], out.spawn(1)[0]
    assert mine.random() == theirs.random()


def _bit_state(tmp_path: Path, rng: Any, keys: tuple[str, ...], value: Any) -> Path:
    """A checkpoint of generator ``rng`` whose saved state has ``value`` at ``keys``."""
    c = tmp_path / "c"
    ss.save(c, {"rng": rng})
    doc = json.loads((c / "manifest.json").read_bytes())
    node = doc["tree"]["c"][0]["c"][0]
    for k in keys:
        node = node["c"][node["k"].index(k)]
    node.clear()
    node.update(value)
    data = json.dumps(doc, separators=(",", ":")).encode()
    (c / "manifest.json").write_bytes(data)
    (c / "COMMITTED").write_bytes(encode_commit(data))
    return c


POSITIONS = {  # NumPy takes these unchecked: a draw then read out of bounds, or crashed
    "mt-pos": (lambda: np.random.Generator(np.random.MT19937(1)), ("state", "pos"),
               _int(10**9), "state/pos at key path 'rng/state/pos' is 1000000000"),
    "mt-pos-625": (lambda: np.random.RandomState(1), ("state", "pos"), _int(625),
                   "is 625, not an int in \\[0, 624\\]"),
    "philox-pos": (lambda: np.random.Generator(np.random.Philox(1)), ("buffer_pos",),
                   {"t": "int", "v": "-5f5e100"}, "buffer_pos at key path "
                   "'rng/buffer_pos' is -100000000, not an int in \\[0, 4\\]"),
    "pcg-flag": (lambda: np.random.Generator(np.random.PCG64(1)), ("has_uint32",),
                 _int(7), "has_uint32 at key path 'rng/has_uint32' is 7"),
    "mt-key": (lambda: np.random.MT19937(1), ("state", "key"), _ints(1, 2),
               "state/key at key path 'rng/state/key' is not 624 words"),
}


@pytest.mark.parametrize("case", sorted(POSITIONS))
@pytest.mark.parametrize("into", ["none", "target"])
def test_a_bit_generator_position_out_of_range_is_refused(
        tmp_path: Path, case: str, into: str) -> None:
    make, keys, value, message = POSITIONS[case]
    c = _bit_state(tmp_path, make(), keys, value)
    with pytest.raises(CheckpointCorruptError, match=message):
        ss.load(c, target={"rng": None if into == "none" else make()})
    # within range it loads, and draws as NumPy does from that state
    for ok in ([_int(624)] if case.startswith("mt-pos") else
               [_int(4)] if case == "philox-pos" else [_int(1)] if case == "pcg-flag" else []):
        c = _bit_state(tmp_path / "ok", make(), keys, ok)
        ss.load(c, target={"rng": None})["rng"].random()
