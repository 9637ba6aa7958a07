"""End-to-end demo: save a training state, inspect it, verify it, load it, resume exactly.

Run with ``make demo-basics`` (``make demo`` runs examples/train_resume.py).
"""

from __future__ import annotations

import os
import random
import tempfile
import time

import numpy as np
import torch

import statestream as ss
from statestream.cli import main as cli


def make_job(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Embedding(512, 128),
        torch.nn.Flatten(),
        torch.nn.Linear(128 * 16, 256),
        torch.nn.LayerNorm(256),
        torch.nn.GELU(),
        torch.nn.Linear(256, 512),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: object) -> float:
    x = torch.randint(0, 512, (8, 16))
    y = torch.randint(0, 512, (8,))
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()  # type: ignore[attr-defined]
    return loss.item()


def main() -> None:
    root = tempfile.mkdtemp(prefix="statestream-demo-")
    model, opt, sched = make_job(seed=0)
    for _ in range(3):
        train_step(model, opt, sched)

    state = {
        "model": model,
        "optim": opt,
        "sched": sched,
        "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
                "python": random.getstate()},
        "step": 3,
        "run": {"name": "demo", "tokens_seen": 3 * 8 * 16},
    }
    path = os.path.join(root, "step-3")
    t0 = time.perf_counter()
    ss.save(path, state)
    t_save = time.perf_counter() - t0
    md = ss.metadata(path)
    print(f"saved {md.num_arrays} arrays ({md.total_bytes / 2**20:.1f} MiB) to {path} "
          f"in {t_save * 1000:.0f} ms\n")

    print("$ statestream inspect", path)
    cli(["inspect", path])
    print("\n$ statestream verify", path)
    cli(["verify", path])

    # What training does next from the live state ...
    expected = [train_step(model, opt, sched) for _ in range(2)]

    # ... and the same from a fresh process-like start restored from the checkpoint.
    model2, opt2, sched2 = make_job(seed=123)
    like = {"model": model2, "optim": opt2, "sched": sched2, "rng": None, "step": 0, "run": None}
    t0 = time.perf_counter()
    restored = ss.load(path, target=like)
    t_load = time.perf_counter() - t0
    torch.set_rng_state(restored["rng"]["torch"])  # a torch tensor, as saved
    np.random.set_state(restored["rng"]["numpy"])
    random.setstate(restored["rng"]["python"])
    resumed = [train_step(model2, opt2, sched2) for _ in range(2)]
    print(f"\nloaded step {restored['step']} into fresh model/optimizer/scheduler in "
          f"{t_load * 1000:.0f} ms")
    print(f"losses after the checkpoint, original run: {[round(x, 6) for x in expected]}")
    print(f"losses after the checkpoint, resumed run:  {[round(x, 6) for x in resumed]}")
    if expected != resumed:
        raise SystemExit("resume was not exact")
    print("resume is bit-exact")

    weights = ss.load(path, items=["model"])
    print(f"\nloaded only the 'model' item: {len(weights['model'])} tensors as NumPy, "
          "optimizer state not read")

    # Damage one byte and watch verify catch it.
    data = os.path.join(path, md.files[0][0])
    with open(data, "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0xFF]))
    print("\nflipped one byte in", data)
    print("$ statestream verify", path)
    import sys

    sys.stdout.flush()
    rc = cli(["verify", path])
    sys.stderr.flush()
    print(f"(exit status {rc})")
    try:
        ss.load(path)
    except ss.ChecksumMismatchError as exc:
        print(f"load refused the damaged checkpoint: {type(exc).__name__}")


if __name__ == "__main__":
    main()
