"""Property tests: load(save(x)) == x for random trees of arrays and plain values."""

from __future__ import annotations

import itertools
import shutil
import tempfile

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import statestream as ss
from statestream.format import DTYPE_NAMES, dtype_name
from statestream.testing import strategies as sst

_SETTINGS = settings(max_examples=25, deadline=None, derandomize=False,
                     suppress_health_check=[HealthCheck.too_slow,
                                            HealthCheck.function_scoped_fixture])
_counter = itertools.count()


@pytest.fixture(scope="module")
def workdir():
    d = tempfile.mkdtemp(prefix="ss-prop-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _path(workdir):
    return f"{workdir}/c{next(_counter)}"


@settings(_SETTINGS, max_examples=40)
@given(state=sst.trees())
def test_roundtrip_random_trees(workdir, state):
    p = _path(workdir)
    ss.save(p, state)
    sst.assert_tree_equal(ss.load(p), state)


@_SETTINGS
@given(state=sst.trees(sst.array_leaves(), max_leaves=8),
       chunk=st.sampled_from([1, 7, 64, 1 << 20]),
       budget=st.sampled_from([1, 100, None]),
       threads=st.integers(1, 3))
def test_roundtrip_chunking_and_budget(workdir, state, chunk, budget, threads):
    p = _path(workdir)
    io = ss.IOOptions(max_chunk_bytes=chunk, num_threads=threads, max_request_bytes=max(chunk, 64))
    mem = ss.MemoryOptions(memory_budget_bytes=budget)
    ss.save(p, state, io=io, memory=mem)
    sst.assert_tree_equal(ss.load(p, io=io, memory=mem), state)
    assert ss.verify(p, io=io, memory=mem).ok


@_SETTINGS
@given(a=sst.arrays(), data=st.data())
def test_array_with_numpy_target_of_same_layout(workdir, a, data):
    """A target array of the same shape and dtype (any layout) gets the exact values back."""
    p = _path(workdir)
    ss.save(p, {"a": a})
    dt = a.dtype.newbyteorder("<") if a.dtype.byteorder == ">" else a.dtype
    order = data.draw(st.sampled_from(["C", "F"]))
    like = np.zeros(a.shape, dtype=dt, order=order)
    out = ss.load(p, {"a": like})["a"]
    sst.assert_tree_equal(out, a)


@_SETTINGS
@given(state=sst.trees(max_leaves=6))
def test_metadata_matches_saved_tree(workdir, state):
    p = _path(workdir)
    ss.save(p, state)
    md = ss.metadata(p)
    loaded = ss.load(p)

    def walk(m, v):
        if isinstance(m, ss.ArrayMetadata):
            if isinstance(v, bytes):
                assert m.kind == "bytes" and m.nbytes == len(v)
            else:
                assert m.shape == np.shape(v) and m.nbytes == np.asarray(v).nbytes
        elif isinstance(m, dict):
            assert list(m) == list(v)
            for k in m:
                walk(m[k], v[k])
        elif isinstance(m, (list, tuple)):
            assert len(m) == len(v)
            for x, y in zip(m, v):
                walk(x, y)
        else:
            sst.assert_tree_equal(m, v)

    walk(md.tree, loaded)


@settings(max_examples=60, deadline=None)
@given(dt=sst.dtypes(), shape=sst.shapes())
def test_strategies_cover_dtypes_and_shapes(dt, shape):
    assert dtype_name(dt) in sst.SUPPORTED_DTYPE_NAMES
    assert all(s >= 0 for s in shape) and len(shape) <= 4


def test_supported_dtype_names_are_all_format_dtypes():
    assert set(sst.SUPPORTED_DTYPE_NAMES) == set(DTYPE_NAMES)
