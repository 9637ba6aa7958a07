"""A save killed with SIGKILL part-way never leaves a loadable half checkpoint.

A real child process saves a large state; the parent waits until the
child's temporary directory holds data, then kills it. Two ways to pick
the moment:

* ``paused``: the child's progress callback stops the save (sleeps) after a
  third of the bytes are written, so the kill certainly lands mid-write;
* ``free``: the save keeps running and is killed as soon as a third is
  written, wherever it then is (maybe fsync or commit; maybe done): the
  outcome must be all-old or all-new, never a mix.
"""

from __future__ import annotations

import glob
import os
import select
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import statestream as ss

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")

_N_ARRAYS = 24

_CHILD = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    import statestream as ss

    path, mode, overwrite, size_mb = sys.argv[1], sys.argv[2], sys.argv[3] == "1", int(sys.argv[4])
    n = (size_mb << 20) // 8 // {n}
    state = {{"step": 2, "params": {{f"w{{i}}": np.full(n, i + 1, dtype=np.float64)
                                    for i in range({n})}}}}
    fired = False

    def progress(done, total):
        global fired
        if not fired and done * 3 >= total:
            fired = True
            print("THIRD", flush=True)
            if mode == "paused":
                time.sleep(600)

    ss.save(path, state, overwrite=overwrite, progress=progress,
            io=ss.IOOptions(num_threads=1, max_chunk_bytes=1 << 20))
    print("DONE", flush=True)
    """
).format(n=_N_ARRAYS)


def _old_state(tag):
    return {"step": 1, "tag": tag, "params": {"w0": np.arange(1000, dtype=np.float32)}}


def _read_line(proc, deadline_s):
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        r, _, _ = select.select([proc.stdout], [], [], 0.5)
        if r:
            return proc.stdout.readline().strip()
        if proc.poll() is not None:
            return proc.stdout.readline().strip()
    return ""


def _tmp_dirs(parent, name):
    return glob.glob(os.path.join(parent, f".{name}.tmp-*"))


def _run_and_kill(path, mode, overwrite, size_mb):
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(path), mode, "1" if overwrite else "0", str(size_mb)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        line = _read_line(proc, 180)
        if line != "THIRD":
            proc.kill()
            out, err = proc.communicate(timeout=60)
            pytest.fail(f"child did not report progress: {line!r} {out!r} {err[-2000:]!r}")
        tmps = _tmp_dirs(os.path.dirname(path), os.path.basename(path))
        if mode == "paused":
            # the save is stopped mid-write: its temp dir exists and holds real data
            assert len(tmps) == 1, tmps
            files = glob.glob(os.path.join(tmps[0], "data", "*"))
            assert files
            with open(files[0], "rb") as f:
                head = np.frombuffer(f.read(8), dtype=np.float64)
            assert head.tolist() == [1.0]  # first array's bytes are on disk
            assert not os.path.exists(os.path.join(tmps[0], "COMMITTED"))
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    return proc.returncode


def _check_new(out, size_mb):
    n = (size_mb << 20) // 8 // _N_ARRAYS
    assert out["step"] == 2
    assert list(out["params"]) == [f"w{i}" for i in range(_N_ARRAYS)]
    for i in range(_N_ARRAYS):
        w = out["params"][f"w{i}"]
        assert w.shape == (n,) and w.dtype == np.float64
        assert (w == i + 1).all()


@pytest.mark.parametrize("overwrite", [False, True], ids=["fresh", "overwrite"])
@pytest.mark.parametrize("mode", ["paused", "free"])
def test_sigkill_mid_save(tmp_path, mode, overwrite):
    size_mb = 48 if mode == "paused" else 96
    q = tmp_path / "Q"
    p = tmp_path / "P"
    ss.save(q, _old_state("q"))
    if overwrite:
        ss.save(p, _old_state("p-old"))

    rc = _run_and_kill(str(p), mode, overwrite, size_mb)
    if mode == "paused":
        assert rc == -signal.SIGKILL

    # Q is untouched
    from statestream.testing import assert_tree_equal

    assert_tree_equal(ss.load(q), _old_state("q"))
    assert ss.verify(q).ok

    finished = rc == 0
    if overwrite:
        out = ss.load(p)
        if out["step"] == 1:
            assert_tree_equal(out, _old_state("p-old"))
        else:  # only possible when the kill came after the commit ("free" mode)
            assert mode == "free"
            _check_new(out, size_mb)
        assert ss.verify(p).ok
    elif finished or (mode == "free" and os.path.exists(p / "COMMITTED")):
        _check_new(ss.load(p), size_mb)
    else:
        with pytest.raises(ss.CheckpointNotFoundError):
            ss.load(p)
        with pytest.raises(ss.CheckpointNotFoundError):
            ss.verify(p)
    if mode == "paused":
        # the killed save's temp dir is left behind, never mistaken for a checkpoint
        tmps = _tmp_dirs(str(tmp_path), "P")
        assert len(tmps) == 1
        with pytest.raises(ss.CheckpointNotFoundError):
            ss.load(tmps[0])
        # a later save to P still works (and replaces the old one when asked)
        ss.save(p, _old_state("p-new"), overwrite=overwrite)
        assert_tree_equal(ss.load(p), _old_state("p-new"))
