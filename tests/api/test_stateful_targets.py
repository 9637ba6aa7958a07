"""Objects with ``load_state_dict`` as targets: what is refused before anything is
read, and when their state is loaded."""

from __future__ import annotations

import contextlib
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


def _stepped(seed: int = 0) -> tuple[Any, Any, Any]:
    torch.manual_seed(seed)
    m = torch.nn.Linear(4, 2)
    o = torch.optim.Adam(m.parameters(), lr=0.01)
    s = torch.optim.lr_scheduler.StepLR(o, 2)
    m(torch.randn(3, 4)).sum().backward()
    o.step()
    s.step()
    return m, o, s


def _equal_states(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return (isinstance(b, dict) and a.keys() == b.keys()
                and all(_equal_states(a[k], b[k]) for k in a))
    if isinstance(a, (list, tuple)):
        return (type(a) is type(b) and len(a) == len(b)
                and all(_equal_states(x, y) for x, y in zip(a, b)))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return type(a) is type(b) and a == b


def test_an_older_torchs_optimizer_and_scheduler_state_loads_as_torch_loads_it(
        tmp_path: Path) -> None:
    """Keys an older torch did not save (Adam's decoupled_weight_decay, StepLR's
    _is_initial) and a Python-number per-parameter step where the stepped target
    has a tensor: torch's load_state_dict accepts them, and so does the load, which
    leaves them to it. The result is what torch's own load makes of the state."""
    import copy

    m, o, s = _stepped()
    old_o = copy.deepcopy(o.state_dict())
    for g in old_o["param_groups"]:
        del g["decoupled_weight_decay"]
    for st in old_o["state"].values():
        st["step"] = float(st["step"])
    old_s = {k: v for k, v in s.state_dict().items() if k != "_is_initial"}
    ss.save(tmp_path / "c", {"optim": old_o, "sched": old_s})
    _, o2, s2 = _stepped(1)  # stepped: its state has tensors, its groups every key
    out = ss.load(tmp_path / "c", {"optim": o2, "sched": s2})
    assert out["optim"] is o2 and out["sched"] is s2
    o3 = torch.optim.Adam(m.parameters(), lr=0.01)
    o3.load_state_dict(copy.deepcopy(old_o))
    s3 = torch.optim.lr_scheduler.StepLR(o3, 2)
    s3.load_state_dict(dict(old_s))
    assert _equal_states(o2.state_dict(), o3.state_dict())
    assert isinstance(o2.state_dict()["state"][0]["step"], torch.Tensor)
    assert _equal_states(s2.state_dict(), s3.state_dict())


def test_a_module_state_torch_completes_itself_loads(tmp_path: Path) -> None:
    """A BatchNorm state without num_batches_tracked (an old checkpoint), and a
    module whose load pre-hook maps an old key name: torch loads both, so does
    the load (the keys the checkpoint lacks are the module's to fill in)."""
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm1d(3)
    bn(torch.randn(8, 3))
    state = {k: v for k, v in bn.state_dict().items() if k != "num_batches_tracked"}
    src = torch.nn.Linear(2, 2)
    ss.save(tmp_path / "c", {"bn": state, "lin": {"old_weight": src.weight, "bias": src.bias}})
    lin = torch.nn.Linear(2, 2)

    def rename(module: Any, sd: dict[str, Any], prefix: str, *args: Any) -> None:
        if prefix + "old_weight" in sd:
            sd[prefix + "weight"] = sd.pop(prefix + "old_weight")

    lin.register_load_state_dict_pre_hook(rename)
    out = ss.load(tmp_path / "c", {"bn": torch.nn.BatchNorm1d(3), "lin": lin})
    assert torch.equal(out["bn"].running_mean, bn.running_mean)
    assert torch.equal(lin.weight, src.weight)


def test_a_plain_target_stays_strict(tmp_path: Path) -> None:
    """Outside a stateful target, a key the checkpoint lacks and a value of another
    kind are still refused, naming the key path."""
    ss.save(tmp_path / "c", {"opt": {"lr": 0.1, "step": 3.0}})
    with pytest.raises(ss.MissingKeyError, match="key path 'opt/wd' is in the target"):
        ss.load(tmp_path / "c", {"opt": {"lr": 0.1, "step": 0.0, "wd": 0.0}})
    with pytest.raises(ss.TargetMismatchError, match="array at key path 'opt/step'"):
        ss.load(tmp_path / "c", {"opt": {"lr": 0.1, "step": torch.zeros(1)}})
    # a 0-d tensor takes the saved number (tests/api/test_number_targets.py)
    got = ss.load(tmp_path / "c", {"opt": {"lr": 0.1, "step": torch.tensor(0.0)}})
    assert got["opt"]["step"].item() == 3.0


@pytest.mark.parametrize("key,make", [
    ("optim", lambda: torch.optim.Adam(torch.nn.Linear(2, 2).parameters())),
    ("scaler", lambda: torch.amp.GradScaler("cpu", init_scale=123.0)),
    ("model", lambda: torch.nn.Linear(2, 2)),
    ("model", lambda: torch.compile(torch.nn.Linear(2, 2), backend="eager")),
    ("step", lambda: {"nested": np.zeros(3)}),
    ("step", lambda: [1, 2]),
    ("blob", lambda: np.zeros(2, np.uint8)),
    ("blob", lambda: {"b": b""}),
    ("rng", lambda: np.random.default_rng(0)),
])
def test_a_target_that_takes_more_than_the_plain_value_saved_is_refused(
        tmp_path: Path, key: str, make: Any) -> None:
    """An object, container or array target where the checkpoint holds None, an int
    or bytes was returned as the saved value, its load_state_dict never called:
    refused, naming the key path. None and plain targets take any plain value
    (also once JAX, which expands None as an empty pytree, is imported)."""
    with contextlib.suppress(ImportError):
        import jax  # noqa: F401
    ss.save(tmp_path / "c", {"optim": None, "scaler": None, "model": 7, "step": 3,
                             "blob": b"xy", "rng": "r"})
    target = make()
    saved = {"optim": "none", "scaler": "none", "model": "int", "step": "int",
             "blob": "bytes", "rng": "str"}[key]
    with pytest.raises(ss.TargetMismatchError,
                       match=rf"the target has an? .* at key path '{key}' but the "
                             rf"checkpoint holds a {saved} there"):
        ss.load(tmp_path / "c", {key: target})
    got = ss.load(tmp_path / "c", {"optim": None, "scaler": 0.0, "model": 0, "step": "",
                                   "blob": b"", "rng": None})
    assert got == {"optim": None, "scaler": None, "model": 7, "step": 3, "blob": b"xy",
                   "rng": "r"}


class _Refuses:
    """An object whose load_state_dict refuses any state: only the call can tell."""

    def __init__(self) -> None:
        self.x = 0

    def state_dict(self) -> dict[str, Any]:
        return {"x": self.x}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise ValueError("refused by its own rules")


def test_a_late_refusal_names_what_was_loaded_and_what_was_not(tmp_path: Path) -> None:
    """A load_state_dict that refuses only when called stops the load there: the
    error says which objects before it were loaded (they keep the checkpoint's
    state), and those after it are untouched and named as not loaded."""
    torch.manual_seed(0)
    ss.save(tmp_path / "c", {"enc": torch.nn.Linear(4, 4), "obj": {"x": 1},
                             "dec": torch.nn.Linear(4, 4)})
    saved_enc = _weights(ss.load(tmp_path / "c", {"enc": torch.nn.Linear(4, 4)})["enc"])
    enc, obj, dec = torch.nn.Linear(4, 4), _Refuses(), torch.nn.Linear(4, 4)
    dec_before = _weights(dec)
    with pytest.raises(ss.TargetMismatchError) as e:
        ss.load(tmp_path / "c", {"enc": enc, "obj": obj, "dec": dec})
    msg = str(e.value).replace("\n", " ")
    assert "_Refuses.load_state_dict() at key path 'obj' rejected the checkpoint's state: " \
           "ValueError: refused by its own rules" in msg
    assert ("The load stopped there, leaving the target partly loaded: 'enc' (before it) was "
            "loaded with the checkpoint's state, which a load cannot undo; 'obj' holds what "
            "the failed call left of it; 'dec' (due after it) was not loaded.") in msg
    assert _same(_weights(enc), saved_enc) and _same(_weights(dec), dec_before)
    with pytest.raises(ss.TargetMismatchError, match="The load stopped there: 'obj' holds"):
        ss.load(tmp_path / "c", {"obj": _Refuses(), "dec": torch.nn.Linear(4, 4)})


def _adam(module: Any, groups: int = 1) -> Any:
    ps = list(module.parameters())
    if groups == 2:
        return torch.optim.Adam([{"params": ps[:1]}, {"params": ps[1:]}])
    return torch.optim.Adam(ps)


def test_an_optimizer_whose_groups_do_not_match_is_refused_before_anything_loads(
        tmp_path: Path) -> None:
    """torch's Optimizer.load_state_dict refuses other numbers of parameter groups or
    of parameters in a group; that is known from the manifest, so the load raises
    before the module before it in the tree is loaded (it was loaded, then the
    optimizer refused)."""
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 4)
    ss.save(tmp_path / "one", {"model": m, "optim": _adam(m)})
    ss.save(tmp_path / "none", {"model": m, "optim": {"state": {}}})
    ss.save(tmp_path / "int", {"model": m, "optim": {"state": {}, "param_groups": 5}})
    for name, groups, match in (
            ("one", 2, r"its 1 parameter groups hold \[2\] parameters, the optimizer's 2 hold "
                       r"\[1, 1\]"),
            ("none", 1, "it has no 'state' or no 'param_groups'"),
            ("int", 1, "its 'param_groups' is an int, not a list")):
        model = torch.nn.Linear(4, 4)
        before = _weights(model)
        with pytest.raises(ss.TargetMismatchError,
                           match=r"state at key path 'optim' is not one torch.optim.adam.Adam"
                                 rf".load_state_dict\(\) accepts: {match}.*nothing was loaded"):
            ss.load(tmp_path / name, {"model": model, "optim": _adam(model, groups)})
        assert _same(_weights(model), before)


def test_an_optimizer_with_a_load_pre_hook_is_left_to_decide(tmp_path: Path) -> None:
    """A load pre-hook may rewrite the state (here: it supplies the groups the saved
    state lacks), so nothing is refused early for such an optimizer."""
    torch.manual_seed(0)
    ss.save(tmp_path / "c", {"optim": {"state": {}}})
    opt = _adam(torch.nn.Linear(4, 4))
    opt.param_groups[0]["lr"] = 0.5

    def groups(o: Any, state: dict[str, Any]) -> dict[str, Any]:
        return {**state, "param_groups": o.state_dict()["param_groups"]}

    opt.register_load_state_dict_pre_hook(groups)
    assert ss.load(tmp_path / "c", {"optim": opt})["optim"] is opt
    assert opt.param_groups[0]["lr"] == 0.5


def test_a_module_state_holding_no_tensor_for_a_weight_is_refused_first(
        tmp_path: Path) -> None:
    """A saved state with a plain value (or a list) where the module has a parameter:
    torch's strict load_state_dict refuses it after copying the other tensors, so
    the load raises before that, and before the module ahead of it is loaded."""
    torch.manual_seed(0)
    ss.save(tmp_path / "c", {"enc": torch.nn.Linear(4, 4),
                             "dec": {"weight": 3, "bias": torch.ones(4)},
                             "lst": {"weight": [1.0], "bias": torch.ones(4)}})
    for key, kind in (("dec", "an int"), ("lst", "a list")):
        enc, dec = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        before = _weights(enc, dec)
        with pytest.raises(ss.TargetMismatchError,
                           match=rf"state at key path '{key}' is not one torch.nn.modules.linear"
                                 rf".Linear.load_state_dict\(\) accepts: 'weight' is {kind} in "
                                 "the checkpoint, a tensor in the module.*nothing was loaded"):
            ss.load(tmp_path / "c", {"enc": enc, key: dec})
        assert _same(_weights(enc, dec), before)


def _rng_states(*gens: Any) -> list[Any]:
    import copy
    import random

    out: list[Any] = []
    for g in gens:
        if isinstance(g, np.random.Generator):
            out.append(copy.deepcopy(g.bit_generator.state))
        elif isinstance(g, random.Random):
            out.append(g.getstate())
        else:
            out.append(g.get_state().tolist())
    return out


def test_generators_get_their_state_only_once_the_whole_load_holds(tmp_path: Path) -> None:
    """A generator in the target got its state as its value was built, before the
    values after it: one that then failed (a lossy scalar, a generator of another
    kind) or a load_state_dict that refused left the generators before it moved.
    Their state is now checked on a fresh generator of their kind and put in last,
    after every call that may refuse."""
    import random

    ss.save(tmp_path / "c", {"np": np.random.default_rng(1), "py": random.Random(1),
                             "tg": torch.Generator().manual_seed(1),
                             "np2": np.random.default_rng(3), "step": np.int64(2**53 + 1),
                             "obj": {"x": 1}})

    def fresh() -> dict[str, Any]:
        return {"np": np.random.default_rng(2), "py": random.Random(2),
                "tg": torch.Generator().manual_seed(2)}

    for extra, err, match in (
            ({"step": 0.0}, ss.TargetMismatchError, "key path 'step'"),
            ({"np2": np.random.Generator(np.random.MT19937(4))}, ss.TargetMismatchError,
             "'np2' was saved with bit generator 'PCG64'"),
            ({"obj": _Refuses()}, ss.TargetMismatchError,
             r"The load stopped there: 'obj' holds what the failed call left of it; 'np', "
             r"'py', 'tg' \(due after it\) were not loaded")):
        gens = fresh()
        before = _rng_states(*gens.values())
        with pytest.raises(err, match=match):
            ss.load(tmp_path / "c", {**gens, **extra})
        assert _rng_states(*gens.values()) == before
    gens = fresh()
    out = ss.load(tmp_path / "c", {**gens, "step": 0})
    assert all(out[k] is gens[k] for k in gens)
    assert _rng_states(*gens.values()) == _rng_states(
        np.random.default_rng(1), random.Random(1), torch.Generator().manual_seed(1))


def test_a_compiled_module_loads_as_the_module_it_wraps_once_the_whole_load_holds(
        tmp_path: Path) -> None:
    """A torch.compile'd module target of a saved module got its load_state_dict as
    its value was built: a saved state it refuses was found only after every read,
    and a value after it that failed left it loaded. It now loads as the module it
    wraps: refused before anything is read, loaded with the other objects."""
    torch.manual_seed(0)
    ss.save(tmp_path / "c", {"m": _Big(), "step": np.int64(2**53 + 1)})
    small = torch.compile(_Small())
    with pytest.raises(ss.TargetMismatchError, match=r"key path 'm/b.weight' \(and 1 more"
                       r".*_Small.load_state_dict\(\) would refuse.*nothing was loaded"):
        ss.load(tmp_path / "c", {"m": small})
    big = torch.compile(_Big())
    before = _weights(big)
    with pytest.raises(ss.TargetMismatchError, match="key path 'step'"):
        ss.load(tmp_path / "c", {"m": big, "step": 0.0})
    assert _same(_weights(big), before)
    assert ss.load(tmp_path / "c", {"m": big, "step": 0})["m"] is big
    assert _same(_weights(big), _weights(ss.load(tmp_path / "c", {"m": _Big()})["m"]))


def test_with_in_place_a_late_refusal_says_the_objects_after_it_may_hold_read_values(
        tmp_path: Path) -> None:
    """With in_place=True the reads write straight into a module's own tensors, before
    any load_state_dict: a module due after a refusing object was said to be 'not
    loaded', though its weights already held the checkpoint's."""
    torch.manual_seed(0)
    ss.save(tmp_path / "c", {"obj": {"x": 1}, "m": torch.nn.Linear(4, 4)})
    m = torch.nn.Linear(4, 4)
    with pytest.raises(ss.TargetMismatchError,
                       match=r"'m' \(due after it\) was not loaded \(with in_place=True the "
                             r"reads may have written the checkpoint's values into their "
                             r"tensors and arrays already\)"):
        ss.load(tmp_path / "c", {"obj": _Refuses(), "m": m}, in_place=True)
    with pytest.raises(ss.TargetMismatchError, match=r"'m' \(due after it\) was not loaded\.$"):
        ss.load(tmp_path / "c", {"obj": _Refuses(), "m": torch.nn.Linear(4, 4)})


class _Seeded(np.random.PCG64):
    """A bit generator of its own kind that cannot be made without an argument."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed)


def test_a_bit_generator_that_needs_arguments_still_loads(tmp_path: Path) -> None:
    """Its state cannot be checked on a fresh one of its kind (none can be made), so
    it goes in as its value is built, as before the checks."""
    ss.save(tmp_path / "c", {"g": np.random.Generator(_Seeded(1))})
    g = np.random.Generator(_Seeded(2))
    assert ss.load(tmp_path / "c", {"g": g})["g"] is g
    assert g.integers(1000, size=4).tolist() == np.random.Generator(
        _Seeded(1)).integers(1000, size=4).tolist()


class _Factor:
    """A callable object: LambdaLR saves its __dict__ (a function saves as None)."""

    def __init__(self, k: float) -> None:
        self.k = k

    def __call__(self, epoch: int) -> float:
        return self.k


def test_a_lambda_scheduler_of_fewer_lambdas_is_refused_before_anything_loads(
        tmp_path: Path) -> None:
    """LambdaLR.load_state_dict takes the state's other entries, then raises an
    IndexError for a callable's state past its own lambdas: the module before it was
    loaded and the scheduler half loaded (its base_lrs those of two groups)."""
    ps = [torch.nn.Parameter(torch.zeros(1)) for _ in range(2)]
    two = torch.optim.SGD([{"params": [ps[0]]}, {"params": [ps[1]]}], lr=0.1)
    ss.save(tmp_path / "c", {"m": torch.nn.Linear(4, 4), "s": torch.optim.lr_scheduler.LambdaLR(
        two, [_Factor(1.0), _Factor(0.5)])})
    one = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(one, [_Factor(1.0)])
    m = torch.nn.Linear(4, 4)
    before = _weights(m)
    with pytest.raises(ss.TargetMismatchError,
                       match=r"state at key path 's' is not one torch.optim.lr_scheduler."
                             r"LambdaLR.load_state_dict\(\) accepts: its 'lr_lambdas' hold the "
                             r"state of a callable at index 1, the scheduler has 1 lr_lambdas"
                             r".*nothing was loaded"):
        ss.load(tmp_path / "c", {"m": m, "s": sched})
    assert _same(_weights(m), before) and sched.base_lrs == [0.1]
    ss.save(tmp_path / "f", {"s": torch.optim.lr_scheduler.LambdaLR(
        two, [lambda e: 1.0, lambda e: 0.5])})  # functions save as None: torch takes it
    assert ss.load(tmp_path / "f", {"s": sched})["s"] is sched


def test_a_sequential_scheduler_of_fewer_schedulers_is_refused_before_anything_loads(
        tmp_path: Path) -> None:
    """SequentialLR.load_state_dict takes its own entries and loads the schedulers it
    has, then raises an IndexError for a saved one past them."""
    def sequential(n: int) -> Any:
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        subs = [torch.optim.lr_scheduler.StepLR(opt, 2) for _ in range(n)]
        return torch.optim.lr_scheduler.SequentialLR(opt, subs, milestones=list(range(1, n)))

    ss.save(tmp_path / "c", {"m": torch.nn.Linear(4, 4), "s": sequential(3)})
    m, sched = torch.nn.Linear(4, 4), sequential(2)
    before = _weights(m)
    with pytest.raises(ss.TargetMismatchError,
                       match=r"its '_schedulers' hold the states of 3 schedulers, the "
                             r"scheduler has 2.*nothing was loaded"):
        ss.load(tmp_path / "c", {"m": m, "s": sched})
    assert _same(_weights(m), before) and sched._milestones == [1]
    assert ss.load(tmp_path / "c", {"s": sequential(3)})["s"]._milestones == [1, 2]
