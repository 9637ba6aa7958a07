"""StatestreamTrainer in real transformers Trainers (CPU, a tiny GPT-2, a few steps)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

import statestream as ss  # noqa: E402
from statestream.integrations.transformers import (  # noqa: E402
    StatestreamCheckpointing,
    StatestreamTrainer,
    is_statestream_checkpoint,
)
from statestream.testing import faults  # noqa: E402

pytestmark = pytest.mark.timeout(240)

CONFIG = dict(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
              bos_token_id=0, eos_token_id=0)


class Tokens(torch.utils.data.Dataset):
    """40 fixed random sequences: 10 steps of 4 per epoch."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, 64, (12,), generator=g)
        return {"input_ids": ids, "labels": ids}


class StopAt(TrainerCallback):
    """Stop training after step ``n`` (an interrupted run, without a crash)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.n:
            control.should_training_stop = True


def make(cls, out, *, seed=0, callbacks=(), eval_data=None, args=None, **kw):
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(**CONFIG))  # dropout on: resumes need the RNG
    targs = dict(output_dir=str(out), num_train_epochs=2, save_steps=3,
                 per_device_train_batch_size=4, report_to=[], logging_steps=100,
                 use_cpu=True, disable_tqdm=True, seed=0, save_total_limit=2)
    targs.update(args or {})
    trainer = cls(model=model, args=TrainingArguments(**targs), train_dataset=Tokens(),
                  eval_dataset=eval_data, callbacks=list(callbacks), **kw)
    return model, trainer


def weights(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """20 steps (two epochs) with transformers' own Trainer, without a break."""
    model, trainer = make(Trainer, tmp_path_factory.mktemp("ref"),
                          args={"save_strategy": "no"})
    trainer.train()
    return weights(model)


MODES = {"async": {}, "sync": {"async_save": False}, "lazy": {"lazy": True}}


@pytest.mark.parametrize("mode", list(MODES))
def test_interrupted_run_resumes_bitwise(tmp_path, reference, mode):
    # 13 steps (into the second epoch; checkpoints at 3, 6, 9, 12, two kept), then a
    # fresh model with other weights resumes from the newest: equal to the reference.
    # Lazy: each checkpoint step returns before the snapshot, and the next optimizer
    # step waits for what it changes (a torn snapshot would fail the save).
    _, trainer = make(StatestreamTrainer, tmp_path, callbacks=[StopAt(13)], **MODES[mode])
    trainer.train()
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-12", "checkpoint-9"]
    ck = tmp_path / "checkpoint-12"
    assert sorted(os.listdir(ck)) == ["statestream", "trainer_state.json"]
    assert is_statestream_checkpoint(ck)
    assert json.loads((ck / "trainer_state.json").read_text())["global_step"] == 12
    tree = ss.metadata(ck / "statestream").tree
    assert sorted(tree) == ["model", "optimizer", "rng", "scheduler"]
    assert list(tree["rng"]) == ["rank0"]
    # GPT-2's lm_head is its input embedding: stored once
    assert "lm_head.weight" in tree["model"] and ss.verify(ck / "statestream").ok

    model, trainer = make(StatestreamTrainer, tmp_path, seed=1, **MODES[mode])
    trainer.train(resume_from_checkpoint=True)
    assert trainer.state.global_step == 20
    assert_same(weights(model), reference)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-18", "checkpoint-20"]


def test_resumes_from_the_trainers_own_checkpoints(tmp_path, reference):
    # checkpoints written by transformers.Trainer are read as before; the next ones
    # are statestream's
    _, trainer = make(Trainer, tmp_path, callbacks=[StopAt(13)])
    trainer.train()
    assert "optimizer.pt" in os.listdir(tmp_path / "checkpoint-12")
    model, trainer = make(StatestreamTrainer, tmp_path, seed=1)
    trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-12"))
    assert_same(weights(model), reference)
    assert is_statestream_checkpoint(tmp_path / "checkpoint-20")


def test_a_mixin_for_trainer_subclasses(tmp_path, reference):
    class Custom(Trainer):
        def compute_loss(self, model, inputs, **kwargs):
            return super().compute_loss(model, inputs, **kwargs)

    class Mine(StatestreamCheckpointing, Custom):
        pass

    _, trainer = make(Mine, tmp_path, callbacks=[StopAt(7)], async_save=False)
    trainer.train()
    assert is_statestream_checkpoint(tmp_path / "checkpoint-6")
    model, trainer = make(Mine, tmp_path, seed=1)
    trainer.train(resume_from_checkpoint=True)
    assert_same(weights(model), reference)


CRASH = textwrap.dedent("""
    import os, sys
    import torch
    torch.set_num_threads({threads})  # as the reference's process: the same sums
    sys.path.insert(0, {here!r})
    from test_transformers import StopAt, make
    from statestream.integrations.transformers import StatestreamTrainer
    from statestream.testing import faults
    # killed in the second save, after statestream committed, before the rename
    faults.kill_at({point!r}, nth=2)
    _, trainer = make(StatestreamTrainer, {out!r}, callbacks=[StopAt(13)])
    trainer.train()
""")


@pytest.mark.parametrize("point", ["save.data_synced", "commit.renamed"])
def test_a_crash_mid_save_is_never_resumed_from(tmp_path, reference, point):
    out = tmp_path / "out"
    code = CRASH.format(here=os.path.dirname(__file__), point=point, out=str(out),
                        threads=torch.get_num_threads())
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=200)
    assert proc.returncode == -9, proc.stderr[-3000:]
    # the checkpoint of step 6 never came into place; resume takes step 3's
    assert sorted(os.listdir(out)) == [".checkpoint-6.partial", "checkpoint-3"]
    model, trainer = make(StatestreamTrainer, out, seed=1)
    trainer.train(resume_from_checkpoint=True)
    assert_same(weights(model), reference)
    assert ".checkpoint-6.partial" not in os.listdir(out)  # the next save removed it


def test_a_background_failure_is_raised_and_leaves_nothing(tmp_path):
    # the second checkpoint fails in the background: train() raises it at its end (or
    # at the next save) and no checkpoint-6 appears, nor its partial directory
    def fail():
        raise OSError(28, "No space left on device (injected)")

    faults.on("save.planned", fail, nth=2)
    try:
        _, trainer = make(StatestreamTrainer, tmp_path, callbacks=[StopAt(7)])
        with pytest.raises(OSError, match="injected"):
            trainer.train()
    finally:
        faults.clear()
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-3"]


def test_best_model_at_end_and_save_only_model(tmp_path):
    class Evals(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 8

        def __getitem__(self, i: int) -> dict:
            return Tokens()[i]

    model, trainer = make(
        StatestreamTrainer, tmp_path, eval_data=Evals(),
        args={"eval_strategy": "steps", "eval_steps": 3, "load_best_model_at_end": True,
              "metric_for_best_model": "loss", "save_only_model": True,
              "save_total_limit": 1})
    trainer.train()
    best = trainer.state.best_model_checkpoint
    assert best is not None and is_statestream_checkpoint(best)
    assert sorted(ss.metadata(os.path.join(best, "statestream")).tree) == ["model"]
    saved = ss.load(os.path.join(best, "statestream"), items=["model"])["model"]
    for k, v in model.state_dict().items():  # the best checkpoint's weights came back
        assert torch.equal(v, torch.as_tensor(saved[k])), k


def test_deepspeed_or_fsdp_is_refused(tmp_path):
    _, trainer = make(StatestreamTrainer, tmp_path)
    trainer.is_fsdp_enabled = True
    with pytest.raises(ss.CheckpointError, match="FSDP"):
        trainer._save_checkpoint(trainer.model, None)
    assert os.listdir(tmp_path) == []


def test_option_types_are_checked(tmp_path):
    with pytest.raises(ss.InvalidOptionTypeError, match="async_save"):
        make(StatestreamTrainer, tmp_path, async_save="yes")
    with pytest.raises(ss.InvalidOptionTypeError, match="lazy=True needs async_save"):
        make(StatestreamTrainer, tmp_path, lazy=True, async_save=False)


def test_saving_a_step_again_replaces_it_and_leftovers_go(tmp_path):
    _, trainer = make(StatestreamTrainer, tmp_path, callbacks=[StopAt(6)], async_save=False,
                      args={"save_total_limit": None})
    trainer.train()
    (tmp_path / ".checkpoint-2.old").mkdir()  # what a crash between two renames leaves
    with torch.no_grad():
        trainer.model.lm_head.weight.add_(1.0)  # tied: the embedding too
    trainer._save_checkpoint(trainer.model, None)  # step 6 again
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-3", "checkpoint-6"]
    saved = ss.load(tmp_path / "checkpoint-6" / "statestream", items=["model"])["model"]
    assert torch.equal(torch.as_tensor(saved["lm_head.weight"]),
                       trainer.model.lm_head.weight.detach())


RESAVE_KILLED = textwrap.dedent("""
    import os, signal, sys
    import torch
    sys.path.insert(0, {here!r})
    from test_transformers import StopAt, make
    import statestream.integrations.transformers as integration
    from statestream.integrations.transformers import StatestreamTrainer
    _, trainer = make(StatestreamTrainer, {out!r}, callbacks=[StopAt(6)], async_save=False,
                      args={{"save_total_limit": None}})
    trainer.train()
    if {two_renames!r}:  # a file system without renameat2
        integration.exchange_paths = lambda a, b: False
    real = os.rename
    def rename(src, dst):
        real(src, dst)
        if dst.endswith(".old"):  # the old checkpoint moved aside, the new one not in
            os.kill(os.getpid(), signal.SIGKILL)
    integration.os.rename = rename
    with torch.no_grad():
        trainer.model.lm_head.weight.add_(1.0)
    trainer._save_checkpoint(trainer.model, None)  # step 6 again
    print("saved")
""")


class StepAtBegin(TrainerCallback):
    def on_train_begin(self, args, state, control, **kwargs):
        self.step = state.global_step


@pytest.mark.parametrize("two_renames", [False, True], ids=["renameat2", "two renames"])
def test_a_step_saved_again_and_killed_while_replacing_keeps_a_checkpoint(
        tmp_path, reference, two_renames):
    # Saving a step again moved the old checkpoint aside, then renamed the new one in;
    # killed between the two, no checkpoint-6 was in place: the resume took step 3 and
    # the next save deleted both complete copies. Now one atomic swap (renameat2), and
    # without it the old one is put back before transformers looks for the last one.
    out = tmp_path / "out"
    code = RESAVE_KILLED.format(here=os.path.dirname(__file__), out=str(out),
                                two_renames=two_renames)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=200)
    if two_renames:
        assert proc.returncode == -9, proc.stderr[-3000:]
        assert "checkpoint-6" not in os.listdir(out) and ".checkpoint-6.old" in os.listdir(out)
    else:  # no window: the swap is one rename(2)
        assert proc.returncode == 0 and "saved" in proc.stdout, proc.stderr[-3000:]
    begin = StepAtBegin()
    model, trainer = make(StatestreamTrainer, out, seed=1, callbacks=[begin])
    trainer.train(resume_from_checkpoint=True)
    assert begin.step == 6  # resumed from step 6, not step 3
    assert not [n for n in os.listdir(out) if n.endswith((".old", ".partial"))]
    if two_renames:  # the old checkpoint of step 6: training from it ends as the reference
        assert_same(weights(model), reference)


def test_a_new_run_beside_higher_steps_keeps_its_own_checkpoints(tmp_path):
    # save_total_limit rotated by step number: a run started again in an output_dir
    # holding an earlier run's checkpoints at higher steps (or resumed from an older
    # checkpoint) deleted each checkpoint it had just written, as the lowest step,
    # leaving nothing of its own to resume from. transformers' Trainer rotates by
    # modification time (the newest is kept); now so does this one.
    _, trainer = make(StatestreamTrainer, tmp_path, callbacks=[StopAt(6)], async_save=False)
    trainer.train()
    long_ago = os.path.getmtime(tmp_path / "checkpoint-6") - 3600
    for old, new in (("checkpoint-3", "checkpoint-300"), ("checkpoint-6", "checkpoint-600")):
        os.rename(tmp_path / old, tmp_path / new)
        os.utime(tmp_path / new, (long_ago, long_ago))
    _, trainer = make(StatestreamTrainer, tmp_path, callbacks=[StopAt(4)], async_save=False)
    trainer.train()
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-3", "checkpoint-600"]
    assert is_statestream_checkpoint(tmp_path / "checkpoint-3")
