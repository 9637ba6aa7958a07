"""Run a worker function in N real processes on this machine (loopback only).

``launch(module_file, "worker_name", world, tmp_path, ...)`` starts ``world``
copies of this file as scripts; each imports ``module_file`` and calls
``worker_name(ctx)`` with a :class:`Context` (rank, world, a free loopback
port shared by all ranks, a scratch directory, JSON-able ``args``). The
worker's return value (JSON-able) is written to ``result-<rank>.json``; an
exception writes its traceback there instead and exits 1. The pytest process
reads the results and makes the assertions, so failures show the worker's
traceback and the tail of its stderr.

Every launch has a hard timeout; all children are killed in a ``finally``
(on success, failure, timeout or KeyboardInterrupt), so no process outlives
the test. Children run in their own session so a kill reaches anything they
started.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve()
_REPO = _HERE.parents[2]
PYTHON = sys.executable


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclasses.dataclass
class Context:
    """What a worker gets: who it is and where to put things."""

    rank: int
    world: int
    port: int
    tmp: str
    args: Any


@dataclasses.dataclass
class RankResult:
    rank: int
    returncode: int | None
    value: Any
    error: str | None
    stderr: str


class WorkerFailed(AssertionError):
    pass


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """Linux: the child gets SIGKILL if the pytest process dies (even by SIGKILL)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def _tail(path: Path, n: int = 6000) -> str:
    try:
        data = path.read_bytes()
    except OSError:
        return ""
    return data[-n:].decode(errors="replace")


def launch(
    module_file: str | os.PathLike[str],
    worker: str,
    world: int,
    tmp: str | os.PathLike[str],
    *,
    args: Any = None,
    timeout_s: float = 60.0,
    env: dict[str, str] | None = None,
    check: bool = True,
    tag: str | None = None,
    fail_grace_s: float = 20.0,
) -> list[RankResult]:
    """Run ``worker`` of ``module_file`` in ``world`` processes; return their results.

    All processes are killed after ``timeout_s``, or ``fail_grace_s`` after the
    first one exits with an error (its peers are then usually stuck waiting).

    With ``check`` (default) raise :class:`WorkerFailed` — with every failing
    rank's traceback and stderr tail — unless every rank returned normally.
    """
    for attempt in range(3):
        try:
            return _launch_once(module_file, worker, world, Path(tmp), args, timeout_s, env,
                                check, (tag or f"run-{worker}-{world}") + f"-{attempt}",
                                fail_grace_s)
        except WorkerFailed as exc:
            # free_port() is racy: another program may take the port before rank 0
            # listens on it. Nothing ran yet in that case, so start again.
            if "already in use" not in str(exc).lower() or attempt == 2:
                raise
    raise AssertionError("unreachable")


def _launch_once(module_file: str | os.PathLike[str], worker: str, world: int, tmp: Path,
                 args: Any, timeout_s: float, env: dict[str, str] | None, check: bool,
                 tag: str, fail_grace_s: float) -> list[RankResult]:
    run_dir = tmp / tag
    run_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    base_env = dict(os.environ)
    base_env.update({
        "PYTHONPATH": os.pathsep.join(
            [str(_REPO / "src")] + [p for p in [base_env.get("PYTHONPATH")] if p]),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "GLOO_SOCKET_IFNAME": "lo",
        "WORLD_SIZE": str(world),
        # small, quiet, bounded processes on a shared 2-core machine
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "TF_CPP_MIN_LOG_LEVEL": "3",
        "PYTHONFAULTHANDLER": "1",
        # lets test modules skip pytest-only imports (e.g. jax in a torch worker)
        "STATESTREAM_TEST_WORKER": "1",
    })
    if env:
        base_env.update(env)
    procs: list[subprocess.Popen[bytes]] = []
    errs: list[Any] = []
    try:
        for rank in range(world):
            e = dict(base_env, RANK=str(rank), LOCAL_RANK=str(rank))
            err = open(run_dir / f"stderr-{rank}.txt", "wb")
            errs.append(err)
            procs.append(subprocess.Popen(
                [PYTHON, str(_HERE), str(Path(module_file).resolve()), worker, str(rank),
                 str(world), str(port), str(run_dir), json.dumps(args)],
                env=e, stdin=subprocess.DEVNULL, stdout=err, stderr=subprocess.STDOUT,
                start_new_session=True, cwd=str(run_dir),
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            ))
        deadline = time.monotonic() + timeout_s
        timed_out = False
        first_failure: float | None = None
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if first_failure is None and any(p.poll() not in (None, 0) for p in procs):
                first_failure = now
                deadline = min(deadline, now + fail_grace_s)
            if now > deadline:
                timed_out = True
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    p.kill()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:  # pragma: no cover - unkillable
                pass
        for f in errs:
            f.close()
    results = []
    for rank, p in enumerate(procs):
        value, error = None, None
        rfile = run_dir / f"result-{rank}.json"
        if rfile.exists():
            doc = json.loads(rfile.read_text())
            value, error = doc.get("value"), doc.get("error")
        elif p.returncode != 0:
            error = f"rank {rank} exited with code {p.returncode} and wrote no result"
        results.append(RankResult(rank, p.returncode, value, error,
                                  _tail(run_dir / f"stderr-{rank}.txt")))
    if timed_out:
        why = (f"did not finish within {timeout_s:g}s" if first_failure is None else
               f"had a rank fail and the others did not finish within {fail_grace_s:g}s of it")
        raise WorkerFailed(f"{worker} on {world} processes {why}; killed.\n"
                           + _describe(results, only_failed=False))
    if check and any(r.returncode != 0 or r.error for r in results):
        raise WorkerFailed(f"{worker} failed on some rank:\n" + _describe(results, True))
    return results


def _describe(results: list[RankResult], only_failed: bool) -> str:
    parts = []
    for r in results:
        if only_failed and r.returncode == 0 and not r.error:
            continue
        parts.append(f"--- rank {r.rank} (exit code {r.returncode}) ---\n"
                     f"{r.error or '(no error reported)'}\n--- stderr tail ---\n{r.stderr}")
    return "\n".join(parts)


def _child_main() -> None:
    module_file, worker, rank, world, port, run_dir, args = sys.argv[1:8]
    rank_i = int(rank)
    out = Path(run_dir) / f"result-{rank_i}.json"
    code = 0
    try:
        import importlib.util

        name = "_ssmp_" + Path(module_file).stem
        spec = importlib.util.spec_from_file_location(name, module_file)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        ctx = Context(rank_i, int(world), int(port), run_dir, json.loads(args))
        value = getattr(mod, worker)(ctx)
        doc = {"value": value, "error": None}
    except BaseException:  # noqa: BLE001 - report everything to the parent
        doc = {"value": None, "error": traceback.format_exc()}
        code = 1
    tmp = out.with_suffix(".part")
    tmp.write_text(json.dumps(doc, default=repr))
    os.replace(tmp, out)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: process-group and runtime destructors can block
    # when a peer is gone (the failure tests leave peers behind on purpose).
    os._exit(code)


if __name__ == "__main__":
    _child_main()
