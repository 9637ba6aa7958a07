"""Peak memory of decoding a manifest, as a multiple of its size.

Each case runs in a fresh process: the manifest's bytes are built first, then
``read_manifest``'s path (bytes -> text, bytes dropped, ``decode_manifest``)
runs under tracemalloc. Reported: peak and retained (the decoded Manifest)
over the manifest's size, and the decode time, for the form a writer picks
(a table, format v3, from ``ARRAY_TABLE_MIN`` arrays on) and for the same
content written as a v1 list.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_manifest_memory.py
"""

from __future__ import annotations

import subprocess
import sys

CASES = {
    # a model: many tensors, one chunk each, long key names, attrs on every leaf
    "100k arrays x 1 chunk": (100_000, 1),
    # few arrays split into many chunks (a sharded run)
    "1k arrays x 128 chunks": (1_000, 128),
    # one array, a million chunks
    "1 array x 1M chunks": (1, 1_000_000),
}

CHILD = r"""
import gc, sys, time, tracemalloc
import statestream.format._manifest as _m
if len(sys.argv) > 3 and sys.argv[3] == "v1":  # the list form, whatever the size
    _m.ARRAY_TABLE_MIN = 1 << 62
from statestream.format import (ArrayEntry, ChunkEntry, FileEntry, Manifest, decode_manifest,
                                encode_manifest)
from statestream.tree import Node

def build(n_arrays, per):
    arrays, leaves, keys, off = [], [], [], 0
    rows = max(per, 4096)
    for i in range(n_arrays):
        cs = []
        r = rows // per
        for j in range(per):
            nb = r * 1024 * 4
            cs.append(ChunkEntry(0, off, nb, (i * 7919 + j) & 0xFFFFFFFF, (j * r, 0), (r, 1024)))
            off += nb
        arrays.append(ArrayEntry("float32", (r * per, 1024), tuple(cs)))
        leaves.append(Node("array", array=i, attrs={"kind": "torch"}))
        keys.append(f"model.layers.{i // 10}.mlp.weight_{i % 10}")
    tree = Node("dict", keys=["model"], children=[Node("dict", keys=keys, children=leaves)])
    return encode_manifest(Manifest(tree=tree, arrays=arrays,
                                    files=[FileEntry("data/r0-0.bin", off)]))

data = build(int(sys.argv[1]), int(sys.argv[2]))
size = len(data)
t = time.perf_counter()  # time without tracemalloc, which slows allocation down a lot
decode_manifest(data.decode("utf-8"), "bench")
dt = time.perf_counter() - t
gc.collect()
tracemalloc.start()
text = data.decode("utf-8")
del data  # as read_manifest does
m = decode_manifest(text, "bench")
del text
cur, peak = tracemalloc.get_traced_memory()
print(size, peak, cur, dt)
"""


def measure(n_arrays: int, per: int, form: str = "default") -> tuple[int, float, float, float]:
    """(manifest bytes, peak / size, retained / size, seconds) in a fresh process;
    ``form`` "v1" writes the list form whatever the number of arrays."""
    r = subprocess.run([sys.executable, "-c", CHILD, str(n_arrays), str(per), form],
                       capture_output=True, text=True, check=True)
    size, peak, cur, dt = r.stdout.split()
    return int(size), int(peak) / int(size), int(cur) / int(size), float(dt)


def main() -> None:
    print("| manifest | form | size | peak | retained | peak MB | retained MB | decode s |")
    print("|---|---|---|---|---|---|---|---|")
    for name, (n, per) in CASES.items():
        for form in ("default", "v1"):
            size, peak, kept, dt = measure(n, per, form)
            print(f"| {name} | {form} | {size / 1e6:.1f} MB | {peak:.2f}x | {kept:.2f}x | "
                  f"{peak * size / 1e6:.1f} | {kept * size / 1e6:.1f} | {dt:.2f} |")


if __name__ == "__main__":
    main()
