"""A process forked from one that used an object store refuses to use one, at once.

obstore's client runs on a runtime whose threads a ``fork()`` does not copy: in the child
its requests hung past every timeout (and could hang the parent's after it). Each case
runs in a fresh process (moto runs in the test's), which forks with ``os.fork``; a
child that hangs is killed by an alarm, and the process by the test's timeout.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from typing import Any

import pytest

if not hasattr(__import__("os"), "fork"):  # pragma: no cover
    pytest.skip("needs os.fork", allow_module_level=True)

_PROCESS = r"""
import json, os, signal, sys, threading, time
import numpy as np
import statestream as ss
from statestream.storage import (AzureOptions, AzureStorage, GCSOptions, GCSStorage,
                                 S3Options, S3Storage, set_backend)
from statestream.storage._object_pages import pages

opts, url, mode = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
storage = S3Storage(S3Options(**opts, timeout_s=2, connect_timeout_s=1, max_retries=1,
                              retry_timeout_s=2))
set_backend("s3", storage)
bucket, prefix = storage.split_url(url)

def bounded(f, limit=20.0):
    got = {}
    def run():
        try:
            got["v"] = ["ok", f()]
        except BaseException as exc:
            got["v"] = [type(exc).__name__, str(exc)]
    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(limit)
    return got.get("v", ["hung", f"for {limit} s"])

def child_ops():
    gs = GCSStorage(GCSOptions(endpoint="http://127.0.0.1:9", bearer_token="t"))
    az = AzureStorage(AzureOptions(endpoint="http://127.0.0.1:9", account_name="a",
                                   account_key="aw=="))
    # unused: the child saves the checkpoint that it, then the parent, loads
    to = url + ("/a" if mode == "unused" else "/b")
    return {"save": lambda: str(ss.save(to, {"x": np.arange(3.0)})),
            "load": lambda: float(ss.load(url + "/a")["x"].sum()),
            "list": lambda: sorted(storage.list(url)),
            "manager": lambda: ss.CheckpointManager(url + "/run").steps(),
            "listing begun before the fork": lambda: len(next(listing)),
            "gs": lambda: gs.is_committed("gs://bucket/x"),
            "az": lambda: az.is_committed("az://box/x")}

def fork(body, name):
    pid = os.fork()
    if pid == 0:
        signal.alarm(30)  # the default action ends a child that hangs
        out = body()
        with open(os.path.join(sys.argv[4], name), "w") as f:
            json.dump(out, f)
        if mode == "used":
            sys.exit(0)  # ends normally: its exit handlers and finalizers run
        os._exit(0)
    return os.waitpid(pid, 0)[1]

def in_child():
    out = {}
    for name, op in child_ops().items():
        if mode != "used" and name not in ("load", "save", "list"):
            continue
        t = time.monotonic()
        out[name] = bounded(op) + [time.monotonic() - t]
    return out

if mode == "raw":  # the client ran, but not for statestream: its threads are seen
    ss.save(url + "/a", {"x": np.arange(10.0)})
    try:
        from statestream.storage import _object_fork
        _object_fork._used = None
    except ImportError:  # a version without it (to see this test fail without the fix)
        pass
if mode == "used":
    ss.save(url + "/a", {"x": np.arange(10.0)})
    ss.save(url + "/c", {"x": np.arange(10.0)})
    assert float(ss.load(url + "/a")["x"].sum()) == 45.0
    listing = pages(storage, bucket, prefix + "/", chunk_size=1)
    next(listing)
    # a child that never touches the store: no error, at the fork or at its exit
    untouched = fork(lambda: {}, "untouched.json")
else:
    untouched = None
status = fork(in_child, "child.json")
result = {"untouched": untouched, "status": status,
          "parent_after": bounded(lambda: float(ss.load(url + "/a")["x"].sum()))}
try:
    with open(os.path.join(sys.argv[4], "child.json")) as f:
        result["child"] = json.load(f)
except FileNotFoundError:  # it hung, and the alarm ended it
    result["child"] = None
print(json.dumps(result), flush=True)
os._exit(0)
"""


def _run(s3_server: dict[str, Any], mode: str, tmp: str) -> dict[str, Any]:
    opts = dict(endpoint=s3_server["endpoint"], region="us-east-1",
                access_key_id=s3_server["aws_access_key_id"],
                secret_access_key=s3_server["aws_secret_access_key"])
    url = f"s3://{s3_server['bucket']}/fork-{uuid.uuid4().hex[:8]}"
    r = subprocess.run([sys.executable, "-W", "ignore", "-c", _PROCESS, json.dumps(opts), url,
                        mode, tmp], capture_output=True, text=True, timeout=150, check=False)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr[-3000:])
    out: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
    return out


@pytest.mark.timeout(180)
def test_a_forked_child_refuses_the_store_at_once_and_the_parent_goes_on(
        s3_server: dict[str, Any], tmp_path: Any) -> None:
    """Every operation of the child -- on S3, whose client the parent used, and on GCS
    and Azure, whose clients it never built: one runtime serves them all -- raises a
    StorageError that says why and what to do, within a second; a listing the parent
    had begun does not go on. The parent loads afterwards; a child that never touches
    a store is not affected."""
    out = _run(s3_server, "used", str(tmp_path))
    assert out["untouched"] == 0
    assert out["status"] == 0, out
    assert set(out["child"]) == {"load", "save", "list", "manager",
                                 "listing begun before the fork", "gs", "az"}
    for name, (kind, message, took) in out["child"].items():
        assert kind in ("StorageError", "CheckpointError"), (name, kind, message)
        assert "object-store clients do not survive fork()" in message, (name, message)
        assert f"forked from one that used s3://{s3_server['bucket']}" in message
        assert "'spawn' or 'forkserver'" in message
        assert took < 1.0, (name, took)
    assert out["parent_after"] == ["ok", 45.0]


@pytest.mark.timeout(180)
def test_a_child_of_a_process_that_never_ran_the_client_uses_the_store(
        s3_server: dict[str, Any], tmp_path: Any) -> None:
    """The refusal is for a child of a process that ran the client: a child forked
    before the store was used works normally, and so does its parent after it."""
    out = _run(s3_server, "unused", str(tmp_path))
    assert out["status"] == 0, out
    child = out["child"]
    assert child["save"][0] == "ok", child
    assert child["load"][:2] == ["ok", 3.0], child
    assert child["list"][0] == "ok", child
    assert out["parent_after"] == ["ok", 3.0]


@pytest.mark.timeout(180)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")
def test_a_child_of_a_process_that_ran_the_client_elsewhere_refuses_it(
        s3_server: dict[str, Any], tmp_path: Any) -> None:
    """A process whose client ran outside statestream (here: as if statestream had never
    taken one) is recognised at the fork by the client's threads."""
    out = _run(s3_server, "raw", str(tmp_path))
    assert out["status"] == 0, out
    for name, (kind, message, took) in out["child"].items():
        assert kind == "StorageError", (name, kind, message)
        assert ("forked from one that used an object store (obstore's client ran in it)"
                in message), (name, message)
        assert took < 1.0, (name, took)
    assert out["parent_after"] == ["ok", 45.0]
