"""A load from an object store copies each ranged read's response into place piece by
piece: peak RSS grows by a few MiB, not by the state (S3 on moto, Azure on Azurite).

Measured in a fresh process (VmHWM, as tests/interop/test_convert_memory.py does); the
servers run in the test's process, so their copies of the objects are not counted.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from typing import Any

import numpy as np
import pytest

import statestream as ss
from statestream.storage import (
    AzureOptions,
    AzureStorage,
    S3Options,
    S3Storage,
    set_backend,
)

MiB = 1 << 20
_STATE = 128 * MiB

_CHILD = r"""
import json, sys
import numpy as np
import statestream as ss
from statestream.storage import AzureOptions, AzureStorage, S3Options, S3Storage, set_backend
kind, opts, url, size = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], int(sys.argv[4])
set_backend(kind, S3Storage(S3Options(**opts)) if kind == "s3"
            else AzureStorage(AzureOptions(**opts)))
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
target = {"w": np.ones(size // 4, np.float32)}  # the caller's memory, touched (not np.zeros)
ss.metadata(url)  # imports and first-touch costs happen before the baseline
before = hwm()
ss.load(url, target, in_place=True, io=ss.IOOptions(num_threads=2),
        memory=ss.MemoryOptions(memory_budget_bytes=32 << 20))
assert float(target["w"][1000]) == 1000.0 and float(target["w"][-1]) > 0
print(json.dumps({"growth_bytes": hwm() - before}))
"""


def _load_growth(kind: str, opts: dict[str, Any], url: str) -> int:
    w = np.arange(_STATE // 4, dtype=np.float32)
    ss.save(url, {"w": w})
    del w
    r = subprocess.run([sys.executable, "-c", _CHILD, kind, json.dumps(opts), url, str(_STATE)],
                       capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stderr
    return int(json.loads(r.stdout.strip().splitlines()[-1])["growth_bytes"])


def _check(growth: int) -> None:
    # the old reader held each whole response (32 MiB per thread) and the HTTP client's
    # pieces of it: about the state's size in all (+128 MiB here, +513 MiB for 512 MiB)
    bound = 48 * MiB
    assert growth < bound, f"peak RSS grew by {growth / MiB:.0f} MiB loading 128 MiB in place"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_s3_load_in_place_streams_responses(s3_server: dict[str, Any]) -> None:
    opts = dict(endpoint=s3_server["endpoint"], region="us-east-1",
                access_key_id=s3_server["aws_access_key_id"],
                secret_access_key=s3_server["aws_secret_access_key"])
    set_backend("s3", S3Storage(S3Options(**opts)))
    try:
        _check(_load_growth("s3", opts, f"s3://{s3_server['bucket']}/m-{uuid.uuid4().hex[:8]}"))
    finally:
        set_backend("s3", None)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_azure_load_in_place_streams_responses(azurite: dict[str, Any]) -> None:
    opts = dict(endpoint=azurite["endpoint"], account_name=azurite["account_name"],
                account_key=azurite["account_key"])
    set_backend("az", AzureStorage(AzureOptions(**opts)))
    try:
        _check(_load_growth("az", opts, f"az://{azurite['container']}/m-{uuid.uuid4().hex[:8]}"))
    finally:
        set_backend("az", None)
