"""``items=`` through a stateful target: a module's selected entries are loaded into the
module (the rest untouched) and the module is returned, as for the whole module; an
optimizer (or another object whose load_state_dict takes its whole state) is refused.

Before, ``ss.load(path, {"model": module}, items=["model/weight"])`` returned a dict of
new tensors and left the module as it was, while with ``in_place=True`` it wrote the
module's tensor.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import statestream as ss
from statestream.errors import MissingKeyError, TargetMismatchError

torch = pytest.importorskip("torch")


def _saved(tmp_path: Path) -> tuple[Path, Any, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 3)).sum().backward()
    opt.step()
    ss.save(tmp_path / "c", {"model": model, "opt": opt, "step": 7})
    return tmp_path / "c", model, opt


def _fresh() -> Any:
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))


@pytest.mark.parametrize("in_place", [False, True])
def test_selected_entries_load_into_the_module_and_the_rest_stay(
        tmp_path: Path, in_place: bool) -> None:
    path, model, _ = _saved(tmp_path)
    target = _fresh()
    before = {k: v.clone() for k, v in target.state_dict().items()}
    weight = target[0].weight
    out = ss.load(path, {"model": target}, items=["model/0.weight", "model/1.running_mean"],
                  in_place=in_place)
    assert set(out) == {"model"} and out["model"] is target  # as for the whole module
    assert target[0].weight is weight  # loaded into its own parameter
    after = target.state_dict()
    for k, v in model.state_dict().items():
        want = v if k in ("0.weight", "1.running_mean") else before[k]
        assert torch.equal(after[k], want), k


def test_a_selected_entry_and_a_whole_checkpointable_beside_it(tmp_path: Path) -> None:
    path, model, _ = _saved(tmp_path)
    target = _fresh()
    out = ss.load(path, {"model": target, "step": 0}, items=["model/0.bias", "step"])
    assert out["model"] is target and out["step"] == 7
    assert torch.equal(target[0].bias, model[0].bias)


def test_a_meta_module_takes_the_selected_entries(tmp_path: Path) -> None:
    path, model, _ = _saved(tmp_path)
    with torch.device("meta"):
        target = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    ss.load(path, {"model": target}, items=["model/0.weight"])
    assert target[0].weight.device.type == "cpu"
    assert torch.equal(target[0].weight, model[0].weight)
    assert target[0].bias.device.type == "meta"  # not selected: as it was


def test_a_compiled_module_returns_itself_with_the_entries_loaded(tmp_path: Path) -> None:
    path, model, _ = _saved(tmp_path)
    inner = _fresh()
    compiled = torch.compile(inner)
    out = ss.load(path, {"model": compiled}, items=["model/0.bias"])
    assert out["model"] is compiled
    assert torch.equal(inner[0].bias, model[0].bias)


def test_an_optimizer_refuses_a_part_of_its_state_naming_it(tmp_path: Path) -> None:
    path, model, saved_opt = _saved(tmp_path)
    target = _fresh()
    opt = torch.optim.AdamW(target.parameters())
    with pytest.raises(TargetMismatchError, match=r"AdamW at key path 'opt'.*an optimizer"
                       r".*nothing was loaded.*Select 'opt' whole, or pass None"):
        ss.load(path, {"opt": opt, "model": target}, items=["opt/state", "model/0.bias"])
    assert opt.state_dict()["state"] == {}
    assert not torch.equal(target[0].bias, model[0].bias)  # nothing was loaded
    got = ss.load(path, {"opt": None}, items=["opt/state/0/exp_avg"])  # as saved
    assert torch.equal(torch.as_tensor(got["opt"]["state"][0]["exp_avg"]),
                       saved_opt.state_dict()["state"][0]["exp_avg"])


class _Counter:
    def __init__(self) -> None:
        self.n, self.loaded = 0, False

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n, "history": np.zeros(2)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.loaded = True


def test_another_stateful_object_refuses_a_part_of_its_state(tmp_path: Path) -> None:
    c = _Counter()
    ss.save(tmp_path / "c", {"c": c})
    with pytest.raises(TargetMismatchError, match="_Counter at key path 'c'.*whole state"):
        ss.load(tmp_path / "c", {"c": _Counter()}, items=["c/n"])
    assert ss.load(tmp_path / "c", {"c": _Counter()}, items=["c"])["c"].loaded


def test_an_entry_the_module_has_no_place_for_is_refused_before_reading(
        tmp_path: Path) -> None:
    path, model, _ = _saved(tmp_path)
    small = torch.nn.Sequential(torch.nn.Linear(3, 4))  # no BatchNorm at '1'
    bias = small[0].bias.detach().clone()
    with pytest.raises(TargetMismatchError,
                       match=r"'model/1.running_mean', which the target's .*Sequential.*"
                             r"no place for.*nothing was loaded"):
        ss.load(path, {"model": small}, items=["model/0.bias", "model/1.running_mean"])
    assert torch.equal(small[0].bias, bias)
    with pytest.raises(MissingKeyError, match="no item 'model/9.weight'"):
        ss.load(path, {"model": small}, items=["model/9.weight"])
    with pytest.raises(TargetMismatchError, match="shape mismatch at key path 'model/0.bias'"):
        ss.load(path, {"model": torch.nn.Sequential(torch.nn.Linear(3, 5))},
                items=["model/0.bias"])
