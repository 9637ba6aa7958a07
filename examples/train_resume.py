"""Exact resume after a crash: kill -9 a training job mid-run, resume, match bit for bit.

A small transformer language model trains on the CPU on synthetic data.
The whole job state is checkpointed asynchronously (lazy snapshots, the
optimizer guarded) by ``ss.CheckpointManager``:

    model, AdamW optimizer, LR scheduler, the data loader's position and RNG,
    the torch / NumPy / Python RNG states, the step counter.

The demo:

1. trains T steps without interruption (the reference);
2. trains again in a child process with checkpoints, and SIGKILLs it
   part-way (at a seeded random step, often just as a save is in flight);
3. resumes in a new process from the latest committed checkpoint and trains to T;
4. checks that every parameter and optimizer tensor equals the reference
   bit for bit (``torch.equal``), and that the losses after the resume are the
   same floats. Exit status 1 if anything differs.

Run with ``make demo`` (or ``python examples/train_resume.py [--steps T]``).
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np
import torch
from torch import nn

import statestream as ss

VOCAB, D_MODEL, LAYERS, HEADS, SEQ, BATCH = 256, 128, 2, 4, 64, 8
CROP = 8  # the loader yields SEQ + CROP + 1 tokens; Python's RNG picks the crop

# One thread everywhere: the same arithmetic in every process, and fair on a small machine.
torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)


# ---------------------------------------------------------------------- the job
class TinyLM(nn.Module):
    """A 2-layer pre-norm transformer decoder (causal self-attention) with dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D_MODEL)
        self.pos = nn.Parameter(torch.randn(SEQ, D_MODEL) * 0.02)
        layer = nn.TransformerEncoderLayer(D_MODEL, HEADS, 2 * D_MODEL, dropout=0.1,
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB, bias=False)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(SEQ),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x) + self.pos[: x.shape[1]]
        h = self.blocks(h, mask=self.causal, is_causal=True)
        return self.head(self.norm(h))


class SyntheticLoader:
    """Seeded batches of noisy arithmetic sequences; its position is part of the state.

    Each sequence is ``(a + b * i) mod VOCAB`` with a random start and stride
    and 10% of tokens replaced by noise, all drawn from the loader's own
    generator, so batch ``k`` depends on every batch before it.
    """

    def __init__(self, seed: int) -> None:
        self.gen = np.random.Generator(np.random.PCG64(seed))
        self.index = 0

    def next_batch(self) -> np.ndarray:
        n = SEQ + CROP + 1
        a = self.gen.integers(0, VOCAB, size=(BATCH, 1))
        b = self.gen.integers(1, 8, size=(BATCH, 1))
        tokens = (a + b * np.arange(n)) % VOCAB
        noise = self.gen.random((BATCH, n)) < 0.1
        tokens = np.where(noise, self.gen.integers(0, VOCAB, size=(BATCH, n)), tokens)
        self.index += 1
        return tokens.astype(np.int64)

    def state_dict(self) -> dict[str, Any]:
        st = self.gen.bit_generator.state
        m = (1 << 64) - 1
        s, inc = st["state"]["state"], st["state"]["inc"]
        return {
            "index": self.index,
            "pcg64": np.array([s >> 64, s & m, inc >> 64, inc & m], dtype=np.uint64),
            "has_uint32": int(st["has_uint32"]),
            "uinteger": int(st["uinteger"]),
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        w = [int(x) for x in np.asarray(sd["pcg64"])]
        self.gen.bit_generator.state = {
            "bit_generator": "PCG64",
            "state": {"state": (w[0] << 64) | w[1], "inc": (w[2] << 64) | w[3]},
            "has_uint32": int(sd["has_uint32"]),
            "uinteger": int(sd["uinteger"]),
        }
        self.index = int(sd["index"])


def make_job(steps: int, seed: int = 0) -> tuple[nn.Module, Any, Any, SyntheticLoader]:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    warmup = max(1, steps // 10)

    def lr_at(s: int) -> float:  # linear warmup, cosine decay to 10%
        if s < warmup:
            return (s + 1) / warmup
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - warmup) / max(1, steps - warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    return model, opt, sched, SyntheticLoader(seed + 1)


def train_step(model: nn.Module, opt: Any, sched: Any, loader: SyntheticLoader) -> float:
    tokens = loader.next_batch()
    off = random.randrange(CROP + 1)  # Python RNG
    x = tokens[:, off: off + SEQ].copy()
    y = tokens[:, off + 1: off + SEQ + 1]
    x[np.random.random_sample(x.shape) < 0.05] = 0  # NumPy global RNG: input masking
    logits = model(torch.from_numpy(x))  # dropout: torch RNG
    loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), torch.from_numpy(y).reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    return float(loss.item())


def job_state(step: int, model: nn.Module, opt: Any, sched: Any,
              loader: SyntheticLoader) -> dict[str, Any]:
    return {
        "model": model,
        "optim": opt,
        "sched": sched,
        "loader": loader,
        "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
                "python": python_rng_state()},
        "step": step,
    }


def python_rng_state() -> dict[str, Any]:
    """``random.getstate()`` with its 625 words as one array (one leaf, not 625)."""
    version, words, gauss = random.getstate()
    return {"version": version, "words": np.array(words, dtype=np.uint64), "gauss": gauss}


def set_python_rng_state(st: dict[str, Any]) -> None:
    words = tuple(int(w) for w in np.asarray(st["words"]))
    random.setstate((int(st["version"]), words, st["gauss"]))


# ---------------------------------------------------------------------- child roles
def run_training(args: argparse.Namespace) -> None:
    """Train to ``--steps`` with checkpoints; resume first if the directory has one."""
    model, opt, sched, loader = make_job(args.steps, args.seed)
    mgr = ss.CheckpointManager(args.ckpt, save_policy=ss.EveryNSteps(args.save_every),
                               keep_policy=ss.KeepLatest(3), lazy=True)
    start = 0
    latest = mgr.latest_step()
    if latest is not None:
        t0 = time.perf_counter()
        like = job_state(0, model, opt, sched, loader)
        like["rng"] = None  # restored as NumPy / plain values, set below
        got = mgr.load(latest, target=like)
        torch.set_rng_state(torch.from_numpy(np.asarray(got["rng"]["torch"])))
        np.random.set_state(got["rng"]["numpy"])
        set_python_rng_state(got["rng"]["python"])
        start = int(got["step"])
        print(f"resumed {start} {loader.index} {(time.perf_counter() - t0) * 1e3:.1f}",
              flush=True)
    pending: list[tuple[int, Any, float, float]] = []
    t_train = time.perf_counter()
    for step in range(start + 1, args.steps + 1):
        loss = train_step(model, opt, sched, loader)
        t0 = time.perf_counter()
        if mgr.save(step, job_state(step, model, opt, sched, loader), metrics={"loss": loss}):
            h = mgr.in_flight
            ss.guard_optimizer(opt, h)
            block = time.perf_counter() - t0
            pending.append((step, h, t0, block))
            print(f"save {step} {h.bytes_total} {block * 1e3:.2f}", flush=True)
        for item in list(pending):
            if item[1].done():
                pending.remove(item)
                print(f"committed {item[0]} {(time.perf_counter() - item[2]) * 1e3:.1f}",
                      flush=True)
        print(f"step {step} {loss!r}", flush=True)
    mgr.close()
    for s, _, t0, _ in pending:
        print(f"committed {s} {(time.perf_counter() - t0) * 1e3:.1f}", flush=True)
    ss.save(args.final, {"model": model.state_dict(), "optim": opt.state_dict()})
    print(f"done {time.perf_counter() - t_train:.3f}", flush=True)


# ---------------------------------------------------------------------- orchestration
def _spawn(args: argparse.Namespace, ckpt: str, final: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, os.path.abspath(__file__), "--role", "train", "--ckpt", ckpt,
           "--final", final, "--steps", str(args.steps), "--save-every", str(args.save_every),
           "--seed", str(args.seed)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, bufsize=1)


def _lines(proc: subprocess.Popen[str], timeout_s: float):  # type: ignore[no-untyped-def]
    """Yield the child's output lines until it exits (kill it after ``timeout_s``)."""
    assert proc.stdout is not None
    end = time.monotonic() + timeout_s
    while True:
        if time.monotonic() > end:
            proc.kill()
            raise SystemExit(f"child {proc.pid} took more than {timeout_s:.0f}s; killed")
        r, _, _ = select.select([proc.stdout], [], [], 0.5)
        if r:
            line = proc.stdout.readline()
            if not line:
                break
            yield line.split()
        elif proc.poll() is not None:
            for line in proc.stdout:
                yield line.split()
            break
    proc.wait()


def _compare(name: str, ref: Any, got: Any, problems: list[str]) -> int:
    """Count tensors compared; append a line to ``problems`` for each difference."""
    if isinstance(ref, torch.Tensor):
        g = torch.from_numpy(np.asarray(got))
        if g.dtype != ref.dtype or g.shape != ref.shape or not torch.equal(g, ref):
            diff = (g.double() - ref.double()).abs().max().item() if g.shape == ref.shape else "?"
            problems.append(f"{name}: differs (max abs diff {diff})")
        return 1
    if isinstance(ref, dict):
        n = 0
        if sorted(map(str, ref)) != sorted(map(str, got)):
            problems.append(f"{name}: keys {sorted(map(str, ref))} != {sorted(map(str, got))}")
            return 0
        gd = {str(k): v for k, v in got.items()}
        for k, v in ref.items():
            n += _compare(f"{name}/{k}", v, gd[str(k)], problems)
        return n
    if isinstance(ref, (list, tuple)):
        if len(ref) != len(got):
            problems.append(f"{name}: length {len(ref)} != {len(got)}")
            return 0
        return sum(_compare(f"{name}/{i}", r, g, problems)
                   for i, (r, g) in enumerate(zip(ref, got)))
    if ref != got and not (isinstance(ref, float) and math.isnan(ref) and math.isnan(got)):
        problems.append(f"{name}: {ref!r} != {got!r}")
    return 0


def orchestrate(args: argparse.Namespace) -> int:
    t_all = time.perf_counter()
    T, N = args.steps, args.save_every
    work = args.workdir or tempfile.mkdtemp(prefix="statestream-resume-")
    ckpt = os.path.join(work, "ckpt")
    final = os.path.join(work, "final")
    if os.path.exists(ckpt) or os.path.exists(final):
        raise SystemExit(f"{work} already holds a run; give an empty --workdir")
    os.makedirs(work, exist_ok=True)

    model, opt, sched, loader = make_job(T, args.seed)
    nparams = sum(p.numel() for p in model.parameters())
    print(f"statestream exact-resume demo: {LAYERS}-layer transformer LM (d_model {D_MODEL}, "
          f"vocab {VOCAB}, seq {SEQ}, batch {BATCH}), {nparams / 1e6:.2f}M parameters,")
    print(f"AdamW + warmup/cosine LambdaLR, dropout; {T} steps; checkpoint every {N} steps "
          f"(async, lazy, optimizer guarded), KeepLatest(3)\n")

    # 1. the reference -----------------------------------------------------------
    t0 = time.perf_counter()
    ref_losses = [train_step(model, opt, sched, loader) for _ in range(T)]
    t_ref = time.perf_counter() - t0
    print(f"[1/4] reference: {T} steps uninterrupted in {t_ref:.1f} s "
          f"({t_ref / T * 1e3:.0f} ms/step), loss {ref_losses[0]:.3f} -> {ref_losses[-1]:.3f}")

    # 2. train with checkpoints, SIGKILL part-way ----------------------------------
    rng = random.Random(f"statestream-demo/{args.seed}/{T}")
    kill_step = rng.randint(T // 2, (3 * T) // 4)
    mid_save = rng.random() < 0.85  # most often just as a save starts: likely in flight
    if mid_save:
        kill_step = max(N, kill_step - kill_step % N)
        when = f"as soon as it reports starting the save of step {kill_step}"
    else:
        when = f"once it reports step {kill_step} done"
    print(f"[2/4] training with checkpoints in a child process; SIGKILL {when} "
          f"(seeded random choice)")
    saves: dict[int, dict[str, float]] = {}
    last_step = 0
    t0 = time.perf_counter()
    proc = _spawn(args, ckpt, final)
    try:
        for parts in _lines(proc, args.timeout):
            kind = parts[0]
            if kind == "save":
                saves[int(parts[1])] = {"bytes": int(parts[2]), "block_ms": float(parts[3])}
            elif kind == "committed":
                saves.setdefault(int(parts[1]), {})["total_ms"] = float(parts[2])
            elif kind == "step":
                last_step = int(parts[1])
            if (kind == ("save" if mid_save else "step") and int(parts[1]) >= kill_step
                    and proc.poll() is None):
                os.kill(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    t_child = time.perf_counter() - t0
    if proc.returncode != -signal.SIGKILL:
        print(f"FAIL: the training child was not killed (exit status {proc.returncode})")
        return 1
    staging = sorted(glob.glob(os.path.join(ckpt, ".step_*.tmp-*")))
    inflight = [int(os.path.basename(p)[6:16]) for p in staging]
    for s in sorted(saves):
        info = saves[s]
        total = f"committed after {info['total_ms']:.0f} ms" if "total_ms" in info else \
            "not seen committed"
        if "bytes" in info:
            print(f"      save step {s:4d}: {info['bytes'] / 2**20:.1f} MiB, training blocked "
                  f"{info['block_ms']:.1f} ms, {total}")
    where = (f"while the save of step {inflight[0]} was in flight (its staging dir is left)"
             if inflight else "between saves (no save in flight)")
    print(f"      SIGKILL after {t_child:.1f} s (last step reported: {last_step}); "
          f"it landed {where}")

    with ss.CheckpointManager(ckpt) as mgr:  # opening it cleans what the crash left
        committed = mgr.steps()
        sizes = [mgr.step_info(s)["nbytes"] for s in committed]
    left = glob.glob(os.path.join(ckpt, ".step_*.tmp-*"))
    print(f"      committed steps on disk: {committed} "
          f"({', '.join(f'{b / 2**20:.1f} MiB' for b in sizes)}); "
          f"leftovers after reopening: {len(left)}")
    if not committed:
        print("FAIL: no committed checkpoint before the kill (use more --steps)")
        return 1

    # 3. resume in a new process ------------------------------------------------------
    t0 = time.perf_counter()
    proc = _spawn(args, ckpt, final)
    resumed_at, loader_index, load_ms, t_train2 = -1, -1, 0.0, 0.0
    resumed_losses: dict[int, float] = {}
    blocks: list[float] = []
    try:
        for parts in _lines(proc, args.timeout):
            if parts[0] == "resumed":
                resumed_at, loader_index, load_ms = int(parts[1]), int(parts[2]), float(parts[3])
            elif parts[0] == "step":
                resumed_losses[int(parts[1])] = float(parts[2])
            elif parts[0] == "save":
                blocks.append(float(parts[3]))
            elif parts[0] == "done":
                t_train2 = float(parts[1])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    t_resume = time.perf_counter() - t0
    if proc.returncode != 0:
        print(f"FAIL: the resumed training exited with status {proc.returncode}")
        return 1
    n2 = T - resumed_at
    print(f"[3/4] resumed in a new process from step {resumed_at} (latest committed; loader at "
          f"batch {loader_index}), restore took {load_ms:.0f} ms; trained {n2} steps to {T} in "
          f"{t_train2:.1f} s ({t_resume:.1f} s with process start)")
    if blocks:
        print(f"      {len(blocks)} more saves; training blocked {sum(blocks):.1f} ms in save "
              f"calls out of {t_train2 * 1e3:.0f} ms of training "
              f"({100 * sum(blocks) / max(t_train2 * 1e3, 1e-9):.2f}%)")

    # 4. compare --------------------------------------------------------------------------
    got = ss.load(final)
    problems: list[str] = []
    n_model = _compare("model", model.state_dict(), got["model"], problems)
    n_opt = _compare("optim", opt.state_dict(), got["optim"], problems)
    loss_diff = [s for s in range(resumed_at + 1, T + 1)
                 if resumed_losses.get(s) != ref_losses[s - 1]]
    if loss_diff:
        problems.append(f"losses differ at {len(loss_diff)} steps, first at step {loss_diff[0]}")
    ok = not problems and resumed_at >= 0
    print(f"[4/4] resumed run vs reference: {n_model} parameter tensors and {n_opt} optimizer "
          f"tensors compared with torch.equal, {n2} losses compared exactly")
    for p in problems[:10]:
        print(f"      MISMATCH {p}")
    print(f"\nfinal check: {'PASS' if ok else 'FAIL'} - resumed training is "
          f"{'bitwise identical to' if ok else 'NOT identical to'} the uninterrupted run "
          f"(total {time.perf_counter() - t_all:.1f} s)")
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=150, help="total training steps T")
    ap.add_argument("--save-every", type=int, default=None,
                    help="checkpoint interval (default: T/10)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", default=None, help="keep files here (default: a temp dir)")
    ap.add_argument("--timeout", type=float, default=600.0, help="per child process, seconds")
    ap.add_argument("--role", default="main", choices=["main", "train"], help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    ap.add_argument("--final", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.save_every is None:
        args.save_every = max(1, args.steps // 10)
    if args.role == "train":
        run_training(args)
        return 0
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
