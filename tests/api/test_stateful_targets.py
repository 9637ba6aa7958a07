"""Objects with ``load_state_dict`` as targets: what is refused before anything is
read, and when their state is loaded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import statestream as ss

torch = pytest.importorskip("torch")


class _Big(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)


class _Small(torch.nn.Module):  # _Big without 'b'
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 4)


def _weights(*modules: Any) -> list[Any]:
    return [t.detach().clone() for m in modules for t in m.state_dict().values()]


def _same(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_module_lacking_saved_keys_is_refused_before_anything_loads(tmp_path: Path) -> None:
    """The saved module has keys the target module lacks: its strict load_state_dict
    would refuse them, so the load raises first, naming the key path, and neither
    the other module nor the matching part of this one is touched."""
    torch.manual_seed(0)
    ss.save(tmp_path / "c", {"enc": torch.nn.Linear(4, 4), "dec": _Big()})
    enc, dec = torch.nn.Linear(4, 4), _Small()
    before = _weights(enc, dec)
    with pytest.raises(ss.TargetMismatchError,
                       match=r"key path 'dec/b.weight' \(and 1 more: 'b.bias'\).*_Small"
                             r".*load_state_dict\(\) would refuse.*nothing was loaded"):
        ss.load(tmp_path / "c", {"enc": enc, "dec": dec})
    assert _same(_weights(enc, dec), before)
    assert ss.load(tmp_path / "c", {"enc": enc, "dec": _Big()})["enc"] is enc  # it matches


def test_a_module_with_keys_the_checkpoint_lacks_is_refused_first(tmp_path: Path) -> None:
    torch.manual_seed(0)
    ss.save(tmp_path / "c", {"enc": torch.nn.Linear(4, 4), "dec": _Small()})
    enc, dec = torch.nn.Linear(4, 4), _Big()
    before = _weights(enc, dec)
    with pytest.raises(ss.MissingKeyError, match=r"key path 'dec/b.weight' is in the target "
                       r"but not in the checkpoint \(and 1 more: 'b.bias'\)"):
        ss.load(tmp_path / "c", {"enc": enc, "dec": dec})
    assert _same(_weights(enc, dec), before)


def test_a_module_whose_hook_maps_old_keys_is_left_to_decide(tmp_path: Path) -> None:
    """A module whose load hook accepts what torch's rules alone would refuse
    (here: a post hook that forgives a key it does not have) is not refused early."""
    torch.manual_seed(0)
    src = torch.nn.Linear(4, 4)
    ss.save(tmp_path / "c", {"m": {**src.state_dict(), "legacy": torch.zeros(2)}})
    dst = torch.nn.Linear(4, 4)

    def forgive(module: Any, keys: Any) -> None:
        keys.unexpected_keys[:] = [k for k in keys.unexpected_keys if k != "legacy"]

    dst.register_load_state_dict_post_hook(forgive)
    assert ss.load(tmp_path / "c", {"m": dst})["m"] is dst
    assert torch.equal(dst.weight, src.weight)
    with pytest.raises(ss.TargetMismatchError, match=r"key path 'm/legacy'"):
        ss.load(tmp_path / "c", {"m": torch.nn.Linear(4, 4)})  # no hook: refused first


def test_load_state_dict_comes_after_every_value_is_built(tmp_path: Path) -> None:
    """A value that fails only once read (an int64 a float target cannot hold) fails
    the load before any load_state_dict: the module before it keeps its weights."""
    torch.manual_seed(0)
    ss.save(tmp_path / "c", {"model": torch.nn.Linear(4, 4), "step": np.int64(2**53 + 1)})
    model = torch.nn.Linear(4, 4)
    before = _weights(model)
    with pytest.raises(ss.TargetMismatchError, match="key path 'step'"):
        ss.load(tmp_path / "c", {"model": model, "step": 0.0})
    assert _same(_weights(model), before)
