"""A save to an object store stays within its memory budget: save_async's staged
copies go back to their pool as soon as the store is done with them, and the
writer's own part buffers are bounded per file (S3 on moto, Azure on Azurite).

Measured in a fresh process (VmHWM, as test_object_read_memory.py does); the
servers run in the test's process, so their copies of the objects are not counted.
Before the writer returned only once the store was done with the caller's bytes,
save_async of 192 MiB through a 32 MiB budget grew peak RSS by about the state.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from typing import Any

import pytest

MiB = 1 << 20
_STATE = 192 * MiB
_BUDGET = 32 * MiB
_THREADS = 2
_PART = 16 * MiB  # the default TransferOptions.part_bytes

_CHILD = r"""
import json, sys
import numpy as np
import statestream as ss
from statestream.storage import AzureOptions, AzureStorage, S3Options, S3Storage, set_backend
kind, opts, url, size, shape, mode = (sys.argv[1], json.loads(sys.argv[2]), sys.argv[3],
                                      int(sys.argv[4]), sys.argv[5], sys.argv[8])
set_backend(kind, S3Storage(S3Options(**opts)) if kind == "s3"
            else AzureStorage(AzureOptions(**opts)))
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
if shape == "one":
    state = {"w": np.arange(size // 4, dtype=np.int32)}
else:  # many small arrays: most bytes pass through the writers' own part buffers
    n = 4096
    state = {f"t{i}": np.full(size // 4 // n, i, np.float32) for i in range(n)}
ss.save(url + "-first", {"x": np.ones(8)})  # imports and first-touch costs before the baseline
before = hwm()
io, mem = (ss.IOOptions(num_threads=int(sys.argv[6])),
           ss.MemoryOptions(memory_budget_bytes=int(sys.argv[7])))
if mode == "async":
    h = ss.save_async(url, state, io=io, memory=mem)
    for v in state.values():  # the snapshot is over: changing it changes nothing saved
        v += 1
    h.result()
    for v in state.values():
        v -= 1
else:
    ss.save(url, state, io=io, memory=mem)
growth = hwm() - before
got = ss.load(url)
for k, v in got.items():
    assert np.array_equal(v, state[k]), k
print(json.dumps({"growth_bytes": growth}))
"""


def _save_growth(kind: str, opts: dict[str, Any], url: str, shape: str,
                 mode: str = "async") -> int:
    r = subprocess.run([sys.executable, "-c", _CHILD, kind, json.dumps(opts), url, str(_STATE),
                        shape, str(_THREADS), str(_BUDGET), mode],
                       capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-4000:]
    return int(json.loads(r.stdout.strip().splitlines()[-1])["growth_bytes"])


def _check(growth: int, shape: str) -> None:
    # the budget, which holds the writers' own part buffers (two 16 MiB parts per
    # writer: with a 32 MiB budget, one writer, whatever _THREADS asks), plus slack for
    # the HTTP client; the state is 192 MiB. The buffers were charged on top before:
    # up to _BUDGET + _THREADS * 2 * _PART
    bound = _BUDGET + 24 * MiB
    assert growth < bound, (f"save_async of {_STATE // MiB} MiB ({shape}) through a "
                            f"{_BUDGET // MiB} MiB budget grew peak RSS by {growth / MiB:.0f} MiB")


def _s3_growth(s3_server: dict[str, Any], shape: str, mode: str) -> int:
    opts = dict(endpoint=s3_server["endpoint"], region="us-east-1",
                access_key_id=s3_server["aws_access_key_id"],
                secret_access_key=s3_server["aws_secret_access_key"])
    url = f"s3://{s3_server['bucket']}/w-{uuid.uuid4().hex[:8]}"
    return _save_growth("s3", opts, url, shape, mode)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
@pytest.mark.parametrize("shape", ["one", "small"])
def test_s3_save_async_stays_within_the_budget(s3_server: dict[str, Any], shape: str) -> None:
    _check(_s3_growth(s3_server, shape, "async"), shape)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_s3_save_uploads_the_arrays_from_where_they_are(s3_server: dict[str, Any]) -> None:
    """A synchronous save lends its arrays to the writer (lend_at): small ones too are
    uploaded zero-copy, not copied through the writers' part buffers."""
    growth = _s3_growth(s3_server, "small", "sync")
    # through the part buffers it would be about _THREADS * 2 * _PART more
    assert growth < 24 * MiB, (f"ss.save of 4,096 small arrays grew peak RSS by "
                               f"{growth / MiB:.0f} MiB")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_azure_save_async_stays_within_the_budget(azurite: dict[str, Any]) -> None:
    opts = dict(endpoint=azurite["endpoint"], account_name=azurite["account_name"],
                account_key=azurite["account_key"])
    url = f"az://{azurite['container']}/w-{uuid.uuid4().hex[:8]}"
    _check(_save_growth("az", opts, url, "one"), "one")
