"""Tied weights are stored once and stay tied; items= selects nested key paths
(issue 12, items 7 and 8)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import statestream as ss
from statestream.errors import CheckpointCorruptError, MissingKeyError, TargetMismatchError
from statestream.format import COMMIT_NAME, MANIFEST_NAME, encode_commit

torch = pytest.importorskip("torch")


class TinyLM(torch.nn.Module):
    """GPT-2's tie: the output projection is the token embedding."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.wte = torch.nn.Embedding(64, 16)
        self.mid = torch.nn.Linear(16, 16)
        self.lm_head = torch.nn.Linear(16, 64, bias=False)
        self.lm_head.weight = self.wte.weight


def _tree(path: Path) -> dict[str, object]:
    doc = json.loads((path / MANIFEST_NAME).read_text())
    assert isinstance(doc, dict)
    return doc


def _data_bytes(path: Path) -> int:
    doc = _tree(path)
    return sum(c[2] for a in doc["arrays"] for c in a["chunks"])  # type: ignore[union-attr]


# ----------------------------------------------------------------------------- item 7


@pytest.mark.parametrize("save", ["sync", "async"])
def test_tied_weights_are_written_once(tmp_path: Path, save: str) -> None:
    model = TinyLM(0)
    if save == "sync":
        ss.save(tmp_path / "c", {"model": model})
    else:
        ss.save_async(tmp_path / "c", {"model": model}).result()
    one_copy = sum(t.numel() * t.element_size() for t in
                   (model.wte.weight, model.mid.weight, model.mid.bias))
    assert _data_bytes(tmp_path / "c") == one_copy
    assert len(_tree(tmp_path / "c")["arrays"]) == 3  # type: ignore[arg-type]
    plain = ss.load(tmp_path / "c")["model"]
    assert list(plain) == ["wte.weight", "mid.weight", "mid.bias", "lm_head.weight"]
    np.testing.assert_array_equal(plain["lm_head.weight"], model.wte.weight.detach().numpy())
    np.testing.assert_array_equal(plain["lm_head.weight"], plain["wte.weight"])
    meta = ss.metadata(tmp_path / "c").tree["model"]
    assert meta["lm_head.weight"] == meta["wte.weight"]
    assert ss.verify(tmp_path / "c").ok


@pytest.mark.parametrize("in_place", [False, True])
def test_loading_into_a_tied_model_keeps_the_tie(tmp_path: Path, in_place: bool) -> None:
    src = TinyLM(0)
    ss.save(tmp_path / "c", {"model": src})
    dst = TinyLM(1)
    ss.load(tmp_path / "c", {"model": dst}, in_place=in_place)
    assert dst.lm_head.weight is dst.wte.weight
    assert torch.equal(dst.wte.weight, src.wte.weight)
    with torch.no_grad():  # still tied: a change to one is a change to the other
        dst.wte.weight[0, 0] = 42.0
    assert dst.lm_head.weight[0, 0].item() == 42.0


def test_tied_tensors_in_plain_containers(tmp_path: Path) -> None:
    t = torch.arange(12.0).reshape(3, 4)
    state = {"a": t, "b": t, "view": t.view(12), "rows": t[1:], "same": t[:]}
    ss.save(tmp_path / "c", state)
    kinds = [c["t"] for c in _tree(tmp_path / "c")["tree"]["c"]]  # type: ignore[index]
    # other shapes / offsets are separate arrays; a full slice is the same tensor
    assert kinds == ["array", "alias", "array", "array", "alias"]
    out = ss.load(tmp_path / "c", {"a": None, "b": None, "view": None, "rows": None,
                                   "same": None})
    assert out["b"] is out["a"] and out["same"] is out["a"]
    assert torch.equal(out["a"], t) and torch.equal(out["rows"], t[1:])
    # one target tensor under both keys: filled in place, returned for both
    like = torch.zeros(3, 4)
    got = ss.load(tmp_path / "c", {"a": like, "b": like}, in_place=True)
    assert got["a"] is like and got["b"] is like and torch.equal(like, t)
    # separate targets: each gets the data
    x, y = torch.zeros(3, 4), torch.zeros(3, 4, dtype=torch.float64)
    got = ss.load(tmp_path / "c", {"a": x, "b": y})
    assert torch.equal(got["a"], t) and torch.equal(got["b"], t.double())
    # an alias alone (its array's own leaf not loaded)
    assert torch.equal(ss.load(tmp_path / "c", {"b": torch.zeros(3, 4)})["b"], t)


def test_alias_to_a_missing_array_is_corrupt(tmp_path: Path) -> None:
    t = torch.arange(4.0)
    ss.save(tmp_path / "c", {"a": t, "b": t, "x": b"blob"})
    mpath = tmp_path / "c" / MANIFEST_NAME
    data = mpath.read_bytes()
    doc = json.loads(data)
    assert doc["tree"]["c"][1] == {"t": "alias", "a": 0, "x": {"kind": "torch"}}
    doc["tree"]["c"][1]["a"] = 1  # the bytes blob, not an array leaf
    bad = json.dumps(doc, separators=(",", ":")).encode()
    mpath.write_bytes(bad)
    (tmp_path / "c" / COMMIT_NAME).write_bytes(encode_commit(bad))
    with pytest.raises(CheckpointCorruptError, match="alias refers to array 1"):
        ss.load(tmp_path / "c")


# ----------------------------------------------------------------------------- item 8


def _nested(tmp_path: Path) -> Path:
    state = {
        "model": {"layers.0.weight": np.arange(4.0), "layers.0.bias": np.zeros(2),
                  "a/b": {"c": np.ones(3)}},
        "opt": {"state": {0: {"m": np.full(2, 7.0)}}, "groups": [{"lr": 0.1}, {"lr": 0.2}]},
        "step": 5,
    }
    ss.save(tmp_path / "c", state)
    return tmp_path / "c"


def test_items_select_a_leaf(tmp_path: Path) -> None:
    path = _nested(tmp_path)
    out = ss.load(path, items=["model/layers.0.weight"])
    assert list(out) == ["model"] and list(out["model"]) == ["layers.0.weight"]
    np.testing.assert_array_equal(out["model"]["layers.0.weight"], np.arange(4.0))


def test_items_select_subtrees_escapes_and_int_keys(tmp_path: Path) -> None:
    path = _nested(tmp_path)
    out = ss.load(path, items=["model/a~1b", "opt/state/0/m", "opt/groups/1", "step"])
    np.testing.assert_array_equal(out["model"]["a/b"]["c"], np.ones(3))
    np.testing.assert_array_equal(out["opt"]["state"][0]["m"], np.full(2, 7.0))
    assert out["opt"]["groups"] == {1: {"lr": 0.2}}
    assert out["step"] == 5
    # an enclosing item wins over a nested one, in either order
    for items in (["model", "model/layers.0.bias"], ["model/layers.0.bias", "model"]):
        assert len(ss.load(path, items=items)["model"]) == 3


def test_items_top_level_key_with_a_slash_stays_literal(tmp_path: Path) -> None:
    ss.save(tmp_path / "c", {"a/b": {"x": 1}, "a": {"b": {"y": 2}}})
    assert ss.load(tmp_path / "c", items=["a/b"]) == {"a/b": {"x": 1}}
    assert ss.load(tmp_path / "c", items=["a~1b"]) == {"a/b": {"x": 1}}
    assert ss.load(tmp_path / "c", items=["a/b/y"]) == {"a": {"b": {"y": 2}}}


def test_items_naming_an_int_key_and_a_str_key_alike_is_refused(tmp_path: Path) -> None:
    # items="ints/0" picked the str key "0" and nothing could select the int key 0; a
    # key path writes both as 0 (metadata().leaves() and diff show them alike)
    c = tmp_path / "c"
    ss.save(c, {"ints": {0: np.zeros(2), "0": np.ones(2)}, "only": {1: np.ones(1)},
                "l": [{5: np.full(1, 5.0), "5": np.full(1, -5.0)}]})
    for item in ("ints/0", "ints/0/x"):
        with pytest.raises(MissingKeyError) as ei:
            ss.load(c, items=[item])
        msg = str(ei.value)
        assert "key path 'ints/0'" in msg and "ambiguous" in msg and str(c) in msg
        assert "the str key '0' and the int key 0" in msg
        assert ("items=['ints'] with a target that holds its key with its type: "
                "target={'ints': {'0': None}} for the str key '0'; "
                "target={'ints': {0: None}} for the int key 0") in msg
    # the ways the message gives pick each one
    out = ss.load(c, {"ints": {0: None}}, items=["ints"])
    assert list(out["ints"]) == [0] and not out["ints"][0].any()
    out = ss.load(c, {"ints": {"0": None}}, items=["ints"])
    assert list(out["ints"]) == ["0"] and out["ints"]["0"].all()
    with pytest.raises(MissingKeyError, match=r"items=\['l/0'\] with .*"
                       r"target=\{'l': \{0: \{5: None\}\}\} for the int key 5"):
        ss.load(c, items=["l/0/5"])
    assert ss.load(c, {"l": {0: {5: None}}}, items=["l/0"])["l"][0][5][0] == 5.0
    # one key alone, of either type, is still selected by its digits
    assert list(ss.load(c, items=["only/1"])["only"]) == [1]
    assert list(ss.load(c, items=["ints"])["ints"]) == [0, "0"]


def test_convert_items_naming_two_keys_alike_says_what_convert_can_do(tmp_path: Path) -> None:
    # convert takes no target: the load's advice (a typed target) was no way out there
    c = tmp_path / "c"
    ss.save(c, {"ints": {0: np.zeros(2), "0": np.ones(2)}, 7: np.ones(1), "7": np.zeros(1)})
    with pytest.raises(MissingKeyError) as ei:
        ss.convert(c, tmp_path / "out", items=["ints/0"])
    msg = str(ei.value)
    assert "key path 'ints/0', which is ambiguous" in msg and str(c) in msg
    assert "name the key path that holds both (items=['ints'])" in msg and "target=" not in msg
    with pytest.raises(MissingKeyError, match=r"name no items= \(the whole checkpoint\)"):
        ss.convert(c, tmp_path / "out", items=["7"])
    assert not (tmp_path / "out").exists()
    ss.convert(c, tmp_path / "out", items=["ints"])  # what it says works
    assert list(ss.load(tmp_path / "out")) == [0, "0"]


def test_items_with_a_target(tmp_path: Path) -> None:
    path = _nested(tmp_path)
    like = {"model": {"layers.0.weight": torch.zeros(4)}}
    out = ss.load(path, like, items=["model/layers.0.weight", "model/layers.0.bias"])
    assert isinstance(out["model"]["layers.0.weight"], torch.Tensor)
    assert type(out["model"]["layers.0.bias"]) is np.ndarray  # no target entry: default
    got = ss.load(path, {"model": None}, items=["model/layers.0.bias"])
    assert type(got["model"]["layers.0.bias"]) is np.ndarray
    ss.save(tmp_path / "r", {"rng": {"rank0": torch.get_rng_state(), "rank1": torch.ones(2)}})
    rng = ss.load(tmp_path / "r", {"rng": None}, items=["rng/rank0"])["rng"]
    assert list(rng) == ["rank0"] and isinstance(rng["rank0"], torch.Tensor)
    mod = torch.nn.Linear(2, 4)
    ss.save(tmp_path / "m", {"model": mod})
    into = torch.nn.Linear(2, 4)
    got = ss.load(tmp_path / "m", {"model": into}, items=["model/bias"])
    assert got["model"] is into  # loaded into the module (tests/api/test_items_into_modules.py)
    assert torch.equal(into.bias, mod.bias)
    with pytest.raises(TargetMismatchError,
                       match="selected key paths; at 'model' it has a builtins.int"):
        ss.load(path, {"model": 3}, items=["model/layers.0.weight"])


def test_items_through_named_tuples_and_dataclasses_of_the_target(tmp_path: Path) -> None:
    # an optax state is a tuple of named tuples: items=["opt/0/mu"] with the optimizer
    # state as target was refused, naming 'mu' as the level that had a named tuple
    import collections
    import dataclasses

    Adam = collections.namedtuple("Adam", ["count", "mu"])

    @dataclasses.dataclass
    class Train:
        opt: tuple
        step: int

    state = Train((Adam(np.int32(3), {"w": np.ones(3, np.float32)}),), 7)
    ss.save(tmp_path / "c", {"train": state})
    like = {"train": Train((Adam(torch.zeros(()), {"w": torch.zeros(3)}),), 0)}
    got = ss.load(tmp_path / "c", like, items=["train/opt/0/mu"])
    assert isinstance(got["train"]["opt"][0]["mu"]["w"], torch.Tensor)  # typed by the target
    assert got["train"]["opt"][0]["mu"]["w"].tolist() == [1.0] * 3
    got = ss.load(tmp_path / "c", like, items=["train/opt/0/count", "train/step"])
    assert got["train"]["step"] == 7 and int(got["train"]["opt"][0]["count"]) == 3
    with pytest.raises(TargetMismatchError,
                       match="at 'train/opt' it has a builtins.int, which has no entry 0"):
        ss.load(tmp_path / "c", {"train": Train(3, 0)},  # type: ignore[arg-type]
                items=["train/opt/0/mu"])


def test_items_missing_key_names_the_path(tmp_path: Path) -> None:
    path = _nested(tmp_path)
    with pytest.raises(MissingKeyError, match="no item 'model/layers.9.weight'.*layers.0.bias"):
        ss.load(path, items=["model/layers.9.weight"])
    with pytest.raises(MissingKeyError, match="'step/x'.*without keys"):
        ss.load(path, items=["step/x"])
    with pytest.raises(MissingKeyError, match="no item 'nope'"):
        ss.load(path, items=["nope"])
    with pytest.raises(MissingKeyError, match="'model/layers.0.bias' holds an array without "
                       "keys"):  # ("a array" until 2026-12-07)
        ss.load(path, items=["model/layers.0.bias/x"])


@pytest.mark.parametrize("order", ["view_first", "tensor_first"])
@pytest.mark.parametrize("view", ["conj", "neg"])
def test_a_conjugate_or_negative_view_is_not_tied_to_its_tensor(
        tmp_path: Path, view: str, order: str) -> None:
    # x.conj() and x.conj().imag share x's memory, offset, shape and strides and read
    # it conjugated or negated: taken for ties, both names loaded the first one's values
    x = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    base = x if view == "conj" else x.imag
    v = x.conj() if view == "conj" else x.conj().imag
    assert v.is_conj() or v.is_neg()
    state = {"a": v, "b": base} if order == "view_first" else {"a": base, "b": v}
    ss.save(tmp_path / "ck", state)
    got = ss.load(tmp_path / "ck")
    for k in ("a", "b"):
        np.testing.assert_array_equal(got[k], state[k].resolve_conj().resolve_neg().numpy())
    also = {"a": v, "b": v}  # two names of one view stay one tie
    ss.save(tmp_path / "tie", also)
    np.testing.assert_array_equal(ss.load(tmp_path / "tie")["b"],
                                  v.resolve_conj().resolve_neg().numpy())
    assert len(_tree(tmp_path / "tie")["arrays"]) == 1  # type: ignore[arg-type]
