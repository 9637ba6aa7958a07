"""Randomized round trips: random states saved with random options must load back bit-exact.

The states (tests/fuzz/_fuzz_states.py) mix NumPy arrays of every dtype (ml_dtypes'
float8 and sub-byte types, big-endian, Fortran-ordered, negative-stride and
zero-stride views, matrices, scalars), torch tensors (views into bigger storages,
transposes, expanded, channels_last, parameters, tensors with a grad_fn), JAX arrays
sharded over 8 CPU devices (also NumPy views of JAX buffers), empty and 0-d arrays
of each framework, modules (tied embedding/output weights), optimizers and random
generators, nested dicts (int keys, unicode, ``/``, ``.``, ``~``, NUL and
300-character keys), lists, tuples, namedtuples, dataclasses, plain values, tied
arrays (one object twice, views of one storage, ``torch.from_numpy``) and 120-deep
chains. Each is saved with random options (chunk size, threads, memory budget,
compression, incremental bases, hashes; sync, async and lazy saves, the state
changed in place right after ``wait_snapshot()``), then loaded without a target,
into whole or partial targets of the same and of other frameworks (``in_place``:
the target's own arrays come back; without it no target is written), with
``items=``, verified, read by ``metadata`` and by ``statestream inspect``, ``verify``
and ``diff`` (strict JSON). Lazy saves of torch tensors changed before
``wait_snapshot()`` must commit the old values or nothing.
tests/fuzz/_fuzz_campaign.py lists the modes: ``roundtrip``, ``s3`` (on a moto
server on loopback), ``convert``, ``manager`` and ``refuse``.

Each mode runs in a fresh Python process: the campaign turns on
``jax_enable_x64`` and asks XLA for 8 CPU devices, which must not leak into the
other tests. The default run is a fixed set of seeds (about a minute on two
busy cores). A longer campaign::

    STATESTREAM_FUZZ_SEEDS=100000:2000 pytest tests/fuzz/test_randomized_roundtrip.py

runs seeds 100000..101999 in every mode (``-k s3`` and so on picks modes). A
failing case prints its seed, what it did (the save options, the targets, the
items) and the command that replays it alone::

    PYTHONPATH=src python tests/fuzz/_fuzz_campaign.py roundtrip 100123 1 -v
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from _fuzz_expect import diff, expect_plain
from _fuzz_states import NT

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
#: mode -> (first seed, number of seeds) of the default run
DEFAULT_SEEDS = {"roundtrip": (0, 100), "s3": (0, 15), "convert": (0, 20), "manager": (0, 25),
                 "refuse": (0, 40)}


def _seeds(mode: str) -> tuple[int, int]:
    spec = os.environ.get("STATESTREAM_FUZZ_SEEDS")
    if not spec:
        return DEFAULT_SEEDS[mode]
    start, _, n = spec.partition(":")
    return int(start), int(n or 1)


def _limit_s() -> int:
    """Seconds a campaign may take: generous, as a hang is what it guards against."""
    return 600 + 10 * max(_seeds(mode)[1] for mode in DEFAULT_SEEDS)


@pytest.fixture(scope="module")
def s3_env() -> Iterator[dict[str, str]]:
    """A moto S3 server on loopback with the campaign's bucket; the environment that
    points the campaign's process at it."""
    moto_server = pytest.importorskip("moto.server")
    boto3 = pytest.importorskip("boto3")
    pytest.importorskip("obstore")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    srv = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    srv.start()
    host, port = srv.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    creds = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing-secret"}
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                 aws_access_key_id="testing", aws_secret_access_key="testing-secret",
                 ).create_bucket(Bucket="statestream-test")
    try:
        yield {"AWS_ENDPOINT_URL": endpoint, "AWS_ALLOW_HTTP": "true",
               "AWS_REGION": "us-east-1", **creds}
    finally:
        srv.stop()


def _run_campaign(mode: str, tmp_path: Path, extra_env: dict[str, str]) -> None:
    start, n = _seeds(mode)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "XLA_", "JAX_"))}
    env.update(extra_env, TMPDIR=str(tmp_path), JAX_PLATFORMS="cpu", PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, str(HERE / "_fuzz_campaign.py"), mode, str(start),
                        str(n)], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=_limit_s())
    out = r.stdout + r.stderr[-5000:]
    finished = f"done {n} {mode} cases" in r.stdout and r.returncode == 0
    assert finished, (
        f"the {mode} campaign (seeds {start}..{start + n - 1}) failed:\n{out[-30000:]}")


@pytest.mark.timeout(_limit_s() + 60)
@pytest.mark.parametrize("mode", ["roundtrip", "convert", "manager", "refuse"])
def test_campaign(mode: str, tmp_path: Path) -> None:
    _run_campaign(mode, tmp_path, {})


@pytest.mark.timeout(_limit_s() + 60)
def test_campaign_s3(tmp_path: Path, s3_env: dict[str, str]) -> None:
    _run_campaign("s3", tmp_path, s3_env)


def test_campaign_reports_a_failing_seed(tmp_path: Path) -> None:
    """A case that fails prints its seed and the command that replays it, and the
    process exits 1 (a mode whose case fails at seed 7, added for this test)."""
    env = dict(os.environ, TMPDIR=str(tmp_path), JAX_PLATFORMS="cpu",
               PYTHONPATH=str(ROOT / "src"))
    code = ("import sys; sys.argv[0] = 'x'; import _fuzz_campaign as c; "
            "c.CASES['boom'] = lambda seed, root, log: c.check(seed != 7, 'seven'); "
            "sys.exit(c.main(['boom', '5', '4']))")
    r = subprocess.run([sys.executable, "-c", code], cwd=HERE, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "seed 7 (boom): FAIL: seven" in r.stdout
    assert "_fuzz_campaign.py boom 7 1 -v" in r.stdout
    assert "done 4 boom cases from seed 5: 1 failing" in r.stdout


def test_diff_sees_every_kind_of_difference() -> None:
    """The comparison the campaign relies on is bitwise and type-exact."""
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = a.copy()
    b.view(np.uint32)[1, 2] ^= 1
    state = {"a": a, 0: [1.0, (b"x", None)], "t": torch.zeros(2, dtype=torch.bfloat16),
             "nt": NT(1, 2)}
    assert diff(expect_plain(state), expect_plain(state)) == []
    for changed in [{**state, "a": b}, {**state, 0: [-1.0, (b"x", None)]},
                    {**state, 0: [1.0, [b"x", None]]}, {**state, 0: [1.0, (b"y", None)]},
                    {**state, "t": torch.zeros(2, dtype=torch.float16)},
                    {"0" if k == 0 else k: v for k, v in state.items()},
                    {**state, "nt": NT(1, 3)}]:
        assert diff(expect_plain(state), expect_plain(changed)), changed
    assert diff(0.0, -0.0) and diff(float("nan"), -float("nan")) and diff(1, True)
    assert diff(np.float32(1), np.float64(1)) and diff(a, np.asfortranarray(a)) == []
