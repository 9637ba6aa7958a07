"""A manager's lease object is a few hundred bytes; a large object at its key (someone
else's) is not read whole. Measured in a fresh process (VmHWM, as
tests/storage/test_object_read_memory.py does); moto runs in the test's process."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from typing import Any

import pytest

MiB = 1 << 20

_CHILD = r"""
import json, sys
import statestream as ss
from statestream.storage import S3Options, S3Storage, set_backend
opts, url = json.loads(sys.argv[1]), sys.argv[2]
set_backend("s3", S3Storage(S3Options(**opts)))
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
ss.storage.storage_for(url)[0].is_committed(url + "/x")  # imports, the client, first touch
before = hwm()
try:
    ss.CheckpointManager(url, async_save=False)
    said = "opened"
except ss.ManagerLockedError as exc:
    said = str(exc)
print(json.dumps({"growth_bytes": hwm() - before, "said": said}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_a_large_object_at_the_lease_key_is_not_read_whole(s3_server: dict[str, Any]) -> None:
    """The lease was read with one GET whose whole body was copied into memory (then cut to
    4 KiB): a 128 MiB object at run/.statestream.lock made every manager opening run/
    (and every renewal that was refused) hold it twice."""
    run = f"lease-{uuid.uuid4().hex[:8]}"
    s3_server["client"].put_object(Bucket=s3_server["bucket"], Key=f"{run}/.statestream.lock",
                                   Body=b"x" * (128 * MiB))
    opts = dict(endpoint=s3_server["endpoint"], region="us-east-1",
                access_key_id=s3_server["aws_access_key_id"],
                secret_access_key=s3_server["aws_secret_access_key"])
    r = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(opts),
                        f"s3://{s3_server['bucket']}/{run}"],
                       capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["growth_bytes"] < 32 * MiB, f"peak RSS grew by {out['growth_bytes'] / MiB:.0f} MiB"
    assert "is held by <an object of 134217728 bytes>" in out["said"], out["said"]
