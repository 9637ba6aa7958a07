"""Checkpoints of a Hugging Face ``Trainer``: its own against ``StatestreamTrainer``.

A GPT-2 (124M parameters by default, fp32, AdamW: ~1.5 GB of model and optimizer
state) trains on the CPU for ``--steps`` steps with a checkpoint every
``--every`` steps. Each configuration runs in a fresh process:

- ``none``: ``Trainer`` with ``save_strategy="no"`` (the training time alone);
- ``hf``: ``transformers.Trainer``'s own checkpoints (``model.safetensors``,
  ``optimizer.pt`` by ``torch.save``, ``scheduler.pt``, ``rng_state.pth``,
  ``trainer_state.json``; no fsync);
- ``ss-sync``: ``StatestreamTrainer(async_save=False)`` (fsync'd, committed atomically);
- ``ss-async``: ``StatestreamTrainer()`` (the default: in the background);
- ``ss-lazy``: ``StatestreamTrainer(lazy=True)`` (the snapshot in the background too;
  the next optimizer step waits for what it changes; that wait is inside the step, so
  it shows in ``train()``, not in the time per checkpoint).

Per configuration: the time the training loop spends in ``_save_checkpoint`` per
checkpoint (for ``ss-async`` this includes waiting for the previous checkpoint;
the wait at the end of training is reported apart), the whole ``train()`` call, the
process's peak RSS (``VmHWM``), then, in another fresh process, the resume: the time
from ``train(resume_from_checkpoint=...)`` to the end of the first training step
(reading the model, optimizer, scheduler and generator states, and the step, whose
optimizer update writes all of the loaded optimizer state; page cache warm).

Usage (from the repo root)::

    PYTHONPATH=src .venv/bin/python benchmarks/bench_hf_trainer.py --repeats 3
    PYTHONPATH=src .venv/bin/python benchmarks/bench_hf_trainer.py --quick   # a 3M-parameter model
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
sys.path.insert(0, str(HERE))
from _common import med, run_child  # noqa: E402

CONFIGS = ("none", "hf", "ss-sync", "ss-async", "ss-lazy")


def _vmhwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def child(task: dict) -> dict:
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    import warnings

    warnings.simplefilter("ignore")
    import torch
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from statestream.integrations.transformers import StatestreamTrainer

    transformers.logging.set_verbosity_error()
    quick = task["quick"]
    cfg = GPT2Config(n_layer=2 if quick else 12, n_embd=256 if quick else 768,
                     n_head=4 if quick else 12, vocab_size=8000 if quick else 50257,
                     n_positions=64, bos_token_id=0, eos_token_id=0)
    vocab = cfg.vocab_size

    class Tokens(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 10_000

        def __getitem__(self, i: int) -> dict:
            ids = torch.randint(0, vocab, (32,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids}

    conf = task["config"]
    cls = {"none": Trainer, "hf": Trainer, "ss-sync": StatestreamTrainer,
           "ss-async": StatestreamTrainer, "ss-lazy": StatestreamTrainer}[conf]
    kw = ({} if cls is Trainer else
          {"async_save": conf != "ss-sync", "lazy": conf == "ss-lazy"})
    saves: list[float] = []
    loads: dict[str, float] = {}
    first_step: list[float] = []
    orig_save = cls._save_checkpoint
    orig_final = cls._finalize_training

    def timed_save(self, *a, **k):
        t = time.perf_counter()
        orig_save(self, *a, **k)
        saves.append(time.perf_counter() - t)

    final_wait: list[float] = []

    def timed_final(self, *a, **k):
        t = time.perf_counter()
        if hasattr(self, "wait_for_checkpoint"):
            self.wait_for_checkpoint()
        final_wait.append(time.perf_counter() - t)
        return orig_final(self, *a, **k)

    class FirstStep(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if not first_step:
                first_step.append(time.perf_counter())

    cls._save_checkpoint = timed_save
    cls._finalize_training = timed_final
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg)
    state_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) * 3
    args = TrainingArguments(
        output_dir=task["out"], max_steps=task["steps"], per_device_train_batch_size=2,
        save_strategy="no" if conf == "none" else "steps", save_steps=task["every"],
        report_to=[], logging_steps=10_000, use_cpu=True, disable_tqdm=True, seed=0,
        save_total_limit=2)
    trainer = cls(model=model, args=args, train_dataset=Tokens(), callbacks=[FirstStep()],
                  **kw)
    resume = task.get("resume")
    t0 = time.perf_counter()
    trainer.train(resume_from_checkpoint=resume)
    total = time.perf_counter() - t0
    if resume:
        loads["to_first_step_s"] = first_step[0] - t0
    return {"ok": True, "config": conf, "saves_s": saves, "final_wait_s": final_wait,
            "train_s": total, "peak_rss": _vmhwm(), "state_bytes": state_bytes, **loads}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--every", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    ap.add_argument("--out", default=None, help="JSON results file")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print("RESULT:" + json.dumps(child(json.loads(a.child))), flush=True)
        return
    root = Path(a.dir or tempfile.mkdtemp(prefix="bench-hf-"))
    configs = a.configs.split(",")
    rows: dict[str, list[dict]] = {c: [] for c in configs}
    try:
        for r in range(a.repeats):
            for conf in configs:  # interleaved, each a fresh process
                out = root / conf
                shutil.rmtree(out, ignore_errors=True)
                task = {"config": conf, "quick": a.quick, "steps": a.steps,
                        "every": a.every, "out": str(out)}
                res = run_child(__file__, SRC, task, 1800, stderr_on_failure=True)
                if not res.get("ok"):
                    raise SystemExit(f"{conf}: {res}")
                if conf != "none":
                    last = sorted((p for p in out.iterdir() if p.name.startswith("checkpoint-")),
                                  key=lambda p: int(p.name.split("-")[1]))[-1]
                    res["checkpoint_bytes"] = sum(f.stat().st_size for f in last.rglob("*")
                                                  if f.is_file())
                    # resume: two more steps from the last checkpoint, in a fresh process
                    again = run_child(__file__, SRC, dict(task, resume=str(last),
                                                          steps=a.steps + 1),
                                      1800, stderr_on_failure=True)
                    if not again.get("ok"):
                        raise SystemExit(f"{conf} resume: {again}")
                    res["resume_s"] = again["to_first_step_s"]
                rows[conf].append(res)
                print(f"[{r}] {conf}: saves {[round(s, 3) for s in res['saves_s']]} "
                      f"train {res['train_s']:.2f}s resume {res.get('resume_s')}", flush=True)
    finally:
        if not a.dir:
            shutil.rmtree(root, ignore_errors=True)
    print(render(rows, a))
    if a.out:
        Path(a.out).write_text(json.dumps({"args": vars(a), "rows": rows}, indent=1))


def _mr(xs: list[float], nd: int = 2) -> str:
    xs = [x for x in xs if x is not None]
    if not xs:
        return "-"
    return f"{med(xs):.{nd}f} ({min(xs):.{nd}f}-{max(xs):.{nd}f})"


def render(rows: dict[str, list[dict]], a: argparse.Namespace) -> str:
    any_row = next(r for rs in rows.values() for r in rs)
    gb = any_row["state_bytes"] / 1e9
    lines = [
        f"command: `{' '.join([Path(sys.executable).name] + sys.argv)}`",
        f"GPT-2 of {any_row['state_bytes'] / 12e6:.0f}M parameters, model + AdamW state {gb:.2f} GB, "
        f"{a.steps} steps, a checkpoint every {a.every}; medians (min-max) of {a.repeats} "
        "fresh processes, seconds",
        "",
        "| | per checkpoint in the loop | wait at the end | train() | resume + 1st step "
        "| checkpoint MB | peak RSS GiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for conf, rs in rows.items():
        per = [med(r["saves_s"]) for r in rs]
        lines.append(
            f"| {conf} | {_mr(per)} | {_mr([sum(r['final_wait_s']) for r in rs])} "
            f"| {_mr([r['train_s'] for r in rs])} | {_mr([r.get('resume_s') for r in rs])} "
            f"| {_mr([r.get('checkpoint_bytes', 0) / 1e6 for r in rs], 0)} "
            f"| {_mr([r['peak_rss'] / 2**30 for r in rs])} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
