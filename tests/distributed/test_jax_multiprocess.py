"""Two real JAX processes on the CPU (2 host devices each, a 4-device global mesh).

Each process runs ``jax.distributed.initialize`` with a loopback coordinator
and gloo CPU collectives; ``ss.save``/``ss.load`` pick the JaxCollective
themselves. Arrays are built with ``jax.make_array_from_callback``, sharded
within a process, across processes, and replicated. Workers report back;
assertions are made here, including a NumPy load in the pytest process.
"""

from __future__ import annotations

import math
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _launch import Context, launch  # noqa: E402

if not os.environ.get("STATESTREAM_TEST_WORKER"):
    pytest.importorskip("jax")

import statestream as ss  # noqa: E402
from statestream.api._load import open_checkpoint  # noqa: E402

THIS = os.path.abspath(__file__)
WORLD = 2
ENV = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
LAUNCH_TIMEOUT_S = 120

# name -> (shape, dtype, saved spec, reshard spec) on the 2x2 mesh ("p", "q");
# mesh row p is one process's two devices.
LAYOUTS: dict[str, tuple[tuple[int, ...], str, tuple[Any, ...], tuple[Any, ...]]] = {
    "sharded": ((8, 6), "float32", ("p", "q"), ("q", "p")),
    "within_proc": ((8, 6), "float32", ("p", None), ()),  # replicated on a process's devices
    "across_procs": ((8, 6), "float32", ("q", None), ("p", "q")),  # replicas on both processes
    "replicated": ((8, 3), "float32", (), ("p",)),
    "bf16": ((4, 6), "bfloat16", (None, "q"), ("p", None)),
    "scalar": ((), "int32", (), ()),
}


def expected(name: str, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    salt = sum(map(ord, name)) % 13
    x = (np.arange(math.prod(shape), dtype=np.float64).reshape(shape) % 89) + salt
    if dtype == "bfloat16":
        import ml_dtypes

        return x.astype(ml_dtypes.bfloat16)
    return x.astype(dtype)


def worker(ctx: Context) -> dict[str, Any]:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{ctx.port}", num_processes=ctx.world,
        process_id=ctx.rank, initialization_timeout=90, shutdown_timeout_seconds=30,
    )
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    import statestream as ss
    from statestream.distributed import JaxCollective, default_collective

    rank = ctx.rank
    root = Path(ctx.args["dir"])
    devs = jax.devices()
    mesh = Mesh(np.array(devs).reshape(2, 2), ("p", "q"))
    want = {k: expected(k, v[0], v[1]) for k, v in LAYOUTS.items()}

    def sh(spec: tuple[Any, ...]) -> Any:
        return NamedSharding(mesh, PartitionSpec(*spec))

    def check(name: str, got: Any, w: np.ndarray, sharding: Any, problems: list[str]) -> None:
        if not isinstance(got, jax.Array) or got.shape != w.shape or got.dtype != w.dtype:
            problems.append(f"{name}: {type(got).__name__} {getattr(got, 'shape', '')}")
            return
        if not got.sharding.is_equivalent_to(sharding, got.ndim):
            problems.append(f"{name}: sharding {got.sharding}, want {sharding}")
        for s in got.addressable_shards:
            if not np.array_equal(np.asarray(s.data), w[s.index]):
                problems.append(f"{name}: shard on device {s.device.id} differs")
                return

    def setup() -> Any:
        return {"process_count": jax.process_count(), "devices": len(devs),
                "local_devices": len(jax.local_devices()),
                "collective": type(default_collective()).__name__}

    def save() -> Any:
        arrays = {k: jax.make_array_from_callback(v[0], sh(v[2]), lambda idx, k=k: want[k][idx])
                  for k, v in LAYOUTS.items()}
        ss.save(root / "ck", {"arrays": arrays, f"proc{rank}": np.full(3, rank, np.int64),
                              "step": 2})
        return True

    def load(which: int) -> list[str]:
        like = {k: jax.ShapeDtypeStruct(v[0], want[k].dtype, sharding=sh(v[which]))
                for k, v in LAYOUTS.items()}
        out = ss.load(root / "ck", target={"arrays": like, "step": 0})
        problems: list[str] = []
        if out["step"] != 2:
            problems.append(f"step {out['step']!r}")
        for k, v in LAYOUTS.items():
            check(k, out["arrays"][k], want[k], sh(v[which]), problems)
        return problems

    def per_process_keys() -> list[str]:
        out = ss.load(root / "ck", items=[f"proc{r}" for r in range(ctx.world)])
        return [f"proc{r}" for r in range(ctx.world)
                if not np.array_equal(out[f"proc{r}"], np.full(3, r))]

    def load_failure() -> Any:
        shape = (9, 6) if rank == 1 else (8, 6)
        like = {"arrays": {"sharded": jax.ShapeDtypeStruct(shape, np.float32,
                                                           sharding=sh(("p", None)))}}
        try:
            ss.load(root / "ck", target=like)
        except ss.DistributedError as exc:
            return {"raised": True, "message": str(exc)}
        return {"raised": False, "message": ""}

    def plans() -> Any:
        # a later save of the same structure reuses the plan (no any_true here: the
        # processes agree through an all-gather)
        from statestream import _hooks

        reused: list[int] = []
        _hooks.register("save.plan_reused", lambda: reused.append(1))
        arrays = {k: jax.make_array_from_callback(v[0], sh(v[2]), lambda idx, k=k: want[k][idx])
                  for k, v in LAYOUTS.items()}
        counts = []
        try:
            for step in (1, 2, 3):
                before = len(reused)
                extra = {"more": np.ones(2)} if step == 3 and rank == 0 else {}
                ss.save(root / f"plans{step}", {"arrays": arrays, "step": step,
                                                f"proc{rank}": {"x": np.full(2, step), **extra}})
                counts.append(len(reused) - before)
        finally:
            _hooks.clear()
        out = ss.load(root / "plans2", items=["step", f"proc{rank}"])
        return {"counts": counts, "step": out["step"], "x": out[f"proc{rank}"]["x"].tolist()}

    def gather() -> Any:
        coll = JaxCollective()
        got = coll.gather_object({"rank": rank, "n": [rank] * (100 + rank)}, 1)
        every = coll.all_gather_object(rank)  # the sequences still line up after it
        return {"got": None if got is None else [[g["rank"], len(g["n"])] for g in got],
                "every": every}

    def keys() -> Any:
        # The coordination service keeps every key until the job ends: statestream
        # deletes its own once every process is past them, so saves do not pile up.
        from jax._src import distributed

        from statestream.distributed import _jax

        client = distributed.global_state.client
        coll = JaxCollective()
        # The heartbeat thread deletes the keys queued in _TRASH (once a second, one
        # request per key: ~170 queued after the exchanges below). A fixed sleep(2.5)
        # for it is too short for a heartbeat starved on a loaded machine: wait until
        # every queued key is popped and the beat that popped the last has returned.
        beat = _jax._BEATS[id(client)]
        trash = _jax._TRASH[id(client)]
        beats = [0]
        one_beat = beat._beat

        def counted_beat() -> None:
            one_beat()
            beats[0] += 1

        beat._beat = counted_beat

        def count() -> int:
            coll.all_gather_object(None)  # every process is past what came before
            while trash and beat.alive():  # queued keys are popped, beat after beat
                time.sleep(0.05)
            seen = beats[0]
            while beats[0] == seen and beat.alive():  # the beat that popped the last
                # one has deleted it
                time.sleep(0.05)
            coll.barrier("deleted")  # on every process
            n = len([k for k, _ in client.key_value_dir_get("statestream/")
                     if not k.startswith("statestream/alive/")])
            coll.barrier("counted")
            return n

        before = count()
        for i in range(5):
            ss.save(root / f"keys{i}", {"w": np.full(4, i, np.int64), f"p{rank}": i})
        for i in range(50):
            coll.all_gather_object([rank, i])
            coll.broadcast_object(i if rank == 0 else None)
            coll.gather_object(i, 1)
        return {"before": before, "after": count()}

    def cover() -> Any:
        # a global array saved by process 1 only: the rows of process 0 are held by none
        state: dict[str, Any] = {"step": 1}
        if rank == 1:
            w = want["sharded"]
            state["only1"] = jax.make_array_from_callback(w.shape, sh(("p", "q")),
                                                          lambda idx: w[idx])
        try:
            ss.save(root / "cover" / "ck", state)
        except ss.DistributedError as exc:
            return {"raised": True, "message": str(exc), "left": os.listdir(root / "cover")
                    if (root / "cover").exists() else []}
        return {"raised": False}

    def timeout() -> Any:
        # Last: after a timeout the processes' collective sequences differ.
        coll = JaxCollective(timeout_s=3)
        done = root / "proc0-timed-out"
        if rank == 1:
            deadline = time.monotonic() + 60
            while not done.exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            return {"skipped": True}
        try:
            ss.save(root / "never", {"w": np.ones(3)}, collective=coll)
            return {"type": None, "message": "no error"}
        except Exception as exc:  # noqa: BLE001
            return {"type": type(exc).__name__, "message": str(exc)}
        finally:
            done.touch()

    out: dict[str, Any] = {}
    for name, fn in [("setup", setup), ("save", save), ("same", lambda: load(2)),
                     ("reshard", lambda: load(3)), ("per_process", per_process_keys),
                     ("load_failure", load_failure), ("gather", gather), ("plans", plans),
                     ("keys", keys), ("cover", cover), ("timeout", timeout)]:
        try:
            out[name] = {"ok": True, "value": fn()}
        except BaseException:  # noqa: BLE001
            tb = traceback.format_exc()
            print(f"[process {rank}] check {name} failed:\n{tb}", file=sys.stderr, flush=True)
            out[name] = {"ok": False, "error": tb}
    try:
        jax.distributed.shutdown()
    except Exception:  # noqa: BLE001 - the result is what matters
        traceback.print_exc()
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any]]:
    tmp = tmp_path_factory.mktemp("jax-2proc")
    res = launch(THIS, "worker", WORLD, tmp, args={"dir": str(tmp)}, env=ENV,
                 timeout_s=LAUNCH_TIMEOUT_S)
    setup = res[0].value["setup"]
    if not setup["ok"]:
        pytest.skip(f"multi-process JAX does not start here: {setup['error'][-800:]}")
    return tmp, res


def test_a_save_of_the_same_structure_reuses_the_plan(run: tuple[Path, list[Any]]) -> None:
    _, res = run
    # the first save plans, the second reuses, the third changed process 0's structure
    assert _values(res, "plans") == [{"counts": [0, 1, 0], "step": 2, "x": [2, 2]}] * WORLD


def test_gather_object_to_one_process(run: tuple[Path, list[Any]]) -> None:
    _, res = run
    got = _values(res, "gather")
    assert got[1]["got"] == [[r, 100 + r] for r in range(WORLD)]
    assert got[0]["got"] is None
    assert [g["every"] for g in got] == [list(range(WORLD))] * WORLD


def test_the_coordination_service_does_not_fill_up(run: tuple[Path, list[Any]]) -> None:
    _, res = run
    for got in _values(res, "keys"):
        # 5 saves and 150 exchanges later, no more keys than a few operations leave
        assert got["after"] <= got["before"] + 8, got
        assert got["after"] < 20, got


def test_a_global_array_saved_by_one_process_is_refused_while_planning(
        run: tuple[Path, list[Any]]) -> None:
    _, res = run
    for got in _values(res, "cover"):
        assert got["raised"], got
        assert got["message"].startswith("rank 0 failed during planning: "), got
        assert ("rows 0-3 of key path 'only1' (float32[8, 6]) are held by no rank (24 of its "
                "48 elements are); rank 1 holds elements [4:8, 0:3], elements [4:8, 3:6]; "
                "rank 0 has no such key path") in got["message"], got
        assert got["left"] == [], got


def _values(res: list[Any], check: str) -> list[Any]:
    bad = [f"--- process {r.rank} ---\n{r.value[check]['error']}" for r in res
           if not r.value[check]["ok"]]
    if bad:
        pytest.fail(f"check {check!r} failed:\n" + "\n".join(bad), pytrace=False)
    return [r.value[check]["value"] for r in res]


pytestmark = pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)


def test_two_processes_four_devices(run: tuple[Path, list[Any]]) -> None:
    for v in _values(run[1], "setup"):
        assert v == {"process_count": 2, "devices": 4, "local_devices": 2,
                     "collective": "JaxCollective"}


def test_save_writes_each_box_once_spread_over_processes(run: tuple[Path, list[Any]]) -> None:
    tmp, res = run
    assert _values(res, "save") == [True, True]
    reader, m = open_checkpoint(tmp / "ck")
    reader.close()
    arrays = m.tree.child("arrays")
    assert arrays is not None
    writers = {}
    for k, n in {"sharded": 4, "within_proc": 2, "across_procs": 2, "replicated": 1,
                 "bf16": 2, "scalar": 1}.items():
        node = arrays.child(k)
        assert node is not None and node.array is not None
        a = m.arrays[node.array]
        assert len(a.chunks) == n, (k, [(c.start, c.shape) for c in a.chunks])
        assert sum(c.nbytes for c in a.chunks) == a.nbytes, k
        writers[k] = sorted(m.files[c.file].name.split("-")[0] for c in a.chunks)
    assert writers["within_proc"] == ["data/r0", "data/r1"]
    assert writers["across_procs"] == ["data/r0", "data/r1"]  # replicas split between writers
    assert ss.verify(tmp / "ck").ok


@pytest.mark.parametrize("case", ["same", "reshard"])
def test_load_with_shape_dtype_struct_targets(run: tuple[Path, list[Any]], case: str) -> None:
    assert _values(run[1], case) == [[], []]


def test_per_process_keys(run: tuple[Path, list[Any]]) -> None:
    assert _values(run[1], "per_process") == [[], []]


def test_load_failure_on_one_process_raises_on_both(run: tuple[Path, list[Any]]) -> None:
    for v in _values(run[1], "load_failure"):
        assert v["raised"] and "rank 1" in v["message"] and "arrays/sharded" in v["message"], v


def test_process_that_never_saves_makes_the_other_time_out(run: tuple[Path, list[Any]]) -> None:
    v0, v1 = _values(run[1], "timeout")
    assert v0["type"] == "CollectiveTimeoutError", v0
    assert "process 1 never arrived" in v0["message"], v0
    assert v1 == {"skipped": True}
    with pytest.raises(ss.CheckpointNotFoundError):
        ss.load(run[0] / "never", collective=ss.SingleProcess())


def test_checkpoint_loads_as_numpy_in_pytest_process(run: tuple[Path, list[Any]]) -> None:
    out = ss.load(run[0] / "ck", collective=ss.SingleProcess())
    for k, v in LAYOUTS.items():
        got = out["arrays"][k]
        assert isinstance(got, np.ndarray), k
        np.testing.assert_array_equal(got, expected(k, v[0], v[1]), err_msg=k)
    for r in range(WORLD):
        np.testing.assert_array_equal(out[f"proc{r}"], np.full(3, r))
    assert out["step"] == 2


def worker_hang(ctx: Context) -> None:
    if ctx.rank == 1:
        raise RuntimeError("rank 1 gives up (on purpose)")
    (Path(ctx.args["dir"]) / f"pid-{os.getpid()}").touch()
    time.sleep(600)


def test_launcher_kills_a_hung_worker(tmp_path: Path) -> None:
    """The helper every test here relies on: a hard timeout, tracebacks, no orphans."""
    from _launch import WorkerFailed

    with pytest.raises(WorkerFailed) as info:
        launch(THIS, "worker_hang", 2, tmp_path, args={"dir": str(tmp_path)}, timeout_s=60,
               fail_grace_s=2)
    text = str(info.value)
    assert "did not finish within 2s of it" in text and "gives up (on purpose)" in text, text
    pids = [int(p.name[4:]) for p in tmp_path.glob("pid-*")]
    assert len(pids) == 1
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        # a zombie is gone too; anything else is an orphan
        with open(f"/proc/{pid}/stat") as f:
            assert f.read().split(") ")[1][0] == "Z", f"worker {pid} survived"
