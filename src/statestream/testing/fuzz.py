"""Fuzzing hostile checkpoints: Hypothesis mutations and a sandboxed runner.

A *mutation* is a small plain tuple (so Hypothesis can shrink and print it)
that damages a copy of a real checkpoint: an edited manifest field (then
re-sealed, so the commit marker's size and CRC match and the edit reaches
the decoder), flipped manifest bytes, a rewritten commit marker, a
truncated, extended, flipped or missing data file, an unlisted file, or a
FIFO, directory or symbolic link in place of any of them.

:func:`run_targets` then runs ``load`` (whole and with ``items=``),
``metadata``, ``verify`` and the CLI's ``inspect`` and ``verify`` against
it in a child process that has an address-space limit (``RLIMIT_AS``) and
is killed after a wall-clock timeout. Each target must end in a result or a
:class:`~statestream.errors.CheckpointError`; anything else (another
exception, a traceback from the CLI, a timeout, a crash) is reported.

Needs ``hypothesis`` (a test dependency).

Example:
    >>> from hypothesis import given, settings
    >>> import numpy as np, os, tempfile, statestream as ss
    >>> base = os.path.join(tempfile.mkdtemp(), "base")
    >>> ss.save(base, {"w": np.arange(8.0), "step": 1})
    >>> @settings(max_examples=2, deadline=None, database=None)
    ... @given(mutations())
    ... def check(muts):
    ...     path = apply_to_copy(base, muts)
    ...     assert not failures(run_targets(path, timeout_s=60))
    >>> check()
"""

from __future__ import annotations

import contextlib
import io
import json
import multiprocessing
import os
import shutil
import tempfile
import traceback
from typing import Any

from hypothesis import strategies as st

from statestream.format import COMMIT_NAME, MANIFEST_NAME, encode_commit

__all__ = [
    "TARGETS",
    "apply_bytes_to_copy",
    "apply_mutations",
    "apply_to_copy",
    "byte_mutations",
    "failures",
    "failures_of_copy",
    "json_values",
    "mutations",
    "run_targets",
]

Mutation = tuple[Any, ...]

#: What each example is run against.
TARGETS = ("load", "load_items", "metadata", "verify", "cli_inspect", "cli_verify",
           "convert")

_INTERESTING_INTS = [0, 1, -1, 2, 7, 255, 4096, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**48,
                     2**48 + 1, 2**52, 2**62, 2**63 - 1, 2**63, 2**64, 10**12, 4 * 10**12,
                     -(2**63), 10**400]
_WEIRD_STRINGS = ["", "data/r0-0.bin", "data/../manifest.json", "../x", "/etc/passwd",
                  "data/x\x00", "\ud800", "\x1b[2J", "a\nb", "float32", "uint8", "object",
                  "dict", "list", "array", "bytes", "pickle", "stateful", "int", "str",
                  "nan", "inf", "-0x1p-1074", "0x1.8p1", "ff", "-", "crc32c", "statestream"]


def json_values(max_leaves: int = 6) -> st.SearchStrategy[Any]:
    """JSON values biased towards what breaks decoders: edge integers, near-valid
    strings, wrong types and small containers."""
    base = st.one_of(
        st.none(), st.booleans(), st.sampled_from(_INTERESTING_INTS),
        st.integers(-(2**70), 2**70),
        st.floats(allow_nan=False, allow_infinity=False), st.sampled_from(_WEIRD_STRINGS),
        st.text(max_size=8),
    )
    return st.recursive(base, lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.sampled_from(["t", "k", "c", "v", "a", "x", "n", "dtype", "shape",
                                         "chunks"]), inner, max_size=4),
    ), max_leaves=max_leaves)


_SPECIAL_KINDS = ("fifo", "dir", "symlink_out", "symlink_loop", "missing", "empty")
_FILE_TARGETS = ("manifest", "commit", "data", "data_dir")


def mutations() -> st.SearchStrategy[list[Mutation]]:
    """Lists of 1-4 mutations (see the module docstring)."""
    sel = st.integers(0, 10**6)
    one = st.one_of(
        st.tuples(st.just("set"), sel, json_values()),
        st.tuples(st.just("set"), sel, st.sampled_from(_INTERESTING_INTS)),
        st.tuples(st.just("delete"), sel),
        st.tuples(st.just("dup"), sel),
        st.tuples(st.just("swap"), sel, sel),
        st.tuples(st.just("flip_manifest"), sel, st.integers(1, 255)),
        st.tuples(st.just("marker"), st.one_of(json_values(), st.binary(max_size=64))),
        st.tuples(st.just("truncate"), sel, st.floats(0, 1)),
        st.tuples(st.just("append"), sel, st.integers(1, 5000)),
        st.tuples(st.just("flip_data"), sel, st.integers(1, 255)),
        st.tuples(st.just("special"), st.sampled_from(_FILE_TARGETS), sel,
                  st.sampled_from(_SPECIAL_KINDS)),
        st.tuples(st.just("extra"), st.sampled_from(["data/zz.bin", "junk", ".hidden"])),
    )
    return st.tuples(st.lists(one, min_size=1, max_size=4),
                     st.sampled_from([True, True, True, False])).map(
        lambda t: [*t[0], ("reseal", t[1])])


# ----------------------------------------------------------------------------- mutate


def _slots(doc: Any) -> list[tuple[Any, Any]]:
    """Every (container, key/index) of a JSON document, depth first."""
    out: list[tuple[Any, Any]] = []
    stack = [doc]
    while stack:
        x = stack.pop()
        items = x.items() if isinstance(x, dict) else enumerate(x) if isinstance(x, list) else ()
        for k, v in items:
            out.append((x, k))
            if isinstance(v, (dict, list)):
                stack.append(v)
    return out


def _edit_doc(doc: Any, m: Mutation) -> None:
    slots = _slots(doc)
    if not slots:
        return
    parent, key = slots[m[1] % len(slots)]
    if m[0] == "set":
        parent[key] = m[2]
    elif m[0] == "delete":
        del parent[key]
    elif m[0] == "dup" and isinstance(parent, list):
        parent.insert(key, json.loads(json.dumps(parent[key])))
    elif m[0] == "swap":
        other_parent, other_key = slots[m[2] % len(slots)]
        if other_parent is parent and other_key != key:
            parent[key], parent[other_key] = parent[other_key], parent[key]


def _data_files(path: str) -> list[str]:
    d = os.path.join(path, "data")
    return sorted(os.path.join("data", n) for n in os.listdir(d)) if os.path.isdir(d) else []


def _pick(path: str, sel: int) -> str | None:
    files = _data_files(path)
    return files[sel % len(files)] if files else None


def _special(path: str, which: str, sel: int, kind: str) -> None:
    name = {"manifest": MANIFEST_NAME, "commit": COMMIT_NAME, "data_dir": "data"}.get(which)
    name = name if name is not None else _pick(path, sel)
    if name is None:
        return
    p = os.path.join(path, name)
    if os.path.isdir(p) and not os.path.islink(p):
        shutil.rmtree(p)
    elif os.path.lexists(p):
        os.unlink(p)
    if kind == "fifo":
        os.mkfifo(p)
    elif kind == "dir":
        os.mkdir(p)
    elif kind == "symlink_out":
        outside = os.path.join(os.path.dirname(path), "outside")
        with open(outside, "wb") as f:
            f.write(b"\0" * 4096)
        os.symlink(outside, p)
    elif kind == "symlink_loop":
        os.symlink(os.path.basename(p), p)
    elif kind == "empty":
        open(p, "wb").close()
    # "missing": stays deleted


def _on_file(path: str, m: Mutation) -> None:
    name = _pick(path, m[1])
    if name is None or not os.path.isfile(os.path.join(path, name)):
        return
    p = os.path.join(path, name)
    size = os.path.getsize(p)
    if m[0] == "truncate":
        os.truncate(p, int(size * m[2]))
    elif m[0] == "append":
        with open(p, "ab") as f:
            f.write(b"\xa5" * m[2])
    elif m[0] == "flip_data" and size:
        with open(p, "r+b") as f:
            f.seek(m[1] % size)
            b = f.read(1)
            f.seek(m[1] % size)
            f.write(bytes([b[0] ^ m[2]]))


def apply_mutations(path: str, muts: list[Mutation]) -> None:
    """Damage the checkpoint at ``path`` in place."""
    mpath = os.path.join(path, MANIFEST_NAME)
    try:
        with open(mpath, "rb") as f:
            raw = f.read()
        doc: Any = json.loads(raw)
    except (OSError, ValueError):
        raw, doc = b"", None
    for m in muts:
        if m[0] in ("set", "delete", "dup", "swap") and doc is not None:
            _edit_doc(doc, m)
            raw = json.dumps(doc, separators=(",", ":")).encode()
        elif m[0] == "flip_manifest" and raw:
            b = bytearray(raw)
            b[m[1] % len(b)] ^= m[2]
            raw = bytes(b)
        elif m[0] == "marker":
            v = m[1]
            data = v if isinstance(v, bytes) else json.dumps(v).encode()
            _write_if_file(os.path.join(path, COMMIT_NAME), data)
        elif m[0] in ("truncate", "append", "flip_data"):
            _on_file(path, m)
        elif m[0] == "special":
            _special(path, m[1], m[2], m[3])
        elif m[0] == "extra":
            _write_if_file(os.path.join(path, m[1]), b"extra")
        elif m[0] == "reseal" and raw:
            if _write_if_file(mpath, raw) and m[1]:
                _write_if_file(os.path.join(path, COMMIT_NAME), encode_commit(raw))


def _write_if_file(p: str, data: bytes) -> bool:
    """Write ``data`` to ``p`` unless a mutation put a special file there."""
    if os.path.lexists(p) and not (os.path.isfile(p) and not os.path.islink(p)):
        return False
    if not os.path.isdir(os.path.dirname(p)):
        return False
    with open(p, "wb") as f:
        f.write(data)
    return True


def apply_to_copy(base: str, muts: list[Mutation]) -> str:
    """A damaged copy of the checkpoint ``base`` in a fresh temporary directory."""
    work = tempfile.mkdtemp(prefix="ss-fuzz-")
    path = os.path.join(work, "ckpt")
    shutil.copytree(base, path)
    apply_mutations(path, muts)
    return path


# ----------------------------------------------------------------------------- foreign

#: 8-byte little-endian values written over a foreign file's bytes (sizes, offsets).
_WIDE = [0, 1, 2**31, 2**32 - 1, 2**63 - 1, 2**64 - 1, 10**12]


def byte_mutations() -> st.SearchStrategy[list[Mutation]]:
    """Lists of 1-3 byte-level edits of any file of a checkpoint in a format of its own
    (safetensors, torch.save, DCP, a Hugging Face directory): a byte set anywhere or
    in the first 600 bytes (headers, zip entry names), an 8-byte integer written
    over, a truncation, appended garbage; or an edit of a JSON document inside a
    file (a safetensors header, re-sealed with its new length so the edit reaches
    the parser; a ``.json`` index), as the format fuzzer edits manifests."""
    sel = st.integers(0, 10**9)
    edit = st.one_of(
        st.tuples(st.just("set"), sel, json_values()),
        st.tuples(st.just("set"), sel, st.sampled_from(_INTERESTING_INTS)),
        st.tuples(st.just("delete"), sel),
        st.tuples(st.just("swap"), sel, sel),
    )
    one = st.one_of(
        st.tuples(st.just("json"), sel, edit),
        st.tuples(st.just("byte"), sel, sel, st.integers(0, 255)),
        st.tuples(st.just("head"), sel, st.integers(0, 599), st.integers(0, 255)),
        st.tuples(st.just("wide"), sel, sel, st.sampled_from(_WIDE)),
        st.tuples(st.just("cut"), sel, st.floats(0, 1)),
        st.tuples(st.just("grow"), sel, st.binary(min_size=1, max_size=64)),
    )
    return st.lists(one, min_size=1, max_size=3)


def _files_of(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs)


def _edit_json_in(f: str, data: bytearray, edit: Mutation) -> bytearray:
    """``edit`` applied to the JSON document of file ``f``: a ``.json`` file, or the
    header of a ``.safetensors`` file (its 8-byte length rewritten); else unchanged."""
    try:
        if f.endswith(".json"):
            doc = json.loads(bytes(data))
            _edit_doc(doc, edit)
            return bytearray(json.dumps(doc).encode())
        if f.endswith(".safetensors") and len(data) >= 8:
            n = int.from_bytes(data[:8], "little")
            doc = json.loads(bytes(data[8:8 + n]))
            _edit_doc(doc, edit)
            head = json.dumps(doc).encode()
            return bytearray(len(head).to_bytes(8, "little") + head + data[8 + n:])
    except (ValueError, TypeError, RecursionError):  # already damaged, or not JSON
        pass
    return data


def apply_bytes_to_copy(base: str, muts: list[Mutation]) -> str:
    """A copy of the file or directory ``base``, in a fresh temporary directory under
    the same name, damaged by :func:`byte_mutations`."""
    work = tempfile.mkdtemp(prefix="ss-fuzz-")
    path = os.path.join(work, os.path.basename(base))
    (shutil.copytree if os.path.isdir(base) else shutil.copyfile)(base, path)
    files = _files_of(path)
    for m in muts:
        f = files[m[1] % len(files)]
        with open(f, "rb") as fh:
            data = bytearray(fh.read())
        if m[0] == "json":
            data = _edit_json_in(f, data, m[2])
        elif m[0] in ("byte", "head", "wide") and data:
            at = m[2] % len(data) if m[0] != "head" else min(m[2], len(data) - 1)
            new = m[3].to_bytes(8, "little") if m[0] == "wide" else bytes([m[3]])
            data[at:at + len(new)] = new
        elif m[0] == "cut":
            del data[int(len(data) * m[2]):]
        elif m[0] == "grow":
            data += m[2]
        with open(f, "wb") as fh:
            fh.write(bytes(data))
    return path


# ----------------------------------------------------------------------------- run


def _outcome(fn: Any) -> str:
    import statestream as ss

    try:
        fn()
    except ss.CheckpointError as exc:
        return f"error {type(exc).__name__}"
    except BaseException as exc:
        return f"ESCAPED {type(exc).__name__}: {exc!s:.300}\n{traceback.format_exc()[-3000:]}"
    return "ok"


def _cli(args: list[str]) -> None:
    from statestream.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(args)
    if rc not in (0, 1, 2) or "Traceback" in err.getvalue():
        raise AssertionError(f"CLI {args} exited {rc}: {err.getvalue()[-2000:]}")
    out.getvalue().encode("utf-8")  # printable on any UTF-8 terminal
    err.getvalue().encode("utf-8")


def _convert(path: str) -> None:
    """Convert to a statestream checkpoint in a scratch directory (removed after)."""
    import statestream as ss

    out = tempfile.mkdtemp(prefix="ss-fuzz-out-")
    try:
        ss.convert(path, os.path.join(out, "ck"), io=ss.IOOptions(num_threads=2))
    finally:
        shutil.rmtree(out, ignore_errors=True)


def _vm_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def _child(path: str, memory_bytes: int, conn: Any) -> None:
    import resource

    import statestream as ss

    limit = _vm_bytes() + memory_bytes
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    io_opts = ss.IOOptions(num_threads=2)
    results = {
        "load": _outcome(lambda: ss.load(path, io=io_opts)),
        "load_items": _outcome(lambda: ss.load(path, items=["params"], io=io_opts)),
        "metadata": _outcome(lambda: ss.metadata(path)),
        "verify": _outcome(lambda: ss.verify(path, io=io_opts)),
        "cli_inspect": _outcome(lambda: _cli(["inspect", "--all", path])),
        "cli_verify": _outcome(lambda: _cli(["verify", path])),
        "cli_diff": _outcome(lambda: _cli(["diff", path, path])),
        "cli_ls": _outcome(lambda: _cli(["ls", os.path.dirname(path)])),
        "convert": _outcome(lambda: _convert(path)),
    }
    conn.send(results)
    conn.close()


_CTX: Any = None


def _context() -> Any:
    global _CTX
    if _CTX is None:
        # a clean server process forks each example: fast, and free of the
        # parent's threads (pytest, torch, JAX) that make plain fork unsafe
        _CTX = multiprocessing.get_context("forkserver")
        _CTX.set_forkserver_preload(["numpy", "statestream", "statestream.cli",
                                     "statestream.testing.fuzz"])
    return _CTX


def run_targets(path: str, *, timeout_s: float = 60.0,
                memory_bytes: int = 1 << 30) -> dict[str, str]:
    """Run every target against ``path`` in a sandboxed child; outcome per target.

    An outcome is ``"ok"``, ``"error <CheckpointError subclass>"``,
    ``"ESCAPED ..."`` (any other exception, with its traceback), or for the
    whole child ``"TIMEOUT"`` / ``"CRASHED ..."``. The child may allocate at
    most ``memory_bytes`` beyond what it had at start.
    """
    ctx = _context()
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(path, memory_bytes, send), daemon=True)
    proc.start()
    send.close()
    try:
        if recv.poll(timeout_s):
            try:
                res: dict[str, str] = recv.recv()
            except EOFError:
                res = {}
        else:
            res = {"all": "TIMEOUT"}
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(10)
        recv.close()
    if not res:
        res = {"all": f"CRASHED exit code {proc.exitcode}"}
    return res


def failures_of_copy(path: str, *, timeout_s: float = 60.0,
                     memory_bytes: int = 1 << 30) -> str:
    """Run every target against the damaged copy at ``path`` (from
    :func:`apply_to_copy` or :func:`apply_bytes_to_copy`), remove the copy's
    temporary directory, and describe the failures ("" when there are none)."""
    try:
        res = run_targets(path, timeout_s=timeout_s, memory_bytes=memory_bytes)
    finally:
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)
    return "\n".join(f"{k}: {v}" for k, v in failures(res).items())


def failures(results: dict[str, str]) -> dict[str, str]:
    """The outcomes that are neither a result nor a CheckpointError."""
    return {k: v for k, v in results.items() if not (v == "ok" or v.startswith("error "))}
