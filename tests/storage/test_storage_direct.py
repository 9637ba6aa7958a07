"""Local storage writes page-aligned large buffers with O_DIRECT, everything else buffered."""

from __future__ import annotations

import os

import numpy as np
import pytest

import statestream as ss
from statestream.engine import StagingPool
from statestream.storage import LocalStorage

MiB = 1 << 20


def _aligned(n: int, fill: int) -> np.ndarray:
    buf = StagingPool(capacity=1 << 30).take(n)
    assert buf.__array_interface__["data"][0] % 4096 == 0
    buf[:] = np.arange(n, dtype=np.uint64).astype(np.uint8) ^ fill
    return buf


def _write(root: str, direct: bool, batches: list[tuple[list[object], int]]) -> tuple[bytes, int]:
    st = LocalStorage(direct_io=direct)
    path = os.path.join(root, f"ck-{direct}")
    txn = st.begin_write(path, overwrite=False)
    w = txn.create_file("data/r0-0.bin", 0)
    for bufs, off in batches:
        w.write_at(bufs, off)
    dfd = w._dfd
    w.finish()
    txn.write_bytes("manifest.json", b"{}")
    txn.write_bytes("COMMITTED", ss.format.encode_commit(b"{}"))
    txn.commit()
    with open(os.path.join(path, "data", "r0-0.bin"), "rb") as f:
        return f.read(), dfd


def _batches() -> tuple[list[tuple[list[object], int]], bytes]:
    small = b"x" * 100
    big = _aligned(2 * MiB + 123, 0x5A)   # aligned start, unaligned tail
    exact = _aligned(MiB, 0x33)           # aligned start and length
    unaligned = _aligned(MiB + 8, 0x11)[8:]  # large, not page-aligned: bounced
    pad = bytes(4096 - 100)
    # one batch: small, padding to a page, big (direct prefix + buffered tail), 5 bytes;
    # then a page-aligned exact buffer on its own, then an unaligned large one.
    off2 = 4096 + big.nbytes + 5
    off2 = -(-off2 // 4096) * 4096
    off3 = off2 + exact.nbytes + 4096 * 3
    batches = [([small, pad, big, b"tail!"], 0), ([exact], off2), ([unaligned], off3)]
    want = bytearray(off3 + unaligned.nbytes)
    want[0:100] = small
    want[4096:4096 + big.nbytes] = big.tobytes()
    want[4096 + big.nbytes:4096 + big.nbytes + 5] = b"tail!"
    want[off2:off2 + exact.nbytes] = exact.tobytes()
    want[off3:] = unaligned.tobytes()
    return batches, bytes(want)


def test_direct_and_buffered_writes_give_identical_files(tmp_path: os.PathLike[str]) -> None:
    batches, want = _batches()
    got_direct, dfd = _write(str(tmp_path), True, batches)
    got_plain, plain_dfd = _write(str(tmp_path), False, batches)
    assert got_direct == want
    assert got_plain == want
    assert plain_dfd == -1  # never tried
    if dfd == -1:
        pytest.skip("this file system refuses O_DIRECT (the buffered fallback was used)")
    assert dfd >= 0  # the direct path really ran


def test_large_buffer_at_unaligned_offset_and_bounce_pieces(tmp_path: os.PathLike[str]) -> None:
    # 20 MiB of unaligned memory crosses several 8 MiB bounce pieces; a large
    # buffer at an unaligned file offset goes through the page cache.
    src = _aligned(20 * MiB + 4096 + 3, 0x77)[3:]
    odd = _aligned(2 * MiB, 0x44)
    batches = [([src], 0), ([odd], src.nbytes + 100)]
    want = bytearray(src.nbytes + 100 + odd.nbytes)
    want[:src.nbytes] = src.tobytes()
    want[src.nbytes + 100:] = odd.tobytes()
    for direct in (True, False):
        got, _ = _write(str(tmp_path), direct, batches)
        assert got == bytes(want)


def test_falls_back_where_o_direct_is_refused(mount_tmpfs) -> None:
    batches, want = _batches()
    got, _ = _write(str(mount_tmpfs("16m")), True, batches)  # direct or refused: same bytes
    assert got == want


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_async_save_through_direct_io_round_trips(tmp_path: os.PathLike[str],
                                                  lazy: bool) -> None:
    rng = np.random.default_rng(0)
    state = {
        "a": rng.standard_normal((1000, 777)).astype(np.float32),  # unaligned size
        "b": rng.standard_normal((4, 1 << 18)),                     # page multiple
        "small": np.arange(10),
    }
    want = {k: v.copy() for k, v in state.items()}
    path = os.path.join(tmp_path, "c")
    h = ss.save_async(path, state, lazy=lazy, io=ss.IOOptions(max_chunk_bytes=3 * MiB))
    h.wait_snapshot()
    for v in state.values():
        v += 1
    h.result()
    assert ss.verify(path).ok
    got = ss.load(path)
    for k, v in want.items():
        np.testing.assert_array_equal(got[k], v)


def _small_runs() -> tuple[list[tuple[list[object], int]], bytes]:
    """Runs of many small buffers (gathered and written direct), at aligned and
    unaligned offsets, around a large buffer, across several bounce pieces."""
    rng = np.random.default_rng(7)
    sizes = rng.integers(1, 64 * 1024, size=700)
    smalls = [rng.integers(0, 256, size=int(n), dtype=np.uint8) for n in sizes]
    big = _aligned(3 * MiB + 77, 0x21)
    first = smalls[:300] + [big] + smalls[300:400]   # 10 MiB of small, big, more small
    off1 = 12345                                      # unaligned start: a buffered head
    second = smalls[400:]                            # > 8 MiB: two bounce pieces
    end1 = off1 + sum(x.nbytes for x in first)
    off2 = end1 + 999                                # a gap, then unaligned again
    want = bytearray(off2 + sum(x.nbytes for x in second))
    pos = off1
    for x in first:
        want[pos:pos + x.nbytes] = x.tobytes()
        pos += x.nbytes
    pos = off2
    for x in second:
        want[pos:pos + x.nbytes] = x.tobytes()
        pos += x.nbytes
    return [(first, off1), (second, off2)], bytes(want)


def test_runs_of_small_buffers_are_gathered_and_written_direct(tmp_path) -> None:
    batches, want = _small_runs()
    got_direct, dfd = _write(str(tmp_path), True, batches)
    got_plain, _ = _write(str(tmp_path), False, batches)
    assert got_direct == want
    assert got_plain == want
    if dfd == -1:
        pytest.skip("this file system refuses O_DIRECT (the buffered fallback was used)")


def test_gathered_runs_fall_back_where_o_direct_is_refused(mount_tmpfs) -> None:
    batches, want = _small_runs()
    got, _ = _write(str(mount_tmpfs("64m")), True, batches)
    assert got == want


def test_carried_tail_survives_writes_elsewhere(tmp_path) -> None:
    # A direct write's unaligned tail is carried to lead the next write when that
    # one follows on in the same page; any other next write (earlier in the file,
    # or pages further on) must still find the tail written, as must finish().
    rng = np.random.default_rng(3)
    runs = [[rng.integers(0, 256, size=int(n), dtype=np.uint8) for n in rng.integers(1, 9000, 90)]
            for _ in range(4)]
    sizes = [sum(x.nbytes for x in r) for r in runs]
    offs = [MiB, MiB + sizes[0] + 17, 0, 4 * MiB]   # follows on (gap 17), earlier, far on
    want = bytearray(max(o + n for o, n in zip(offs, sizes)))
    for r, o in zip(runs, offs):
        want[o:o + sum(x.nbytes for x in r)] = b"".join(x.tobytes() for x in r)
    for direct in (True, False):
        got, _ = _write(str(tmp_path), direct, list(zip(runs, offs)))
        assert got == bytes(want)
