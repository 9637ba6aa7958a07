"""StatestreamCheckpointIO gives a callback's state back as torch.load would, or refuses it.

Generators and JAX keys come back as such (a callback's random streams go on
where they were); a namedtuple, dataclass, pytree node or object with
``state_dict()`` would load back as a dict, so the save refuses it naming its key
path, or pickles it with ``pickle=True``.
"""

from __future__ import annotations

import collections
import dataclasses
import random
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
L = pytest.importorskip("lightning")

from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import statestream as ss  # noqa: E402
from statestream.integrations.lightning import (  # noqa: E402
    AsyncStatestreamCheckpointIO,
    StatestreamCheckpointIO,
)

pytestmark = pytest.mark.timeout(240)
warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*GPU available but not used.*")

PLUGINS = pytest.mark.parametrize("plugin_cls",
                                  [StatestreamCheckpointIO, AsyncStatestreamCheckpointIO],
                                  ids=["sync", "async"])


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(3, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def data() -> DataLoader:
    x = torch.randn(12, 3, generator=torch.Generator().manual_seed(1))
    return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=4)


def trainer(root, epochs: int, plugin, callbacks=()) -> L.Trainer:
    return L.Trainer(max_epochs=epochs, plugins=[plugin], callbacks=list(callbacks),
                     default_root_dir=str(root), enable_progress_bar=False, logger=False,
                     enable_model_summary=False, accelerator="cpu", devices=1)


class Draws(Callback):
    """Draws from the generators it keeps in its state at every batch."""

    def __init__(self) -> None:
        self.gens = {"torch": torch.Generator().manual_seed(7),
                     "numpy": np.random.default_rng(8), "legacy": np.random.RandomState(9),
                     "random": random.Random(10)}
        self.drawn: list[tuple] = []
        self.loaded_types: dict[str, type] = {}

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        g = self.gens
        self.drawn.append((torch.randn(3, generator=g["torch"]).tolist(), g["numpy"].random(),
                           g["legacy"].rand(), g["random"].random()))

    def state_dict(self):
        return {"gens": dict(self.gens)}

    def load_state_dict(self, state_dict) -> None:
        self.loaded_types = {k: type(v) for k, v in state_dict["gens"].items()}
        self.gens = dict(state_dict["gens"])


@PLUGINS
def test_a_callbacks_generators_resume_and_continue_their_streams(tmp_path, plugin_cls):
    straight = Draws()
    trainer(tmp_path / "a", 2, plugin_cls(), [straight]).fit(Net(), data())
    assert len(straight.drawn) == 6

    ckdir = tmp_path / "ck"
    first = Draws()
    trainer(tmp_path / "b", 1, plugin_cls(),
            [first, ModelCheckpoint(dirpath=ckdir, save_last=True)]).fit(Net(), data())
    resumed = Draws()  # its own generators are replaced by the saved ones
    trainer(tmp_path / "c", 2, plugin_cls(), [resumed]).fit(
        Net(), data(), ckpt_path=str(ckdir / "last.ckpt"))
    assert resumed.loaded_types == {"torch": torch.Generator, "numpy": np.random.Generator,
                                    "legacy": np.random.RandomState, "random": random.Random}
    assert first.drawn == straight.drawn[:3]
    assert resumed.drawn == straight.drawn[3:]  # bit for bit where the first run stopped


def test_generators_and_jax_keys_come_back_as_saved(tmp_path):
    jax = pytest.importorskip("jax")
    t = torch.Generator().manual_seed(3)
    torch.rand(5, generator=t)
    gens = {"torch": t, "numpy": np.random.default_rng(4), "legacy": np.random.RandomState(5),
            "random": random.Random(6), "pcg": np.random.PCG64(7), "key": jax.random.key(8)}
    ckpt = {"epoch": 1, "callbacks": {"cb": {"gens": gens, "in_a_list": [t, (gens["random"],)],
                                             "w": torch.ones(2)}}}
    io = StatestreamCheckpointIO()
    io.save_checkpoint(ckpt, tmp_path / "g.ckpt")
    got = io.load_checkpoint(tmp_path / "g.ckpt")["callbacks"]["cb"]
    assert {k: type(v) for k, v in got["gens"].items()} == {k: type(v) for k, v in gens.items()}
    assert type(got["in_a_list"][0]) is torch.Generator
    assert type(got["in_a_list"][1][0]) is random.Random
    assert isinstance(got["w"], torch.Tensor)
    g = got["gens"]
    assert torch.equal(torch.rand(4, generator=g["torch"]), torch.rand(4, generator=t))
    assert g["numpy"].random() == gens["numpy"].random()
    assert g["legacy"].rand() == gens["legacy"].rand()
    assert g["random"].random() == gens["random"].random()
    assert g["pcg"].random_raw() == gens["pcg"].random_raw()
    assert jax.random.key_data(g["key"]).tolist() == jax.random.key_data(gens["key"]).tolist()


Pair = collections.namedtuple("Pair", "a b")


@dataclasses.dataclass
class Config:
    lr: float
    w: torch.Tensor


class Counter:
    """An object with state_dict()/load_state_dict(): saved as its state."""

    def __init__(self, n: int = 0) -> None:
        self.n = n

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, sd) -> None:
        self.n = sd["n"]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Counter) and other.n == self.n


def _values():
    return {"namedtuple": Pair(torch.ones(2), 3), "dataclass": Config(0.1, torch.zeros(2)),
            "stateful": Counter(4)}


@PLUGINS
@pytest.mark.parametrize("what", ["namedtuple", "dataclass", "stateful"])
def test_values_that_would_load_as_dicts_are_refused_naming_their_key_path(tmp_path, plugin_cls,
                                                                           what):
    value = _values()[what]
    ckpt = {"epoch": 0, "callbacks": {"Keeper": {"fine": torch.ones(1), "v": [1, {"x": value}]}}}
    plugin = plugin_cls()
    with pytest.raises(ss.UnsupportedTypeError) as err:
        plugin.save_checkpoint(ckpt, tmp_path / "r.ckpt")
    plugin.teardown()
    assert "key path 'callbacks/Keeper/v/1/x'" in str(err.value)
    assert type(value).__name__ in str(err.value)
    assert f"{plugin_cls.__name__}(pickle=True)" in str(err.value)
    assert not (tmp_path / "r.ckpt").exists()  # nothing written


def test_a_pytree_node_is_refused(tmp_path):
    jax = pytest.importorskip("jax")

    @jax.tree_util.register_pytree_node_class
    class Box:
        def __init__(self, x) -> None:
            self.x = x

        def tree_flatten(self):
            return (self.x,), None

        @classmethod
        def tree_unflatten(cls, aux, children):
            return cls(*children)

    with pytest.raises(ss.UnsupportedTypeError, match="'cb/box'.*pytree node"):
        StatestreamCheckpointIO().save_checkpoint({"cb": {"box": Box(torch.ones(2))}},
                                                  tmp_path / "p.ckpt")
    assert not (tmp_path / "p.ckpt").exists()


class Keeper(Callback):
    def __init__(self) -> None:
        self.pair = Pair(torch.ones(2), 1)

    def state_dict(self):
        return {"pair": self.pair}

    def load_state_dict(self, state_dict) -> None:
        self.pair = state_dict["pair"]


def test_a_callback_holding_a_namedtuple_stops_fit_at_its_first_save(tmp_path):
    ckdir = tmp_path / "ck"
    t = trainer(tmp_path, 1, StatestreamCheckpointIO(),
                [Keeper(), ModelCheckpoint(dirpath=ckdir, save_last=True)])
    with pytest.raises(ss.UnsupportedTypeError, match="key path 'callbacks/Keeper/pair'"):
        t.fit(Net(), data())
    assert not ckdir.exists() or not list(ckdir.iterdir())


@PLUGINS
def test_with_pickle_they_are_pickled_and_come_back_as_they_were(tmp_path, plugin_cls):
    values = _values()
    shared = {"pair": values["namedtuple"]}
    ckpt = {"epoch": 0, "callbacks": {"Keeper": {**values, "twice": [shared, shared],
                                                 "gen": torch.Generator().manual_seed(1)}}}
    plugin = plugin_cls(pickle=True)
    plugin.save_checkpoint(ckpt, tmp_path / "p.ckpt")
    plugin.teardown()
    assert type(ckpt["callbacks"]["Keeper"]["twice"][0]["pair"]) is Pair  # left as it was
    kinds = {k: v.kind for k, v in ss.metadata(tmp_path / "p.ckpt").leaves()
             if isinstance(v, ss.ArrayMetadata)}
    assert {k for k, v in kinds.items() if v == "pickle"} == {
        "callbacks/Keeper/namedtuple", "callbacks/Keeper/dataclass", "callbacks/Keeper/stateful",
        "callbacks/Keeper/twice/0/pair", "callbacks/Keeper/twice/1/pair"}
    with pytest.raises(ss.PickleNotAllowedError):
        StatestreamCheckpointIO().load_checkpoint(tmp_path / "p.ckpt")
    got = StatestreamCheckpointIO(allow_pickle=["callbacks/Keeper"]).load_checkpoint(
        tmp_path / "p.ckpt")["callbacks"]["Keeper"]
    assert type(got["gen"]) is torch.Generator  # not pickled: rebuilt
    pair = got["namedtuple"]
    assert type(pair) is Pair and torch.equal(pair.a, torch.ones(2)) and pair.b == 3
    config = got["dataclass"]
    assert type(config) is Config and config.lr == 0.1 and torch.equal(config.w, torch.zeros(2))
    assert got["stateful"] == Counter(4)
    assert all(type(d["pair"]) is Pair for d in got["twice"])
