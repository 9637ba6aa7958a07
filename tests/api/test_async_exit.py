"""A process that returns right after an asynchronous save exits cleanly.

The save's thread is a daemon. Had it still been running (warming staging buffers,
or threading.Thread.run() dropping its job) while the interpreter finalized, a
torch tensor released on it would unwind the thread from inside torch's C++ and
abort the process ("terminate called without an active exception", exit 134)
after a save that had committed. The exit drain waits for that thread to end.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

SRC = str(Path(__file__).resolve().parents[2] / "src")

SCRIPT = textwrap.dedent("""
    import atexit, sys, threading, time

    def _check():  # registered before statestream's drain, so it runs after it
        alive = [t.name for t in threading.enumerate() if t.name == "statestream-save"]
        print("ALIVE" if alive else "ENDED", flush=True)

    atexit.register(_check)

    import torch
    import statestream as ss
    from statestream import _hooks

    # The committed save's thread is still busy when the script returns.
    _hooks.register("async.warming", lambda: time.sleep(0.5))
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, 64)).sum().backward()
    opt.step()
    state = {"model": model, "optim": opt, "step": 1}
    lazy = sys.argv[2] == "lazy"
    h = ss.save_async(sys.argv[1], state, lazy=lazy)
    if lazy:
        ss.guard_optimizer(opt, h)
        ss.guard_module(model, h)
    h.result()
""")


@pytest.mark.parametrize("mode", ["async", "lazy"])
def test_the_process_exits_cleanly_once_the_save_thread_has_ended(tmp_path, mode):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    for i in range(3):
        r = subprocess.run([sys.executable, str(script), str(tmp_path / f"ckpt{i}"), mode],
                           capture_output=True, text=True, timeout=120,
                           env={"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin"})
        assert r.returncode == 0, r.stderr[-2000:]
        assert r.stdout.strip() == "ENDED", (r.stdout, r.stderr[-2000:])
