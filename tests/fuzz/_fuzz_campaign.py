"""The randomized round-trip campaign: random states saved with random options, loaded back
bit-exact (tests/fuzz/test_randomized_roundtrip.py runs it).

Run it as a script, in a process of its own (it turns on ``jax_enable_x64`` and asks
XLA for 8 CPU devices before JAX starts)::

    PYTHONPATH=src python tests/fuzz/_fuzz_campaign.py MODE START N [-v]

MODE is ``roundtrip`` (local saves: compression, chunking, budgets, incremental
chains, async and lazy saves mutated after their snapshot, targets, ``items=``),
``s3`` (the same on S3: the endpoint from ``AWS_ENDPOINT_URL``, else a moto
server it starts on loopback), ``convert`` (to safetensors, torch, DCP and back),
``manager`` (CheckpointManager with keep policies) or ``refuse`` (values that
cannot be saved must be refused by key path, leaving no checkpoint). Seeds
START..START+N-1; each failing seed prints its case and the command that replays it.
The exit status is 1 when a case failed. Importing this module does nothing.
"""

from __future__ import annotations

import os
import random
import shutil
import sys
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

if os.path.dirname(os.path.abspath(__file__)) not in sys.path:  # run as a script
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _fuzz_expect import (  # noqa: E402
    Loose,
    diff,
    expect_plain,
    expect_target,
    prune,
    target_of,
)
from _fuzz_states import (  # noqa: E402
    KEYS,
    bad_value,
    is_record,
    rand_state,
    rand_tree,
    rebuild,
    record_fields,
    walk,
)

BUCKET = "statestream-test"


class Fail(Exception):
    """A case whose result is wrong (as opposed to one that raised)."""


def check(cond: bool, msg: str) -> None:
    if not cond:
        raise Fail(msg)


def ss() -> Any:
    import statestream

    return statestream


# ------------------------------------------------------------------ saving
def save_options(rng: random.Random, base: str | None) -> dict[str, Any]:
    opts: dict[str, Any] = {}
    if rng.random() < 0.5:
        opts["io"] = ss().IOOptions(max_chunk_bytes=rng.choice([1, 7, 64, 100, 1000, 4096]),
                                    num_threads=rng.choice([None, 1, 3]))
    if rng.random() < 0.4:
        opts["memory"] = ss().MemoryOptions(
            memory_budget_bytes=rng.choice([1, 100, 4096, 65536]))
    if rng.random() < 0.4:
        opts["compression"] = rng.choice([
            "zstd", ss().Compression("zstd", level=1, shuffle=False), {"**": "zstd"},
            {"a/**": "zstd", "b": None}])
    if base is not None:
        opts["base"] = base
    elif rng.random() < 0.3:
        opts["hashes"] = True
    return opts


def scribble(state: Any, torch_only: bool = False) -> Callable[[], None]:
    """Overwrite every writable array and tensor of ``state`` in place (as a training step
    would after a save's snapshot); returns the function that puts the values back."""
    saved: list[tuple[Any, Any]] = []
    for _, v in walk(state):
        if isinstance(v, np.ndarray) and v.flags.writeable and v.size and 0 not in v.strides \
                and not torch_only:
            saved.append((v, v.copy()))
        elif isinstance(v, torch.Tensor) and v.numel() and 0 not in v.stride():
            saved.append((v, v.detach().clone()))
    for v, old in saved:  # flip the lowest bit of every byte: valid in every dtype
        if isinstance(v, np.ndarray):
            flipped = old.copy()
            flipped.reshape(-1).view(np.uint8)[:] ^= 1
            v[...] = flipped
        else:
            flipped = old.resolve_conj().resolve_neg().clone(memory_format=torch.contiguous_format)
            flipped.reshape(-1).view(torch.uint8).bitwise_xor_(1)
            with torch.no_grad():
                v.detach().copy_(flipped)

    def restore() -> None:
        with torch.no_grad():
            for v, old in reversed(saved):
                v[...] = old
    return restore


def do_save(rng: random.Random, path: str, state: Any, base: str | None) -> str:
    opts = save_options(rng, base)
    mode = rng.choice(["sync", "sync", "async", "lazy"])
    desc = f"save[{mode}] " + ",".join(f"{k}={v!r}" for k, v in opts.items())
    if mode == "sync":
        ss().save(path, state, **opts)
        return desc
    handle = ss().save_async(path, state, lazy=mode == "lazy", **opts)
    if mode == "lazy" and rng.random() < 0.3 and not any(
            isinstance(v, np.ndarray) for _, v in walk(state)):
        return desc + torn_save(handle, path, state, opts)
    restore = None
    if rng.random() < 0.5:  # a training step changes the state once the snapshot is taken
        handle.wait_snapshot()
        restore = scribble(state)
        desc += " (state changed after wait_snapshot)"
    try:
        handle.result()
    finally:
        if restore is not None:
            restore()
    return desc


def torn_save(handle: Any, path: str, state: Any, opts: dict[str, Any]) -> str:
    """Change the torch tensors in place *before* the lazy snapshot is taken (what
    docs/async.md says not to do): torch's version counters must catch it. The save
    either commits the values from before the change (each tensor copied before its
    change) or fails with a CheckpointError and commits nothing; then the state is
    saved again, synchronously, for the rest of the case."""
    restore = scribble(state, torch_only=True)
    try:
        handle.result()
        return " (tensors changed before wait_snapshot: saved)"
    except ss().CheckpointError as e:
        outcome = f" (tensors changed before wait_snapshot: refused: {str(e)[:120]})"
    finally:
        restore()
    try:
        ss().load(path)
    except ss().CheckpointNotFoundError:
        ss().save(path, state, **opts)
        return outcome
    raise Fail(f"a save refused as torn left a checkpoint at {path}")


def mutate(rng: random.Random, state: Any) -> Any:
    """A new state: some NumPy arrays changed, everything else kept."""
    def m(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: m(v) for k, v in x.items()}
        if is_record(x):
            return rebuild(x, [m(v) for _, v in record_fields(x)])
        if isinstance(x, (list, tuple)):
            return type(x)(m(v) for v in x)
        if type(x) is np.ndarray and x.size and rng.random() < 0.5:
            y = np.array(x)
            flat = y.reshape(-1).view(np.uint8)
            flat[rng.randrange(flat.size)] ^= 1 if y.dtype != np.bool_ else 0
            return y
        return x
    return m(state)


# ------------------------------------------------------------------ checks
def check_metadata(path: str, exp: Any) -> None:
    md = ss().metadata(path)
    arrays = {p: a for p, a in _plain_walk(md.tree) if isinstance(a, ss().ArrayMetadata)}
    for p, v in _plain_walk(exp):
        if isinstance(v, (np.ndarray, np.generic)):
            a = arrays.get(p)
            check(a is not None and tuple(a.shape) == v.shape and a.dtype == v.dtype.name,
                  f"metadata at {p}: {a} for {v.dtype}{v.shape}")


def _plain_walk(x: Any, p: tuple[Any, ...] = ()) -> Any:
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _plain_walk(v, p + (k,))
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            yield from _plain_walk(v, p + (i,))
    elif not isinstance(x, Loose):
        yield p, x


def check_plain_loads(states: list[tuple[str, Any]], expected: list[Any]) -> None:
    for (path, _), exp in zip(states, expected):
        d = diff(exp, ss().load(path))
        check(not d, f"load(no target) {path}: {d}")
        rep = ss().verify(path)
        check(rep.ok, f"verify {path}: {rep.problems}")
        check_metadata(path, exp)


def _cli(*argv: str) -> tuple[int, Any]:
    """Run ``statestream ARGV --json`` in this process: (exit status, its parsed output)."""
    import contextlib
    import io
    import json

    from statestream.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([*argv, "--json"])
    text = out.getvalue()

    def strict(c: str) -> None:
        raise Fail(f"statestream {' '.join(argv)} --json wrote {c}, which is not JSON")
    try:
        return rc, json.loads(text, parse_constant=strict) if text.strip() else None
    except ValueError as e:
        raise Fail(f"statestream {' '.join(argv)} --json: {e}: {text[:300]!r} "
                   f"{err.getvalue()[-300:]!r}") from e


def has_int_str_twins(x: Any) -> bool:
    """Does some dict hold an int key and a str key of the same digits?"""
    if isinstance(x, dict):
        if len({str(k) for k in x}) < len(x):
            return True
        return any(has_int_str_twins(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return any(has_int_str_twins(v) for v in x)
    if is_record(x):
        return any(has_int_str_twins(v) for _, v in record_fields(x))
    return False


def check_cli(path: str, st: Any) -> None:
    """inspect, verify and diff (against itself) succeed and write strict JSON."""
    rc, _ = _cli("inspect", "--all", path)
    check(rc == 0, f"statestream inspect --all {path}: exit {rc}")
    rc, rep = _cli("verify", path)
    check(rc == 0 and rep["ok"], f"statestream verify {path}: exit {rc}: {rep}")
    rc, rep = _cli("diff", path, path)
    if rc == 2:
        check(has_int_str_twins(st), f"statestream diff {path} {path}: exit 2")
    else:
        check(rc == 0 and rep["equal"], f"statestream diff {path} {path}: exit {rc}: {rep}")


def check_targets(rng: random.Random, path: str, st: Any, log: list[str]) -> None:
    for mode in rng.sample(["same", "none", "cross"], 2):
        tgt = target_of(rng, st, mode)
        partial = rng.random() < 0.25
        if partial:
            tgt = prune(rng, tgt)
        in_place = mode != "none" and rng.random() < 0.5
        log.append(f"load target={mode} in_place={in_place} partial={partial}")
        try:
            got = ss().load(path, target=tgt, in_place=in_place)
        except (ss().TargetMismatchError, ss().UnsupportedTypeError) as e:
            log.append(f"  refused: {type(e).__name__}: {str(e)[:200]}")
            if mode != "cross":
                raise
            continue
        d = diff(expect_target(st, tgt), got, sharding=mode != "none")
        check(not d, f"load(target={mode}, in_place={in_place}): {d}")
        _check_in_place(tgt, got, in_place, log)


def _check_in_place(tgt: Any, got: Any, in_place: bool, log: list[str]) -> None:
    """in_place=True fills the target's own arrays; without it a target is never written."""
    for pt, tv in walk(tgt):
        if not isinstance(tv, (torch.Tensor, np.ndarray)):
            continue
        gv = get(got, pt)
        if in_place:
            check(gv is tv, f"in_place: {pt} is not the target's {type(tv).__name__} "
                  f"{tv.dtype}{tuple(tv.shape)} but a {type(gv).__name__}")
        else:
            check(not _any_bits(tv), f"in_place=False wrote into the target at {pt}")


def _any_bits(a: Any) -> bool:
    """Is any bit of a (fresh) target array set?"""
    if isinstance(a, torch.Tensor):
        flat = torch.empty(a.numel(), dtype=a.dtype).copy_(a.detach().reshape(-1))
        return bool(a.numel()) and bool(flat.view(torch.uint8).any())
    return bool(np.ascontiguousarray(a).reshape(-1).view(np.uint8).any())


def esc(k: Any) -> str:
    return str(k).replace("~", "~0").replace("/", "~1")


def subpaths(x: Any, p: tuple[Any, ...] = ()) -> Any:
    yield p
    if isinstance(x, dict):
        for k, v in x.items():
            yield from subpaths(v, p + (k,))
    elif is_record(x):
        for k, v in record_fields(x):
            yield from subpaths(v, p + (k,))
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            yield from subpaths(v, p + (i,))


def get(x: Any, path: tuple[Any, ...]) -> Any:
    for k in path:
        x = getattr(x, k) if is_record(x) else x[k]
    return x


def ambiguous(x: Any, path: tuple[Any, ...]) -> bool:
    """Does a segment of path name both an int and a str key of some dict on the way?"""
    for k in path:
        if isinstance(x, dict) and sum(1 for kk in x if str(kk) == str(k)) > 1:
            return True
        x = getattr(x, k) if is_record(x) else x[k]
    return False


def check_items(rng: random.Random, path: str, st: Any, log: list[str]) -> None:
    paths = [p for p in subpaths(st) if p]
    if not paths:
        return
    chosen = rng.sample(paths, min(len(paths), rng.randrange(1, 3)))
    chosen = [c for c in chosen if not any(c != o and c[:len(o)] == o for o in chosen)]
    items = ["/".join(esc(k) for k in c) for c in chosen]
    log.append(f"items={items!r}")
    if any(it in st and (it,) != c for it, c in zip(items, chosen)):
        log.append("  literal top-level key spelled like another item: skipped")
        return
    try:
        got = ss().load(path, items=items)
    except ss().MissingKeyError as e:
        check(any(ambiguous(st, c) for c in chosen) or len(set(items)) < len(items) or any(
            a != b and (a + "/").startswith(b + "/") for a in items for b in items),
            f"items {items} refused: {e}")
        return
    for c in chosen:
        sub = got
        for k in c:
            check(isinstance(sub, (dict, list, tuple)),
                  f"items {items}: level above {c} is {type(sub).__name__}")
            sub = sub[k] if (k in sub if isinstance(sub, dict) else True) else sub[str(k)]
        d = diff(expect_plain(get(st, c)), sub)
        check(not d, f"items {items} at {c}: {d}")


# ------------------------------------------------------------------ cases
def case_roundtrip(seed: int, root: str, log: list[str], s3: bool = False) -> None:
    rng = random.Random(seed)
    kinds = rng.choice([["numpy"], ["torch"], ["jax"], ["numpy", "torch"],
                        ["numpy", "torch", "jax"]])
    state = rand_state(rng, kinds)
    log.append(f"kinds={kinds}")
    base = f"s3://{BUCKET}/fz{seed}-{os.getpid()}" if s3 else os.path.join(root, f"c{seed}")
    expected = [expect_plain(state)]
    log.append(do_save(rng, base + "/s1", state, None))
    states = [(base + "/s1", state)]
    if rng.random() < 0.3:  # an incremental chain
        for i in (2, 3):
            st2 = mutate(rng, states[-1][1])
            expected.append(expect_plain(st2))
            log.append(do_save(rng, base + f"/s{i}", st2, states[-1][0]))
            states.append((base + f"/s{i}", st2))
    check_plain_loads(states, expected)
    path, st = states[-1]
    if rng.random() < 0.3:
        log.append("cli")
        check_cli(path, st)
    check_targets(rng, path, st, log)
    check_items(rng, path, st, log)


def case_s3(seed: int, root: str, log: list[str]) -> None:
    case_roundtrip(seed, root, log, s3=True)


def case_convert(seed: int, root: str, log: list[str]) -> None:
    """statestream -> fmt -> load / back, bit-exact against the statestream load."""
    rng = random.Random(seed * 7919)
    kinds = rng.choice([["numpy"], ["torch"], ["numpy", "torch"]])
    state = {rng.choice(KEYS): rand_tree(rng, 2, kinds, allow_int_keys=rng.random() < 0.3)
             for _ in range(rng.randrange(1, 4))}
    src = os.path.join(root, "src")
    ss().save(src, state, compression="zstd" if rng.random() < 0.3 else None)
    ref = ss().load(src)
    for fmt, dst in rng.sample([("safetensors", "o.safetensors"), ("torch", "o.pt"),
                                ("dcp", "dcp"), ("statestream", "ss2")], 2):
        _convert_one(rng, src, state, ref, fmt, os.path.join(root, dst), log)


def _convert_one(rng: random.Random, src: str, state: Any, ref: Any, fmt: str, dst: str,
                 log: list[str]) -> None:
    items, want = None, ref
    if rng.random() < 0.3:
        k0 = rng.choice(list(state))
        items = [esc(k0)]
        if items[0] in state and items[0] != k0:  # names that literal top-level key
            return
        want = ss().load(src, items=items)[k0]
        if not isinstance(want, dict):
            return
    try:
        ss().convert(src, dst, to=fmt, items=items)
    except ss().CheckpointError as e:
        log.append(f"convert {fmt} refused {type(e).__name__}: {str(e)[:150]}")
        return
    got = ss().load(dst)
    d = diff(as_converted(want, fmt), got)
    check(not d, f"convert {fmt}: {d}")
    back = dst + "-back"
    ss().convert(dst, back)
    d2 = diff(got, ss().load(back))
    check(not d2, f"convert {fmt} -> statestream: {d2}")


def as_converted(x: Any, fmt: str, walked: bool = True) -> Any:
    """What a state loads as after a convert to ``fmt``, as docs/interop.md says: torch and
    DCP turn a NumPy scalar into a 0-d array; DCP keys are strings, and it drops empty
    dicts (with a warning) where its flattening walks: dicts, and lists holding an array,
    a dict or such a list. A tuple, or a list of plain values, is one DCP item, kept
    whole with any empty dict and any key that is no string in it. ``walked``: whether
    DCP walks into ``x``."""
    if isinstance(x, dict):
        out = {str(k) if fmt == "dcp" and walked else k: as_converted(v, fmt, walked)
               for k, v in x.items()}
        if fmt == "dcp" and walked:
            out = {k: v for k, v in out.items() if not (isinstance(v, dict) and not v)}
        return out
    if isinstance(x, (list, tuple)):
        inner = walked and isinstance(x, list) and _dcp_walks(x)
        return type(x)(as_converted(v, fmt, inner) for v in x)
    if isinstance(x, np.generic) and fmt in ("torch", "dcp"):
        return np.asarray(x)
    return x


def _dcp_walks(x: list[Any]) -> bool:
    """Whether DCP's flattening walks into the list ``x`` (interop/_dcpwrite.py)."""
    return any(isinstance(v, (np.ndarray, np.generic, dict))
               or isinstance(v, list) and _dcp_walks(v) for v in x)


def case_manager(seed: int, root: str, log: list[str]) -> None:
    rng = random.Random(seed * 31 + 7)
    kinds = rng.choice([["numpy"], ["torch"], ["numpy", "torch"], ["jax", "numpy"]])
    state = rand_state(rng, kinds)
    s = ss()
    keep = rng.choice([None, s.KeepLatest(1), s.KeepLatest(2), s.KeepEvery(2),
                       s.KeepUnion(s.KeepLatest(1), s.KeepBest(1, "loss"))])
    kw = dict(keep_policy=keep, async_save=rng.random() < 0.6, lazy=rng.random() < 0.3,
              incremental=rng.random() < 0.5, compression=rng.choice([None, "zstd"]),
              io=rng.choice([None, s.IOOptions(max_chunk_bytes=64)]),
              memory=rng.choice([None, s.MemoryOptions(memory_budget_bytes=512)]))
    log.append(f"manager {kw}")
    states = {}
    with s.CheckpointManager(os.path.join(root, "mgr"), **kw) as mgr:
        step = 0
        for _ in range(rng.randrange(2, 6)):
            step += rng.randrange(1, 3)
            state = mutate(rng, state)
            states[step] = expect_plain(state)
            mgr.save(step, state, metrics={"loss": rng.random()})
        mgr.wait()
        steps = mgr.steps()
        log.append(f"steps {list(states)} kept {steps}")
        check(max(states) in steps, f"latest step not kept: {steps}")
        for s_ in steps:
            d_ = diff(states[s_], mgr.load(s_))
            check(not d_, f"manager load({s_}): {d_}")
            check(s.verify(mgr.step_path(s_)).ok, f"verify step {s_}")
        d_ = diff(states[max(states)], mgr.load())
        check(not d_, f"manager load(): {d_}")


def case_refuse(seed: int, root: str, log: list[str]) -> None:
    """A value statestream cannot store, somewhere in a good state: the save names its key
    path (an UnsupportedTypeError) and leaves nothing a load would take."""
    rng = random.Random(seed * 13 + 5)
    state = rand_state(rng, ["numpy", "torch"], depth=2)
    what, bad, where = bad_value(rng)
    state["bad"] = {where: bad}
    log.append(f"bad value: {what} at bad/{where}")
    path = os.path.join(root, "r")
    try:
        ss().save(path, state)
    except ss().UnsupportedTypeError as e:
        check(f"'bad/{where}" in str(e) or "'bad'" in str(e), f"{what}: message lacks the "
              f"key path bad/{where}: {e}")
    else:
        raise Fail(f"{what}: saved without an error")
    try:
        ss().load(path)
    except ss().CheckpointNotFoundError:
        return
    raise Fail(f"{what}: a refused save left a checkpoint")


CASES: dict[str, Callable[[int, str, list[str]], None]] = {
    "roundtrip": case_roundtrip, "s3": case_s3, "convert": case_convert,
    "manager": case_manager, "refuse": case_refuse}


# ------------------------------------------------------------------ driver
def setup_process() -> None:
    """Before JAX starts a backend: 8 CPU devices and 64-bit types."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_enable_x64", True)


def start_s3() -> Any:
    """A moto server on loopback, for a campaign run by hand (the test passes its own)."""
    import logging

    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    srv = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    srv.start()
    host, port = srv.get_host_and_port()
    ep = f"http://{host}:{port}"
    os.environ.update(AWS_ENDPOINT_URL=ep, AWS_ALLOW_HTTP="true", AWS_REGION="us-east-1",
                      AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing-secret")
    boto3.client("s3", endpoint_url=ep, region_name="us-east-1").create_bucket(Bucket=BUCKET)
    return srv


def run_one(mode: str, seed: int, verbose: bool) -> bool:
    root = tempfile.mkdtemp(prefix=f"fz{seed}-")
    log: list[str] = []
    try:
        CASES[mode](seed, root, log)
    except Exception as e:  # noqa: BLE001 - every failure is reported with its seed
        kind = "FAIL" if isinstance(e, Fail) else f"ERROR {type(e).__name__}"
        tb = "" if isinstance(e, Fail) else "".join(traceback.format_exception(e))[-3000:]
        print(f"seed {seed} ({mode}): {kind}: {str(e)[:1500]}\n  case: {log}\n{tb}"
              f"  replay: PYTHONPATH=src python tests/fuzz/_fuzz_campaign.py {mode} {seed} 1 -v",
              flush=True)
        return False
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if verbose:
        print(f"seed {seed} ({mode}): ok {log}", flush=True)
    return True


def main(argv: list[str]) -> int:
    mode, start, n = argv[0], int(argv[1]), int(argv[2])
    setup_process()
    srv = start_s3() if mode == "s3" and "AWS_ENDPOINT_URL" not in os.environ else None
    try:
        fails = sum(not run_one(mode, seed, "-v" in argv) for seed in range(start, start + n))
    finally:
        if srv is not None:
            srv.stop()
    print(f"done {n} {mode} cases from seed {start}: {fails} failing", flush=True)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
