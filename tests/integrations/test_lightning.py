"""StatestreamCheckpointIO in real Lightning Trainers (CPU, tiny model, a few batches)."""

from __future__ import annotations

import collections
import logging
import math
import os
import shutil
import subprocess
import sys
import textwrap
import warnings

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


class Net(L.LightningModule):
    def __init__(self, lr: float = 0.05, seed: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(seed)
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(),
                                       torch.nn.Linear(8, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, on_epoch=True, on_step=False)
        self.log("epoch_score", float(self.current_epoch), on_epoch=True, on_step=False)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)]


def data() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(24, 6, generator=g)
    y = x.sum(dim=1, keepdim=True).sin()
    return DataLoader(TensorDataset(x, y), batch_size=6, shuffle=False)


def trainer(root, epochs: int, plugin, callbacks=()) -> L.Trainer:
    return L.Trainer(max_epochs=epochs, plugins=[plugin], callbacks=list(callbacks),
                     default_root_dir=str(root), enable_progress_bar=False, logger=False,
                     enable_model_summary=False, accelerator="cpu", devices=1)


class CountBatches(Callback):
    def __init__(self) -> None:
        self.n = 0

    def on_train_batch_end(self, *args) -> None:
        self.n += 1


def snapshot(t: L.Trainer) -> dict:
    return {"model": {k: v.clone() for k, v in t.lightning_module.state_dict().items()},
            "opt": t.optimizers[0].state_dict(), "sched": t.lr_scheduler_configs[0]
            .scheduler.state_dict(), "epoch": t.current_epoch, "step": t.global_step}


def assert_bitwise_equal(a, b, path="") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b), f"{path} differs"
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            assert_bitwise_equal(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bitwise_equal(x, y, f"{path}/{i}")
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), path
    else:
        assert type(a) is type(b) and a == b, f"{path}: {a!r} != {b!r}"


def ckpt_names(d) -> list[str]:
    return sorted(n for n in os.listdir(d) if not n.startswith("."))


@pytest.mark.parametrize("plugin_cls", [StatestreamCheckpointIO, AsyncStatestreamCheckpointIO],
                         ids=["sync", "async"])
def test_top_k_last_and_bitwise_resume(tmp_path, plugin_cls):
    # 4 uninterrupted epochs
    straight = trainer(tmp_path / "a", 4, plugin_cls())
    straight.fit(Net(), data())
    want = snapshot(straight)

    # 2 epochs, keeping the best 2 by an increasing score, and last.ckpt
    ckdir = tmp_path / "ck"
    top = ModelCheckpoint(dirpath=ckdir, monitor="epoch_score", mode="max", save_top_k=2,
                          save_last=True, filename="{epoch}")
    first = trainer(tmp_path / "b", 2, plugin_cls(), [top])
    first.fit(Net(), data())
    assert ckpt_names(ckdir) == ["epoch=0.ckpt", "epoch=1.ckpt", "last.ckpt"]
    for name in ckpt_names(ckdir):  # statestream checkpoints, committed, no pickle
        md = ss.metadata(ckdir / name)
        assert not [p for p, leaf in md.leaves()
                    if isinstance(leaf, ss.ArrayMetadata) and leaf.kind == "pickle"]
        assert md.tree["epoch"] == int(name[6]) if name != "last.ckpt" else 1

    # resume to 4 epochs from last.ckpt: top-k removes epoch 0 and 1 on the way
    top2 = ModelCheckpoint(dirpath=ckdir, monitor="epoch_score", mode="max", save_top_k=2,
                           save_last=True, filename="{epoch}")
    count = CountBatches()
    resumed = trainer(tmp_path / "c", 4, plugin_cls(), [top2, count])
    resumed.fit(Net(seed=5), data(), ckpt_path=str(ckdir / "last.ckpt"))
    assert count.n == 2 * 4  # it ran epochs 2 and 3 only
    assert ckpt_names(ckdir) == ["epoch=2.ckpt", "epoch=3.ckpt", "last.ckpt"]
    assert_bitwise_equal(want, snapshot(resumed))
    assert ss.load(ckdir / "last.ckpt", items=["epoch"]) == {"epoch": 3}

    # the resumed run's checkpoints equal a fresh load of the straight run's weights
    got = plugin_cls().load_checkpoint(ckdir / "last.ckpt")
    assert_bitwise_equal(want["model"], got["state_dict"])


def test_resume_from_last_by_name(tmp_path):
    ckdir = tmp_path / "ck"
    trainer(tmp_path, 1, StatestreamCheckpointIO(),
            [ModelCheckpoint(dirpath=ckdir, save_last=True)]).fit(Net(), data())
    t = trainer(tmp_path, 2, StatestreamCheckpointIO(),
                [ModelCheckpoint(dirpath=ckdir, save_last=True)])
    t.fit(Net(), data(), ckpt_path="last")  # Lightning finds last.ckpt (a directory) itself
    assert t.current_epoch == 2 and t.global_step == 8


class ValNet(Net):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))


def test_validate_reads_the_checkpoint_through_the_plugin(tmp_path):
    t = trainer(tmp_path, 1, StatestreamCheckpointIO(), [])
    t.fit(Net(), data())
    t.save_checkpoint(tmp_path / "one.ckpt")
    want = {k: v.clone() for k, v in t.lightning_module.state_dict().items()}
    model = ValNet(seed=3)
    v = trainer(tmp_path, 1, StatestreamCheckpointIO(), [])
    v.validate(model, data(), ckpt_path=str(tmp_path / "one.ckpt"), verbose=False)
    assert_bitwise_equal(want, dict(model.state_dict()))


class OddState(Callback):
    """A callback whose state has the odd keys and plain values Lightning lets through."""

    def __init__(self) -> None:
        self.state = {
            "a/b~c {'x': 1}": 1,
            "": "empty key",
            7: (1, 2.5, None, "t", True),
            "nan": float("nan"),
            "inf": [float("-inf"), float("inf")],
            "big": 2**70,
            "bytes": b"\x00\xff",
            "ordered": collections.OrderedDict([("z", 1), ("a", 2)]),
            "tensors": [torch.arange(3), torch.tensor(0.5, dtype=torch.bfloat16)],
            "nested": {"deeper": {"list": [[], {}, ()]}},
        }

    def state_dict(self):
        return self.state

    def load_state_dict(self, state_dict):
        self.loaded = state_dict


def test_lightning_checkpoint_dict_round_trips_without_pickle(tmp_path):
    odd = OddState()
    t = trainer(tmp_path, 1, StatestreamCheckpointIO(), [odd])
    t.fit(Net(), data())
    ckpt = t._checkpoint_connector.dump_checkpoint()
    assert any("{" in k for k in ckpt["callbacks"])  # ModelCheckpoint-like keys
    io = StatestreamCheckpointIO()
    io.save_checkpoint(ckpt, tmp_path / "x.ckpt")
    kinds = {leaf.kind for _, leaf in ss.metadata(tmp_path / "x.ckpt").leaves()
             if isinstance(leaf, ss.ArrayMetadata)}
    assert kinds == {"torch", "bytes"}
    got = io.load_checkpoint(tmp_path / "x.ckpt")
    assert_bitwise_equal(ckpt, got)

    # resuming hands the callback its state back as it was
    t2 = trainer(tmp_path, 2, StatestreamCheckpointIO(), [odd2 := OddState()])
    t2.fit(Net(), data(), ckpt_path=str(tmp_path / "x.ckpt"))
    assert_bitwise_equal(odd.state, odd2.loaded)


class Opaque:
    def __init__(self, v: int) -> None:
        self.v = v

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque) and other.v == self.v


def test_plain_objects_need_the_pickle_opt_in(tmp_path):
    ckpt = {"epoch": 0, "hyper_parameters": {"obj": Opaque(3), "s": {1, 2}}}
    # the hint names the plugin's option (pickle_paths, save()'s, is not the user's to pass)
    for plugin in (StatestreamCheckpointIO(), AsyncStatestreamCheckpointIO()):
        with pytest.raises(ss.UnsupportedTypeError, match="hyper_parameters/obj") as err:
            plugin.save_checkpoint(ckpt, tmp_path / "p.ckpt")
        plugin.teardown()
        assert f"build the plugin with {type(plugin).__name__}(pickle=True)" in str(err.value)
        assert "pickle_paths" not in str(err.value)
        assert not (tmp_path / "p.ckpt").exists()
    StatestreamCheckpointIO(pickle=True).save_checkpoint(ckpt, tmp_path / "p.ckpt")
    with pytest.raises(ss.PickleNotAllowedError):
        StatestreamCheckpointIO().load_checkpoint(tmp_path / "p.ckpt")
    got = StatestreamCheckpointIO(allow_pickle=True).load_checkpoint(tmp_path / "p.ckpt")
    assert got == ckpt


def test_allow_pickle_takes_trusted_key_paths(tmp_path):
    ckpt = {"epoch": 0, "hyper_parameters": {"obj": Opaque(3)}, "loops": {"s": {1, 2}}}
    StatestreamCheckpointIO(pickle=True).save_checkpoint(ckpt, tmp_path / "p.ckpt")
    both = StatestreamCheckpointIO(allow_pickle=["hyper_parameters", "loops/s"])
    assert both.load_checkpoint(tmp_path / "p.ckpt") == ckpt
    one = StatestreamCheckpointIO(allow_pickle=("hyper_parameters",))
    with pytest.raises(ss.PickleNotAllowedError, match="loops/s"):
        one.load_checkpoint(tmp_path / "p.ckpt")
    with pytest.raises(TypeError, match="allow_pickle"):
        StatestreamCheckpointIO(allow_pickle=[1])


def test_remove_load_and_errors(tmp_path):
    io = StatestreamCheckpointIO()
    with pytest.raises(TypeError, match="storage_options"):
        io.save_checkpoint({"a": 1}, tmp_path / "s.ckpt", storage_options={"x": 1})
    with pytest.raises(FileNotFoundError):
        io.load_checkpoint(tmp_path / "missing.ckpt")
    io.remove_checkpoint(tmp_path / "missing.ckpt")  # nothing there: fine
    torch.save({"a": 1}, tmp_path / "old.ckpt")  # a torch.save file is never touched
    with pytest.raises(ss.CheckpointExistsError):
        io.save_checkpoint({"a": 1}, tmp_path / "old.ckpt")
    io.remove_checkpoint(tmp_path / "old.ckpt")
    assert (tmp_path / "old.ckpt").is_file()
    io.save_checkpoint({"w": torch.ones(2)}, tmp_path / "n.ckpt")
    io.save_checkpoint({"w": torch.zeros(2)}, tmp_path / "n.ckpt")  # last.ckpt style rewrite
    assert torch.equal(io.load_checkpoint(tmp_path / "n.ckpt", map_location="cpu")["w"],
                       torch.zeros(2))
    io.remove_checkpoint(tmp_path / "n.ckpt")
    assert not (tmp_path / "n.ckpt").exists()


def test_async_waits_before_remove_and_reports_failures(tmp_path):
    io = AsyncStatestreamCheckpointIO()
    big = {"w": torch.randn(256, 1024)}
    io.save_checkpoint(big, tmp_path / "a.ckpt")
    big["w"].zero_()  # the snapshot was taken: mutating now changes nothing saved
    io.remove_checkpoint(tmp_path / "a.ckpt")  # waits for the save, then removes it
    assert not (tmp_path / "a.ckpt").exists()
    io.save_checkpoint({"w": torch.ones(3)}, tmp_path / "b.ckpt")
    assert torch.equal(io.load_checkpoint(tmp_path / "b.ckpt")["w"], torch.ones(3))
    (tmp_path / "c.ckpt").write_text("not a checkpoint")  # the commit will refuse to replace it
    try:
        io.save_checkpoint({"w": torch.ones(3)}, tmp_path / "c.ckpt")
    except ss.CheckpointExistsError:
        pass  # refused at once: also fine
    else:
        with pytest.raises(ss.CheckpointExistsError):
            io.teardown()
    io.teardown()  # reported once; nothing left in flight


def test_a_failed_save_does_not_replace_the_error_that_ended_fit(tmp_path):
    """Fit raised (epoch 2's first batch) while the save of epoch 1 was failing in the
    background: Lightning's teardown, run while it handles that error, waited for the
    save and raised its error, which replaced the training error (kept only as its
    ``__context__``). The training error is raised now, the failed save warned about."""
    from statestream.testing import faults

    class Boom(Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
            if trainer.current_epoch == 2:
                raise RuntimeError("training broke")

    def disk_gone() -> None:
        raise OSError("disk gone")

    faults.on("save.data_synced", disk_gone, nth=2)  # the save of epoch 1 fails
    try:
        t = trainer(tmp_path, 4, AsyncStatestreamCheckpointIO(),
                    [ModelCheckpoint(dirpath=tmp_path / "ck", save_top_k=-1), Boom()])
        with pytest.warns(RuntimeWarning, match=r"save failed \(.*disk gone.*ending with "
                                                r"RuntimeError"), \
                pytest.raises(RuntimeError, match="training broke"):
            t.fit(Net(), data())
    finally:
        faults.clear()


def _mapped_file(t) -> str | None:
    """The file whose mapping holds tensor ``t``'s first byte (None: anonymous memory)."""
    addr = t.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= addr < hi:
                return parts[5] if len(parts) > 5 else None
    return None


def test_optimizer_states_are_read_and_weights_mapped(tmp_path):
    # Lightning hands optimizer_states to optimizer.load_state_dict, which keeps the
    # tensors as its state: the next step writes every one, so they are read, not
    # mapped (a written page of a mapping is a fault and a copy). The weights are
    # copied into the module: mapped.
    big = torch.arange(512 * 1024, dtype=torch.float32).reshape(512, 1024)  # 2 MiB
    ckpt = {"epoch": 1, "state_dict": {"w": big.clone()},
            "optimizer_states": [{"state": {0: {"exp_avg": big * 2, "step": torch.tensor(3.0)}},
                                  "param_groups": [{"lr": 0.1, "params": [0]}]}],
            "a/b~c": 7}
    io = StatestreamCheckpointIO()
    path = tmp_path / "x.ckpt"
    io.save_checkpoint(ckpt, path)
    got = io.load_checkpoint(path)
    assert list(got) == list(ckpt)
    assert got["a/b~c"] == 7 and got["epoch"] == 1
    moment = got["optimizer_states"][0]["state"][0]["exp_avg"]
    assert torch.equal(moment, big * 2) and torch.equal(got["state_dict"]["w"], big)
    assert (_mapped_file(got["state_dict"]["w"]) or "").startswith(str(path))
    assert not (_mapped_file(moment) or "").startswith(str(path))


KILLED_REMOVAL = textwrap.dedent("""
    import sys
    import torch
    torch.set_num_threads({threads})
    sys.path.insert(0, {here!r})
    from lightning.pytorch.callbacks import ModelCheckpoint
    from test_lightning import Net, data, trainer
    from statestream.integrations.lightning import StatestreamCheckpointIO
    from statestream.testing import faults
    # top-k (2) saves epoch=2, then removes epoch=0: killed with its commit marker gone
    faults.kill_at("delete.uncommitted")
    top = ModelCheckpoint(dirpath={ckdir!r}, monitor="epoch_score", mode="max", save_top_k=2,
                          save_last=True, filename="{{epoch}}")
    trainer({root!r}, 3, StatestreamCheckpointIO(), [top]).fit(Net(), data())
""")


def test_a_removal_killed_part_way_is_finished_by_the_next(tmp_path, caplog):
    # Lightning's top-k removal killed after the commit marker went: the directory
    # (manifest and data) stayed, and the resumed run's removal of it logged "is not a
    # statestream checkpoint; left alone" and kept it (a checkpoint's size, forever);
    # a save to that path raised CheckpointExistsError.
    straight = trainer(tmp_path / "a", 4, StatestreamCheckpointIO())
    straight.fit(Net(), data())
    ckdir = tmp_path / "ck"
    code = KILLED_REMOVAL.format(here=os.path.dirname(__file__), ckdir=str(ckdir),
                                 root=str(tmp_path / "b"), threads=torch.get_num_threads())
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=200)
    assert proc.returncode == -9, proc.stderr[-3000:]
    assert ckpt_names(ckdir) == ["epoch=0.ckpt", "epoch=1.ckpt", "epoch=2.ckpt", "last.ckpt"]
    assert not (ckdir / "epoch=0.ckpt" / "COMMITTED").exists()
    assert ss.load(ckdir / "last.ckpt", items=["epoch"]) == {"epoch": 1}

    top = ModelCheckpoint(dirpath=ckdir, monitor="epoch_score", mode="max", save_top_k=2,
                          save_last=True, filename="{epoch}")
    resumed = trainer(tmp_path / "c", 4, StatestreamCheckpointIO(), [top])
    with caplog.at_level(logging.WARNING, logger="statestream"):
        resumed.fit(Net(seed=5), data(), ckpt_path="last")
    assert "left alone" not in caplog.text
    # epoch=2.ckpt is the killed run's (Lightning saves the resumed run's as epoch=2-v1)
    assert ckpt_names(ckdir) == ["epoch=2-v1.ckpt", "epoch=2.ckpt", "epoch=3.ckpt", "last.ckpt"]
    assert_bitwise_equal(snapshot(straight), snapshot(resumed))


def test_remains_of_a_killed_removal_are_replaced_but_nothing_else(tmp_path):
    io = StatestreamCheckpointIO()
    path = tmp_path / "x.ckpt"
    io.save_checkpoint({"w": torch.ones(3)}, path)
    (path / "COMMITTED").unlink()  # what a removal killed after its first step leaves
    io.save_checkpoint({"w": torch.zeros(3)}, path)  # raised CheckpointExistsError
    assert torch.equal(io.load_checkpoint(path)["w"], torch.zeros(3))
    (path / "COMMITTED").unlink()
    (path / "manifest.json").unlink()  # killed further on: data files only
    io.remove_checkpoint(path)
    assert not path.exists()
    for other in ({"manifest.json": b'{"a": 1}'}, {"manifest.json": b"x", "notes.txt": b"x"},
                  {"data/model.pt": b"x"}):  # not statestream's: left alone
        d = tmp_path / "other"
        for name, body in other.items():
            (d / name).parent.mkdir(parents=True, exist_ok=True)
            (d / name).write_bytes(body)
        io.remove_checkpoint(d)
        with pytest.raises(ss.CheckpointExistsError):
            io.save_checkpoint({"w": torch.ones(1)}, d)
        assert sorted(p.name for p in d.rglob("*") if p.is_file()) == sorted(
            os.path.basename(n) for n in other)
        shutil.rmtree(d)


# ----------------------------------------------------------------------------- on S3
KILLED_S3_REMOVAL = textwrap.dedent("""
    from statestream.integrations.lightning import StatestreamCheckpointIO
    from statestream.testing import faults
    faults.kill_at("delete.uncommitted")  # the commit marker is gone, the rest not yet
    StatestreamCheckpointIO().remove_checkpoint({url!r})
""")


@pytest.fixture(scope="module")
def s3():
    """moto's S3 server on loopback; the s3 backend points at it (also in a child
    process, through the AWS_* variables)."""
    moto_server = pytest.importorskip("moto.server")
    boto3 = pytest.importorskip("boto3")
    pytest.importorskip("obstore")
    from statestream.storage import S3Options, S3Storage, set_backend

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    srv = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    srv.start()
    host, port = srv.get_host_and_port()
    env = {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ALLOW_HTTP": "true",
           "AWS_REGION": "us-east-1", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing-secret"}
    client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing-secret")
    client.create_bucket(Bucket="lightning")
    set_backend("s3", S3Storage(S3Options(endpoint=env["AWS_ENDPOINT_URL"], region="us-east-1",
                                          access_key_id="testing",
                                          secret_access_key="testing-secret")))
    try:
        yield client, env
    finally:
        set_backend("s3", None)
        srv.stop()


def _keys(client, prefix):
    got = client.list_objects_v2(Bucket="lightning", Prefix=prefix + "/")
    return sorted(o["Key"][len(prefix) + 1:] for o in got.get("Contents", []))


def _kill_a_removal(client, env, url):
    """Remove ``url`` in a child killed once its commit marker is gone; then delete its
    manifest by hand (a kill inside the bulk delete leaves any part of the rest)."""
    proc = subprocess.run([sys.executable, "-c", KILLED_S3_REMOVAL.format(url=url)],
                          capture_output=True, text=True, timeout=200,
                          env={**os.environ, **env})
    assert proc.returncode == -9, proc.stderr[-3000:]
    key = url[len("s3://lightning/"):]
    manifest = next(k for k in _keys(client, key) if k.endswith("/manifest.json"))
    client.delete_object(Bucket="lightning", Key=f"{key}/{manifest}")
    left = _keys(client, key)
    assert "COMMITTED" not in left and any("/data/" in k for k in left), left


def test_a_removal_killed_part_way_on_s3_is_finished_by_the_next_or_a_save(s3, tmp_path):
    """On an object store the remains of a removal killed part-way (no commit marker,
    some of the data) were kept for good: the next removal saw no committed checkpoint
    and did nothing, and a save to the path committed beside them (garbage for gc)."""
    client, env = s3
    io = StatestreamCheckpointIO()
    base = f"s3://lightning/run-{os.getpid()}-{tmp_path.name}"
    for name in ("a.ckpt", "b.ckpt"):
        io.save_checkpoint({"w": torch.ones(64), "epoch": 1}, f"{base}/{name}")
        _kill_a_removal(client, env, f"{base}/{name}")
        # nothing reads what is left as a checkpoint
        with pytest.raises(ss.CheckpointNotFoundError):
            ss.load(f"{base}/{name}")
        with pytest.raises(FileNotFoundError):
            io.load_checkpoint(f"{base}/{name}")
    key = base[len("s3://lightning/"):]
    io.remove_checkpoint(f"{base}/a.ckpt")  # the next removal finishes the job
    assert _keys(client, f"{key}/a.ckpt") == []
    io.save_checkpoint({"w": torch.zeros(64), "epoch": 2}, f"{base}/b.ckpt")  # replaces it
    left = _keys(client, f"{key}/b.ckpt")
    roots = {k.split("/")[0] for k in left if k != "COMMITTED"}
    assert "COMMITTED" in left and len(roots) == 1 and "DELETING" not in left, left
    got = io.load_checkpoint(f"{base}/b.ckpt")
    assert torch.equal(got["w"], torch.zeros(64)) and got["epoch"] == 2


def test_on_s3_a_save_in_flight_is_no_remains(s3, tmp_path):
    """Objects under a path without a commit marker are also what a save in flight (or a
    killed one) writes: without a deletion's mark they are not removed or replaced."""
    from statestream.storage import storage_for

    client, _ = s3
    io = StatestreamCheckpointIO()
    url = f"s3://lightning/flight-{os.getpid()}-{tmp_path.name}/c.ckpt"
    storage, spath = storage_for(url)
    txn = storage.begin_write(spath, overwrite=True)
    txn.write_bytes("manifest.json", b"{}")  # a save that has not committed yet
    key = url[len("s3://lightning/"):]
    before = _keys(client, key)
    io.remove_checkpoint(url)
    assert _keys(client, key) == before != []
    txn.abort()


def test_a_last_link_is_replaced_by_a_checkpoint_and_its_target_kept(tmp_path):
    # save_last="link" makes last.ckpt a symbolic link to the newest top-k checkpoint.
    # A save to last.ckpt (a run resumed with save_last=True, or with "link" where the
    # first epoch after the resume is not in the top k) raised CheckpointExistsError
    # ("never replaces a link") and stopped training. Now the link is replaced by the
    # checkpoint, atomically, and what it pointed to is left as it was.
    ckdir = tmp_path / "ck"

    def top(save_last):
        return ModelCheckpoint(dirpath=ckdir, monitor="epoch_score", mode="max",
                               save_top_k=1, save_last=save_last, filename="{epoch}")

    trainer(tmp_path / "a", 2, StatestreamCheckpointIO(), [top("link")]).fit(Net(), data())
    assert os.readlink(ckdir / "last.ckpt") == "epoch=1.ckpt"
    resumed = trainer(tmp_path / "b", 3, StatestreamCheckpointIO(), [top(True)])
    resumed.fit(Net(), data(), ckpt_path="last")
    assert resumed.current_epoch == 3
    assert not os.path.islink(ckdir / "last.ckpt")
    assert ss.load(ckdir / "last.ckpt", items=["epoch"]) == {"epoch": 2}
    assert ckpt_names(ckdir) == ["epoch=2.ckpt", "last.ckpt"]
    assert sorted(os.listdir(ckdir)) == ckpt_names(ckdir)  # no hidden leftovers


@pytest.mark.parametrize("plugin_cls", [StatestreamCheckpointIO, AsyncStatestreamCheckpointIO],
                         ids=["sync", "async"])
def test_saving_to_a_link_leaves_its_target_alone(tmp_path, plugin_cls):
    io = plugin_cls()
    io.save_checkpoint({"w": torch.ones(3)}, tmp_path / "a.ckpt")
    io.wait()
    os.symlink("a.ckpt", tmp_path / "last.ckpt")
    io.save_checkpoint({"w": torch.zeros(3)}, tmp_path / "last.ckpt")
    assert torch.equal(io.load_checkpoint(tmp_path / "last.ckpt")["w"], torch.zeros(3))
    assert not os.path.islink(tmp_path / "last.ckpt")
    assert torch.equal(io.load_checkpoint(tmp_path / "a.ckpt")["w"], torch.ones(3))
    io.save_checkpoint({"w": torch.ones(2)}, tmp_path / "b.ckpt")
    io.wait()
    (tmp_path / "b.ckpt" / "COMMITTED").unlink()  # a removal of it killed part-way
    os.symlink("b.ckpt", tmp_path / "half.ckpt")
    io.save_checkpoint({"w": torch.zeros(2)}, tmp_path / "half.ckpt")
    io.wait()
    assert torch.equal(io.load_checkpoint(tmp_path / "half.ckpt")["w"], torch.zeros(2))
    assert (tmp_path / "b.ckpt" / "manifest.json").exists()  # left to its own removal
    os.symlink("gone.ckpt", tmp_path / "dangling.ckpt")  # a link to nothing is replaced too
    io.save_checkpoint({"w": torch.ones(1)}, tmp_path / "dangling.ckpt")
    io.teardown()
    assert torch.equal(io.load_checkpoint(tmp_path / "dangling.ckpt")["w"], torch.ones(1))
    torch.save({"a": 1}, tmp_path / "old.pt")  # a link to something else is still refused
    os.symlink("old.pt", tmp_path / "other.ckpt")
    with pytest.raises(ss.CheckpointExistsError):
        io.save_checkpoint({"w": torch.ones(1)}, tmp_path / "other.ckpt")
        io.teardown()
    assert sorted(os.listdir(tmp_path)) == ["a.ckpt", "b.ckpt", "dangling.ckpt", "half.ckpt",
                                            "last.ckpt", "old.pt", "other.ckpt"]


def test_a_link_replaced_during_a_background_save_to_it_is_kept(tmp_path):
    # save_last="link": a background save to the last.ckpt link, then Lightning links
    # last.ckpt to a newer checkpoint itself (no plugin call) before that save is put
    # in place: the newer link stays, the older save is dropped.
    io = AsyncStatestreamCheckpointIO()
    for name in ("a.ckpt", "b.ckpt"):
        io.save_checkpoint({"w": torch.ones(3)}, tmp_path / name)
    io.wait()
    os.symlink("a.ckpt", tmp_path / "last.ckpt")
    io.save_checkpoint({"w": torch.zeros(3)}, tmp_path / "last.ckpt")
    os.remove(tmp_path / "last.ckpt")  # as ModelCheckpoint._link_checkpoint
    os.symlink("b.ckpt", tmp_path / "last.ckpt")
    io.teardown()
    assert os.readlink(tmp_path / "last.ckpt") == "b.ckpt"
    assert sorted(os.listdir(tmp_path)) == ["a.ckpt", "b.ckpt", "last.ckpt"]


def test_what_a_killed_link_replacement_left_goes_with_the_next_save(tmp_path):
    # A save replacing a last.ckpt link is written to .last.ckpt.relink first; killed
    # after its commit and before the swap, that checkpoint stayed there for good.
    io = StatestreamCheckpointIO()
    io.save_checkpoint({"w": torch.ones(3)}, tmp_path / ".last.ckpt.relink")  # the remains
    os.symlink("nowhere", tmp_path / ".x.ckpt.relink")  # killed mid-swap: the old link
    io.save_checkpoint({"w": torch.zeros(3)}, tmp_path / "last.ckpt")
    io.save_checkpoint({"w": torch.zeros(3)}, tmp_path / "x.ckpt")
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt", "x.ckpt"]

