"""Hugging Face ``transformers.Trainer``: its checkpoints written by statestream.

:class:`StatestreamTrainer` is a ``transformers.Trainer`` whose checkpoints (every
``save_steps`` / epoch / best-metric save: ``checkpoint-<step>/`` under
``output_dir``) are statestream checkpoints, written in the background by
default; :class:`StatestreamCheckpointing` is the same as a mixin for your own
Trainer subclasses (``class MyTrainer(StatestreamCheckpointing, SomeTrainer)``).
``trainer.train(resume_from_checkpoint=True)`` (or a path) resumes from them through
transformers' own resume logic, and ``load_best_model_at_end`` reads them.

A ``checkpoint-<step>/`` directory holds:

- ``statestream/``: one statestream checkpoint with ``model`` (the unwrapped
  model's ``state_dict``; tied weights stored once), ``optimizer``,
  ``scheduler``, ``scaler`` (with mixed precision) and ``rng/rank<i>`` (each
  process's Python, NumPy, torch CPU and CUDA generator states): per-chunk
  checksums, no pickle, committed atomically;
- ``trainer_state.json``: transformers' own ``TrainerState``, which its resume logic
  (global step, epochs, batches to skip, callbacks' states) reads unchanged.

The directory is built as ``.checkpoint-<step>.partial/`` and renamed into place only
once statestream has committed, so ``resume_from_checkpoint=True`` (transformers takes
the highest ``checkpoint-<step>``) never picks a checkpoint a crash interrupted; with
the Trainer's own saving it can, because those files are written one after another
into ``checkpoint-<step>/`` itself. A ``.partial`` directory a crash left behind is
removed by the next save.

With ``async_save=True`` (the default) a checkpoint step returns once the state is
copied to host memory (``statestream.save_async``); the write, the commit and the
rename finish in the background. The next checkpoint, the end of ``train()`` and
:meth:`StatestreamCheckpointing.wait_for_checkpoint` wait for it, and an error from
the background is raised there. ``save_total_limit`` deletes old checkpoints after
the new one is in place. Checkpoints the Trainer itself wrote (``model.safetensors``,
``optimizer.pt``, ...) are still read on resume. ``trainer.save_model()`` is
unchanged (a ``from_pretrained`` directory); ``statestream.convert(
"<checkpoint>/statestream", out, to="safetensors", items=["model"])`` exports the
weights of any checkpoint as safetensors shards.

Under ``torch.distributed`` every process takes part in each save (a collective,
as transformers calls the save on every rank); process 0 writes
``trainer_state.json`` and renames. DeepSpeed and FSDP keep their own checkpoint
formats: with either enabled, saving raises :class:`~statestream.CheckpointError`.
Checkpoints are not pushed to the Hub (``hub_strategy`` other than ``"end"`` logs a
warning); ``trainer.push_to_hub()`` pushes the model as before.

Written against the Trainer of transformers 5 (tested with 5.24.0), whose private
checkpoint methods (``_save_checkpoint``, ``_load_optimizer_and_scheduler``, ...) it
overrides.

Example::

    from transformers import TrainingArguments
    from statestream.integrations.transformers import StatestreamTrainer

    args = TrainingArguments(output_dir="out", save_steps=500, save_total_limit=3)
    trainer = StatestreamTrainer(model=model, args=args, train_dataset=data)
    trainer.train(resume_from_checkpoint=True)   # the newest checkpoint, if any
"""

from __future__ import annotations

import logging
import os
import random
import re
import shutil
import threading
from typing import Any

import numpy as np
import torch
from transformers import Trainer
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

import statestream as ss
from statestream.errors import CheckpointError, InvalidOptionTypeError
from statestream.storage import storage_for
from statestream.storage._local import exchange_paths, fsync_dir

__all__ = ["StatestreamCheckpointing", "StatestreamTrainer", "is_statestream_checkpoint"]

log = logging.getLogger(__name__)

#: The statestream checkpoint inside ``checkpoint-<step>/``.
STATE_DIR = "statestream"
#: what an interrupted save leaves: the new directory, or the old one it replaced
_PARTIAL = re.compile(r"^\." + PREFIX_CHECKPOINT_DIR + r"-(\d+)\.(partial|old)$")


def is_statestream_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a ``checkpoint-<step>/`` directory this integration wrote."""
    inner = os.path.join(os.fspath(path), STATE_DIR)
    if not os.path.isdir(inner):
        return False
    storage, where = storage_for(inner)
    return storage.is_committed(where)


def restore_replaced(run_dir: str) -> list[str]:
    """Put ``checkpoint-<step>`` back from ``.checkpoint-<step>.old`` where a save of
    that step again was killed after moving the old one aside and before renaming the
    new one in (a file system without renameat2: two renames), so no checkpoint of the
    step was in place; the paths restored. The new one never completed: the old one is
    the step's checkpoint."""
    try:
        entries = sorted(os.listdir(run_dir))
    except (FileNotFoundError, NotADirectoryError):
        return []
    restored = []
    for entry in entries:
        m = _PARTIAL.match(entry)
        if m is None or m[2] != "old":
            continue
        old = os.path.join(run_dir, entry)
        final = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{m[1]}")
        if os.path.lexists(final) or not is_statestream_checkpoint(old):
            continue
        os.rename(old, final)
        fsync_dir(run_dir)
        log.warning("statestream: restored %s from %s: a save of the same step again was "
                    "killed while replacing it", final, old)
        restored.append(final)
    return restored


def _rng_state() -> dict[str, Any]:
    """This process's generator states (transformers' own ``rng_state.pth`` holds the same)."""
    version, internal, gauss = random.getstate()
    out: dict[str, Any] = {
        "python": {"version": version, "state": np.asarray(internal, dtype=np.uint64),
                   "gauss": gauss},
        "numpy": dict(zip(("kind", "keys", "pos", "has_gauss", "cached_gaussian"),
                          np.random.get_state())),
        "cpu": torch.random.get_rng_state(),
    }
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.random.get_rng_state_all()
    return out


def _set_rng_state(st: dict[str, Any]) -> None:
    py = st["python"]
    random.setstate((int(py["version"]), tuple(int(x) for x in py["state"]), py["gauss"]))
    n = st["numpy"]
    np.random.set_state((n["kind"], np.asarray(n["keys"], dtype=np.uint32), int(n["pos"]),
                         int(n["has_gauss"]), float(n["cached_gaussian"])))
    torch.random.set_rng_state(torch.as_tensor(np.asarray(st["cpu"])))
    cuda = st.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        states = [torch.as_tensor(np.asarray(s)) for s in cuda]
        if len(states) == torch.cuda.device_count():
            torch.cuda.random.set_rng_state_all(states)
        else:
            log.warning("the checkpoint holds CUDA generator states of %d devices, this process "
                        "sees %d: CUDA generators not restored", len(states),
                        torch.cuda.device_count())


class _Pending:
    """A background save and what finishes it: the rename into place, the rotation."""

    def __init__(self, handle: ss.SaveHandle, finish: Any) -> None:
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(handle, finish),
                                        name="statestream-hf-checkpoint")
        self._thread.start()

    def _run(self, handle: ss.SaveHandle, finish: Any) -> None:
        try:
            handle.result()
            finish(True)
        except BaseException as exc:  # reported to the training thread by wait()
            self.error = exc
            try:
                finish(False)
            except BaseException:
                log.exception("statestream: cleaning up after a failed checkpoint failed")

    def wait(self) -> BaseException | None:
        self._thread.join()
        return self.error


class StatestreamCheckpointing:
    """Mixin for ``transformers.Trainer`` (and subclasses): checkpoints through statestream.

    Put it before the Trainer class: ``class MyTrainer(StatestreamCheckpointing, Trainer)``.
    The keyword arguments below are taken by the mixin; the rest go to the Trainer.

    Args:
        async_save: write checkpoints in the background (``statestream.save_async``);
            ``False`` saves synchronously.
        lazy: take the snapshot in the background too (``save_async(lazy=True)``):
            the checkpoint step returns at once, and the next ``optimizer.step()``
            (or a forward pass that changes buffers) waits only for the tensors it
            changes that are not copied yet.
        io: :class:`statestream.IOOptions` of every save and load.
        memory: :class:`statestream.MemoryOptions` (the host staging budget).
        compression: as :func:`statestream.save` takes it (``None``: raw).
    """

    def __init__(self, *args: Any, async_save: bool = True, lazy: bool = False,
                 io: ss.IOOptions | None = None, memory: ss.MemoryOptions | None = None,
                 compression: Any = None, **kwargs: Any) -> None:
        for name, value in (("async_save", async_save), ("lazy", lazy)):
            if not isinstance(value, bool):
                raise InvalidOptionTypeError(f"{name} takes True or False, not {value!r}")
        if lazy and not async_save:
            raise InvalidOptionTypeError("lazy=True needs async_save=True (a lazy snapshot "
                                         "is taken in the background)")
        self._ss_async = async_save
        self._ss_lazy = lazy
        self._ss_io = io
        self._ss_memory = memory
        self._ss_compression = compression
        self._ss_pending: _Pending | None = None
        self._ss_hub_warned = False
        super().__init__(*args, **kwargs)

    # -- saving ---------------------------------------------------------------------------
    def wait_for_checkpoint(self) -> None:
        """Wait for a checkpoint still being written in the background; raise its error."""
        pending, self._ss_pending = self._ss_pending, None
        if pending is not None:
            err = pending.wait()
            if err is not None:
                raise err

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``; returns once the last checkpoint is in place."""
        t: Any = self
        if t.args.should_save:  # before transformers looks for the last checkpoint
            restore_replaced(t.args.output_dir)
        t.accelerator.wait_for_everyone()
        try:
            out = super().train(*args, **kwargs)  # type: ignore[misc]
        except BaseException:
            pending, self._ss_pending = self._ss_pending, None
            if pending is not None and (err := pending.wait()) is not None:
                log.error("statestream: a checkpoint failed too: %s", err)
            raise
        self.wait_for_checkpoint()
        return out

    def _finalize_training(self, *args: Any, **kwargs: Any) -> Any:
        # The last checkpoint is in place before transformers looks for the best one,
        # deletes surplus ones and calls on_train_end.
        self.wait_for_checkpoint()
        return super()._finalize_training(*args, **kwargs)  # type: ignore[misc]

    def _save_checkpoint(self, model: Any, trial: Any, *_more: Any, **_named: Any) -> None:
        t: Any = self  # the Trainer this is mixed into
        if t.is_deepspeed_enabled or t.is_fsdp_enabled:
            raise CheckpointError(
                "statestream's Trainer checkpoints do not cover DeepSpeed or FSDP, which keep "
                "their own checkpoint formats: use transformers.Trainer for those")
        self.wait_for_checkpoint()  # one save at a time; a background failure surfaces here
        args = t.args
        if args.push_to_hub and args.hub_strategy != "end" and not self._ss_hub_warned:
            self._ss_hub_warned = True
            log.warning("statestream: checkpoints are not pushed to the Hub "
                        "(hub_strategy=%r); trainer.push_to_hub() pushes the model",
                        str(args.hub_strategy))
        step = t.state.global_step
        name = f"{PREFIX_CHECKPOINT_DIR}-{step}"
        if t.hp_search_backend is None and trial is None:
            t.store_flos()
        run_dir = t._get_output_dir(trial=trial)
        partial = self._begin_checkpoint(run_dir, name, step)
        target = os.path.join(partial, STATE_DIR)
        state = self._checkpoint_state()

        def finish(ok: bool) -> None:
            if args.should_save:
                self._finish_checkpoint(ok, run_dir, name, partial)

        opts: dict[str, Any] = {"io": self._ss_io, "memory": self._ss_memory,
                                "compression": self._ss_compression}
        if not self._ss_async:
            try:
                ss.save(target, state, **opts)
            except BaseException:
                finish(False)
                raise
            finish(True)
            return
        try:
            handle = ss.save_async(target, state, lazy=self._ss_lazy, **opts)
        except BaseException:
            finish(False)
            raise
        if self._ss_lazy:
            # The next optimizer step (and a forward pass that changes buffers) waits
            # for the snapshot of what it changes; the Trainer's own optimizer wraps a
            # torch one, whose steps are what change the state.
            opt = getattr(t.optimizer, "optimizer", t.optimizer)
            if opt is not None and not args.save_only_model:
                ss.guard_optimizer(opt, handle)
            ss.guard_module(t.accelerator.unwrap_model(t.model), handle)
        self._ss_pending = _Pending(handle, finish)

    def _begin_checkpoint(self, run_dir: str, name: str, step: int) -> str:
        """Make ``.<name>.partial/`` with the Trainer's state in it (process 0); its path."""
        t: Any = self
        partial = os.path.join(run_dir, f".{name}.partial")
        self._note_best(run_dir, step)
        if not t.args.should_save:
            return partial
        os.makedirs(run_dir, exist_ok=True)
        self._remove_partials(run_dir, keep=partial)
        if os.path.lexists(partial):
            shutil.rmtree(partial)
        os.makedirs(partial)
        for cb in [*t.callback_handler.callbacks, t.control]:  # as Trainer._save_checkpoint
            if isinstance(cb, ExportableState):
                cb_name = type(cb).__name__
                if isinstance(t.state.stateful_callbacks[cb_name], list):
                    t.state.stateful_callbacks[cb_name].append(cb.state())
                else:
                    t.state.stateful_callbacks[cb_name] = cb.state()
        state_file = os.path.join(partial, TRAINER_STATE_NAME)
        t.state.save_to_json(state_file)
        with open(state_file, "rb+") as f:
            os.fsync(f.fileno())
        return partial

    def _finish_checkpoint(self, ok: bool, run_dir: str, name: str, partial: str) -> None:
        """After the save (process 0): rename ``partial`` into place and rotate, or
        remove it."""
        t: Any = self
        if not ok:
            shutil.rmtree(partial, ignore_errors=True)
            return
        fsync_dir(partial)
        final = os.path.join(run_dir, name)
        if os.path.lexists(final):  # the same step saved again: the new one wins
            if exchange_paths(partial, final):  # one atomic swap
                fsync_dir(run_dir)
                shutil.rmtree(partial, ignore_errors=True)  # the old one now
            else:  # a kill between the renames: restore_replaced puts the old one back
                old = os.path.join(run_dir, f".{name}.old")
                shutil.rmtree(old, ignore_errors=True)
                os.rename(final, old)
                os.rename(partial, final)
                fsync_dir(run_dir)
                shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(partial, final)
            fsync_dir(run_dir)
        # By modification time, as Trainer._save_checkpoint: the newest is kept even
        # where an earlier run left checkpoints at higher steps.
        rotate_checkpoints(output_dir=run_dir, save_total_limit=t.args.save_total_limit,
                           best_model_checkpoint=t.state.best_model_checkpoint,
                           use_mtime=True)

    def _checkpoint_state(self) -> dict[str, Any]:
        t: Any = self
        state: dict[str, Any] = {"model": t.accelerator.unwrap_model(t.model)}
        if not t.args.save_only_model:
            state["optimizer"] = t.optimizer
            state["scheduler"] = t.lr_scheduler
            scaler = getattr(t.accelerator, "scaler", None)
            if scaler is not None:
                state["scaler"] = scaler
            state["rng"] = {f"rank{t.args.process_index}": _rng_state()}
        return state

    def _note_best(self, run_dir: str, step: int) -> None:
        # As Trainer._save_checkpoint: remember the best step's directory. The one being
        # saved now counts although it is renamed into place only after its commit.
        t: Any = self
        best = getattr(t.state, "best_global_step", None)
        if t.args.save_strategy in ("steps", "epoch", "best") and best:
            best_dir = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{best}")
            if best == step or os.path.exists(best_dir):
                t.state.best_model_checkpoint = best_dir

    @staticmethod
    def _remove_partials(run_dir: str, keep: str) -> None:
        """Remove ``.checkpoint-<step>.partial`` (and ``.old``) directories that earlier
        saves left (a crash), after putting back a replaced checkpoint no new one took
        the place of (:func:`restore_replaced`)."""
        restore_replaced(run_dir)
        for entry in os.listdir(run_dir):
            path = os.path.join(run_dir, entry)
            if _PARTIAL.match(entry) and path != keep:
                log.warning("statestream: removing %s, a checkpoint that was never completed", path)
                shutil.rmtree(path, ignore_errors=True)

    # -- loading --------------------------------------------------------------------------
    def _ss_load(self, checkpoint: str, target: Any, items: list[str],
                 in_place: bool = False) -> Any:
        return ss.load(os.path.join(checkpoint, STATE_DIR), target, items=items,
                       in_place=in_place, io=self._ss_io, memory=self._ss_memory)

    def _ss_load_model(self, checkpoint: str, model: Any) -> None:
        # Straight into the model's own tensors (no second copy of the weights). A
        # corrupt chunk fails the load part-way; training does not start then, and any
        # later load overwrites every weight.
        self._ss_load(checkpoint, {"model": model}, ["model"], in_place=True)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if not is_statestream_checkpoint(resume_from_checkpoint):
            super()._load_from_checkpoint(resume_from_checkpoint, model)  # type: ignore[misc]
            return
        t: Any = self
        if model is None:
            model = t.model
        self._ss_load_model(resume_from_checkpoint, t.accelerator.unwrap_model(model))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None or not is_statestream_checkpoint(checkpoint):
            super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]
            return
        t: Any = self
        have = set(ss.metadata(os.path.join(checkpoint, STATE_DIR)).tree)
        want = [k for k in ("optimizer", "scheduler") if k in have]
        if want:
            self._ss_load(checkpoint, {"optimizer": t.optimizer, "scheduler": t.lr_scheduler},
                          want)

    def _load_scaler(self, checkpoint: str | None) -> None:
        if checkpoint is None or not is_statestream_checkpoint(checkpoint):
            super()._load_scaler(checkpoint)  # type: ignore[misc]
            return
        t: Any = self
        scaler = getattr(t.accelerator, "scaler", None)
        have = set(ss.metadata(os.path.join(checkpoint, STATE_DIR)).tree)
        if scaler is not None and "scaler" in have:
            self._ss_load(checkpoint, {"scaler": scaler}, ["scaler"])

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if checkpoint is None or not is_statestream_checkpoint(checkpoint):
            super()._load_rng_state(checkpoint)  # type: ignore[misc]
            return
        t: Any = self
        key = f"rank{t.args.process_index}"
        try:
            got = self._ss_load(checkpoint, None, [f"rng/{key}"])
        except ss.MissingKeyError:
            log.info("statestream: %s holds no generator states of process %d (saved with "
                     "save_only_model or another number of processes): not restored",
                     checkpoint, t.args.process_index)
            return
        _set_rng_state(got["rng"][key])

    def _load_best_model(self) -> None:
        self.wait_for_checkpoint()
        t: Any = self
        best = t.state.best_model_checkpoint
        if best is None or not is_statestream_checkpoint(best):
            super()._load_best_model()  # type: ignore[misc]
            return
        log.info("Loading best model from %s (score: %s).", best, t.state.best_metric)
        self._ss_load_model(best, t.accelerator.unwrap_model(t.model))


class StatestreamTrainer(StatestreamCheckpointing, Trainer):  # type: ignore[misc]
    """``transformers.Trainer`` with statestream checkpoints (:class:`StatestreamCheckpointing`)."""
