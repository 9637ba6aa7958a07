"""The state people have: RNG states and generators come back as what they were,
compiled modules load either way (issue 12, items 4-6)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import statestream as ss
from statestream.errors import CheckpointError, TargetMismatchError, UnsupportedTypeError
from statestream.format import (
    COMMIT_NAME,
    MANIFEST_NAME,
    decode_manifest,
    encode_commit,
    encode_manifest,
)
from statestream.providers import StateAdapter, register_adapter
from statestream.tree import Node

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")


# ----------------------------------------------------------------------------- item 4


def test_readme_rng_example_restores_a_torch_tensor(tmp_path: Path) -> None:
    torch.manual_seed(1234)
    ss.save(tmp_path / "c", {"rng": torch.get_rng_state(), "step": 100})
    expected = torch.rand(5)
    torch.manual_seed(0)
    out = ss.load(tmp_path / "c", target={"rng": None, "step": 0})
    assert isinstance(out["rng"], torch.Tensor) and out["rng"].dtype == torch.uint8
    torch.set_rng_state(out["rng"])  # rejected a NumPy array before
    assert torch.equal(torch.rand(5), expected)


def test_none_in_target_returns_the_saved_kind(tmp_path: Path) -> None:
    state = {"t": torch.arange(4), "j": jax.numpy.arange(3.0), "n": np.ones(2),
             "sub": {"t": torch.zeros(2)}}
    ss.save(tmp_path / "c", state)
    out = ss.load(tmp_path / "c", {"t": None, "j": None, "n": None, "sub": None})
    assert isinstance(out["t"], torch.Tensor) and torch.equal(out["t"], state["t"])
    assert isinstance(out["j"], jax.Array)
    assert np.array_equal(np.asarray(out["j"]), np.arange(3.0))
    assert type(out["n"]) is np.ndarray
    assert isinstance(out["sub"]["t"], torch.Tensor)
    # no target at all: NumPy, as documented
    plain = ss.load(tmp_path / "c")
    assert type(plain["t"]) is np.ndarray and type(plain["j"]) is np.ndarray


def test_old_checkpoint_without_kind_loads_as_numpy(tmp_path: Path) -> None:
    ss.save(tmp_path / "c", {"t": torch.arange(4)})
    mpath = tmp_path / "c" / MANIFEST_NAME
    m = decode_manifest(mpath.read_bytes(), "test")
    assert m.tree.children is not None
    m.tree.children[0] = Node("array", array=0)  # as if written without the kind
    data = encode_manifest(m)
    mpath.write_bytes(data)
    (tmp_path / "c" / COMMIT_NAME).write_bytes(encode_commit(data))
    out = ss.load(tmp_path / "c", {"t": None})
    assert type(out["t"]) is np.ndarray and list(out["t"]) == [0, 1, 2, 3]


# ----------------------------------------------------------------------------- item 5


def _generators() -> dict[str, object]:
    return {
        "torch": torch.Generator().manual_seed(3),
        "np": np.random.default_rng(5),
        "np_mt": np.random.Generator(np.random.MT19937(7)),
        "bitgen": np.random.PCG64(9),
        "legacy": np.random.RandomState(11),
        "py": random.Random(13),
        "key": jax.random.key(17),
    }


def _draw(g: dict[str, object]) -> list[np.ndarray]:
    return [
        torch.rand(4, generator=g["torch"]).numpy(),  # type: ignore[arg-type]
        g["np"].random(4),  # type: ignore[attr-defined]
        g["np_mt"].random(4),  # type: ignore[attr-defined]
        g["bitgen"].random_raw(4),  # type: ignore[attr-defined]
        g["legacy"].rand(4),  # type: ignore[attr-defined]
        np.array([g["py"].random() for _ in range(4)]),  # type: ignore[attr-defined]
        np.asarray(jax.random.uniform(g["key"], (4,))),  # type: ignore[arg-type]
    ]


def _advance(g: dict[str, object]) -> None:
    _draw(g)
    g["py"].gauss(0, 1)  # type: ignore[attr-defined]  # leaves a cached gauss_next


@pytest.mark.parametrize("target_kind", ["same", "none"])
def test_generators_restore_the_exact_stream(tmp_path: Path, target_kind: str) -> None:
    gens = _generators()
    _advance(gens)
    ss.save(tmp_path / "c", {"gens": gens})
    manifest = (tmp_path / "c" / MANIFEST_NAME).read_text()
    assert '"pickle"' not in manifest
    expected = _draw(gens)
    if target_kind == "same":
        fresh = {"torch": torch.Generator(), "np": np.random.default_rng(0),
                 "np_mt": np.random.Generator(np.random.MT19937(0)),
                 "bitgen": np.random.PCG64(0), "legacy": np.random.RandomState(0),
                 "py": random.Random(0), "key": jax.random.key(0)}
        out = ss.load(tmp_path / "c", {"gens": fresh})["gens"]
        for name in ("torch", "np", "bitgen", "legacy", "py"):
            assert out[name] is fresh[name]  # restored in place
    else:
        out = ss.load(tmp_path / "c", {"gens": None})["gens"]
        assert isinstance(out["torch"], torch.Generator)
        assert isinstance(out["np"], np.random.Generator)
        assert isinstance(out["py"], random.Random)
        assert jax.dtypes.issubdtype(out["key"].dtype, jax.dtypes.prng_key)
    for a, b in zip(expected, _draw(out)):
        assert np.array_equal(a, b)


def test_generators_without_target_load_as_plain_state(tmp_path: Path) -> None:
    ss.save(tmp_path / "c", {"key": jax.random.key(3), "np": np.random.default_rng(1)})
    out = ss.load(tmp_path / "c")
    assert out["key"]["impl"] == "threefry2x32"
    assert list(out["key"]["data"]) == [0, 3]
    assert out["np"]["bit_generator"] == "PCG64"


def test_typed_key_in_a_jax_pytree(tmp_path: Path) -> None:
    keys = [jax.random.key(1), jax.random.split(jax.random.key(2), 3)]
    ss.save(tmp_path / "c", {"keys": keys})
    out = ss.load(tmp_path / "c", {"keys": [jax.random.key(0), jax.random.split(
        jax.random.key(0), 3)]})
    for a, b in zip(keys, out["keys"]):
        assert np.array_equal(jax.random.key_data(a), jax.random.key_data(b))
        assert a.shape == b.shape


def test_a_typed_key_of_another_impl_is_refused(tmp_path: Path) -> None:
    # rbg and unsafe_rbg keys hold the same uint32[4] data: the saved rbg key came
    # back into an unsafe_rbg target as an rbg key, the target's impl ignored
    ss.save(tmp_path / "c", {"k": jax.random.key(6, impl="rbg")})
    with pytest.raises(TargetMismatchError,
                       match="key path 'k' is a unsafe_rbg key, the checkpoint holds a rbg"):
        ss.load(tmp_path / "c", {"k": jax.random.key(0, impl="unsafe_rbg")})
    out = ss.load(tmp_path / "c", {"k": jax.random.key(0, impl="rbg")})
    assert np.array_equal(jax.random.key_data(out["k"]),
                          jax.random.key_data(jax.random.key(6, impl="rbg")))
    # a jax.ShapeDtypeStruct of the other impl's key dtype (jax.eval_shape) too
    abstract = jax.ShapeDtypeStruct((), jax.random.key(0, impl="unsafe_rbg").dtype)
    with pytest.raises(TargetMismatchError, match="key path 'k' describes a key<urbg> "
                       "key, the checkpoint holds a rbg key"):
        ss.load(tmp_path / "c", {"k": abstract})


def test_a_typed_key_of_another_data_shape_names_both_impls(tmp_path: Path) -> None:
    # a threefry key (uint32[2] data) into an rbg target (uint32[4]) was a shape
    # mismatch at 'k/data', naming neither impl
    ss.save(tmp_path / "c", {"k": jax.random.key(6)})
    with pytest.raises(TargetMismatchError, match="key path 'k' is a rbg key, the "
                       "checkpoint holds a threefry2x32 key: pass a key of that impl"):
        ss.load(tmp_path / "c", {"k": jax.random.key(0, impl="rbg")})
    with pytest.raises(TargetMismatchError, match="key path 'k' describes a key<rbg> key, "
                       "the checkpoint holds a threefry2x32 key"):
        ss.load(tmp_path / "c", {"k": jax.eval_shape(lambda: jax.random.key(0, impl="rbg"))})


def test_a_typed_key_into_a_raw_key_target_names_the_key(tmp_path: Path) -> None:
    # a raw uint32 key (jax.random.PRNGKey) as the target of a saved typed key said
    # "the checkpoint holds a dict there" (the key's saved state)
    ss.save(tmp_path / "c", {"k": jax.random.key(6), "g": np.random.default_rng(0)})
    with pytest.raises(TargetMismatchError, match="key path 'k' but the checkpoint holds a "
                       r"jax\.random\.key there; load it into a typed key target"):
        ss.load(tmp_path / "c", {"k": jax.random.PRNGKey(0)}, items=["k"])
    with pytest.raises(TargetMismatchError, match="key path 'g' but the checkpoint holds a "
                       r"numpy\.random\.Generator there$"):
        ss.load(tmp_path / "c", {"g": np.zeros(2)}, items=["g"])


def test_typed_keys_load_into_abstract_targets(tmp_path: Path) -> None:
    # jax.eval_shape of a state with typed keys gives ShapeDtypeStructs of a key
    # dtype; they used to be refused ("the target has an array ... holds a dict")
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()[:1]), ("a",))
    state = {"key": jax.random.key(5), "rbg": jax.random.key(6, impl="rbg"),
             "split": jax.device_put(jax.random.split(jax.random.key(7), 4),
                                     NamedSharding(mesh, PartitionSpec("a")))}
    ss.save(tmp_path / "c", state)
    target = jax.eval_shape(lambda: state)
    target["split"] = jax.ShapeDtypeStruct((4,), state["split"].dtype,
                                           sharding=state["split"].sharding)
    out = ss.load(tmp_path / "c", target)
    for name, key in state.items():
        assert out[name].dtype == key.dtype and out[name].shape == key.shape, name
        assert np.array_equal(jax.random.key_data(out[name]), jax.random.key_data(key))
        first = (lambda k: k) if key.shape == () else (lambda k: k[0])
        assert np.array_equal(jax.random.uniform(first(out[name]), (3,)),
                              jax.random.uniform(first(key), (3,)))
    assert out["split"].sharding.is_equivalent_to(state["split"].sharding, 1)
    with pytest.raises(TargetMismatchError, match="key path 'rbg' describes a key<fry> key"):
        ss.load(tmp_path / "c", {"rbg": jax.ShapeDtypeStruct((), state["key"].dtype)})


def test_generator_state_mismatch_names_the_key_path(tmp_path: Path) -> None:
    ss.save(tmp_path / "c", {"g": np.random.default_rng(1)})
    with pytest.raises(CheckpointError, match="key path 'g"):
        ss.load(tmp_path / "c", {"g": np.random.Generator(np.random.MT19937(0))})
    with pytest.raises(TargetMismatchError, match="key path 'g'"):
        ss.load(tmp_path / "c", {"g": random.Random(0)})


def test_array_saved_where_target_has_a_generator(tmp_path: Path) -> None:
    ss.save(tmp_path / "c", {"g": np.zeros(3)})
    with pytest.raises(TargetMismatchError, match="'g'"):
        ss.load(tmp_path / "c", {"g": torch.Generator()})


def test_hostile_bit_generator_name_is_refused(tmp_path: Path) -> None:
    ss.save(tmp_path / "c", {"g": np.random.default_rng(1)})
    mpath = tmp_path / "c" / MANIFEST_NAME
    data = mpath.read_bytes().replace(b'"PCG64"', b'"os.system"')
    mpath.write_bytes(data)
    (tmp_path / "c" / COMMIT_NAME).write_bytes(encode_commit(data))
    with pytest.raises(CheckpointError, match="'g'.*os.system"):
        ss.load(tmp_path / "c", {"g": None})


# ----------------------------------------------------------------------------- item 6


def _net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))


@pytest.mark.parametrize("direction", ["compiled->plain", "plain->compiled",
                                       "compiled->compiled"])
def test_compiled_module_loads_either_way(tmp_path: Path, direction: str) -> None:
    torch.manual_seed(0)
    src_plain = _net()
    src = torch.compile(src_plain, backend="eager") if direction.startswith("compiled") \
        else src_plain
    src(torch.ones(1, 3))  # compile it for real
    ss.save(tmp_path / "c", {"model": src})
    keys = list(ss.metadata(tmp_path / "c").tree["model"])
    assert keys == ["0.weight", "0.bias", "2.weight", "2.bias"]  # no _orig_mod.
    dst_plain = _net()
    dst = torch.compile(dst_plain, backend="eager") if direction.endswith("compiled") \
        else dst_plain
    out = ss.load(tmp_path / "c", {"model": dst})
    assert out["model"] is dst
    for a, b in zip(src_plain.state_dict().values(), dst_plain.state_dict().values()):
        assert torch.equal(a, b)
    x = torch.randn(2, 3)
    assert torch.equal(dst(x), src(x))


@pytest.mark.parametrize("saved", ["compiled", "plain"])
@pytest.mark.parametrize("into", ["compiled", "plain"])
def test_state_dict_saved_as_a_dict_loads_into_either_module(tmp_path: Path, saved: str,
                                                             into: str) -> None:
    """``{"model": m.state_dict()}``: a compiled module's keys carry ``_orig_mod.``, a
    plain one's do not; either loads into a compiled or a plain module (the prefix is
    mapped, as it is when the module itself is saved)."""
    torch.manual_seed(0)
    src_plain = _net()
    src = torch.compile(src_plain, backend="eager") if saved == "compiled" else src_plain
    src(torch.ones(1, 3))
    ss.save(tmp_path / "c", {"model": src.state_dict(), "step": 3})
    prefix = "_orig_mod." if saved == "compiled" else ""
    assert list(ss.metadata(tmp_path / "c").tree["model"])[0] == prefix + "0.weight"
    dst_plain = _net()
    dst = torch.compile(dst_plain, backend="eager") if into == "compiled" else dst_plain
    out = ss.load(tmp_path / "c", {"model": dst, "step": None})
    assert out["model"] is dst and out["step"] == 3
    for a, b in zip(src_plain.state_dict().values(), dst_plain.state_dict().values()):
        assert torch.equal(a, b)
    x = torch.randn(2, 3)
    assert torch.equal(dst(x), src(x))


def test_compiled_state_dict_into_a_plain_dict_target_names_the_prefix(tmp_path: Path) -> None:
    """A dict target is matched key by key (as torch's load_state_dict would refuse it):
    the error names the key the checkpoint has and says to load into the module."""
    src = torch.compile(_net(), backend="eager")
    ss.save(tmp_path / "c", {"model": src.state_dict()})
    with pytest.raises(ss.MissingKeyError, match="has it as '_orig_mod.0.weight'.*module"):
        ss.load(tmp_path / "c", {"model": _net().state_dict()})
    ss.save(tmp_path / "p", {"model": _net().state_dict()})
    with pytest.raises(ss.MissingKeyError, match="has it as '0.weight'"):
        ss.load(tmp_path / "p", {"model": src.state_dict()})


def test_prefix_is_kept_when_the_target_has_it_too(tmp_path: Path) -> None:
    """A plain module whose own parameters live under a submodule named ``_orig_mod``
    loads its saved keys as they are (the prefix is mapped only when the target has none)."""
    holder = torch.nn.Module()
    holder._orig_mod = _net()
    ss.save(tmp_path / "h", {"model": holder.state_dict()})
    dst = torch.nn.Module()
    dst._orig_mod = _net()
    ss.load(tmp_path / "h", {"model": dst})
    for a, b in zip(holder.state_dict().values(), dst.state_dict().values()):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------- new kinds


class _Counter:
    """A stateful value with no state_dict(): a new kind needs only an adapter."""

    def __init__(self, n: int = 0) -> None:
        self.n = n
        self.hist = np.arange(n, dtype=np.int64)


class _CounterAdapter(StateAdapter):
    name = "tests.Counter"

    def handles(self, obj: object) -> bool:
        return isinstance(obj, _Counter)

    def get_state(self, obj: Any) -> Any:
        return {"n": obj.n, "hist": obj.hist}

    def set_state(self, obj: Any, state: Any, path: Any) -> Any:
        obj.n, obj.hist = state["n"], state["hist"]
        return obj

    def new(self, state: Any, path: Any) -> Any:
        return self.set_state(_Counter(), state, path)


def test_a_registered_adapter_saves_and_loads_a_new_kind(tmp_path: Path) -> None:
    register_adapter(_CounterAdapter())
    with pytest.raises(UnsupportedTypeError, match="already registered"):
        register_adapter(_CounterAdapter())
    ss.save(tmp_path / "c", {"c": _Counter(5)})
    like = _Counter(5)
    like.n, like.hist = 0, np.zeros(5, np.int64)  # its state types what is loaded
    assert ss.load(tmp_path / "c", {"c": like})["c"] is like and like.n == 5
    assert list(like.hist) == [0, 1, 2, 3, 4]
    fresh = ss.load(tmp_path / "c", {"c": None})["c"]
    assert isinstance(fresh, _Counter) and list(fresh.hist) == [0, 1, 2, 3, 4]
    assert ss.load(tmp_path / "c")["c"]["n"] == 5


@pytest.mark.parametrize("target_kind", ["same", "other seed", "none"])
def test_spawn_after_a_load_continues_the_run(tmp_path: Path, target_kind: str) -> None:
    # only the bit generator's state was saved: spawn() then drew other children (the
    # target's seed sequence, or fresh OS entropy with a None target: not even the
    # same from one load to the next)
    g = np.random.default_rng(1234)
    g.spawn(3)  # children spawned so far count too
    bg = np.random.Generator(np.random.Philox(np.random.SeedSequence(7, spawn_key=(2, 5))))
    ss.save(tmp_path / "c", {"g": g, "bits": bg.bit_generator})
    want = [c.integers(1 << 30) for c in g.spawn(2)]
    want_bits = np.random.Generator(bg.bit_generator.spawn(1)[0]).integers(1 << 30)
    target = {"same": {"g": np.random.default_rng(1234), "bits": np.random.Philox(0)},
              "other seed": {"g": np.random.default_rng(0), "bits": np.random.Philox(1)},
              "none": {"g": None, "bits": None}}[target_kind]
    out = ss.load(tmp_path / "c", target)
    assert [c.integers(1 << 30) for c in out["g"].spawn(2)] == want
    assert np.random.Generator(out["bits"].spawn(1)[0]).integers(1 << 30) == want_bits


def test_a_generator_saved_without_its_seed_sequence_still_loads(tmp_path: Path,
                                                                 monkeypatch) -> None:
    from statestream.providers import stateful

    g = np.random.default_rng(5)
    monkeypatch.setattr(stateful, "_with_seed_seq", lambda bg: bg.state)  # as before
    ss.save(tmp_path / "c", {"g": g, "b": np.random.PCG64(3)})
    monkeypatch.undo()
    want = np.random.default_rng(5).integers(1 << 30, size=4)
    for target in ({"g": np.random.default_rng(0), "b": np.random.PCG64(0)},
                   {"g": None, "b": None}):
        out = ss.load(tmp_path / "c", target)
        assert (out["g"].integers(1 << 30, size=4) == want).all()
        assert out["b"].state == np.random.PCG64(3).state


def test_another_bit_generator_in_the_target_is_named(tmp_path: Path) -> None:
    ss.save(tmp_path / "c", {"rng": np.random.Generator(np.random.MT19937(1))})
    with pytest.raises(TargetMismatchError, match=r"key path 'rng' was saved with bit generator "
                                                  r"'MT19937', the target's is PCG64"):
        ss.load(tmp_path / "c", {"rng": np.random.default_rng(0)})


def test_plain_key_data_into_a_typed_key_target_is_named(tmp_path: Path) -> None:
    # a bare TypeError "Cannot interpret 'key<fry>' as a data type", no key path
    ss.save(tmp_path / "c", {"opt": {"rng": np.arange(4, dtype=np.uint32)}})
    like = {"opt": {"rng": jax.ShapeDtypeStruct((4,), jax.random.key(0).dtype)}}
    with pytest.raises(TargetMismatchError, match=r"key path 'opt/rng' is a typed PRNG key "
                                                  r"array .*plain uint32\[4\]"):
        ss.load(tmp_path / "c", like)
