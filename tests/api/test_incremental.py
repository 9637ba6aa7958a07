"""Incremental saves (format v2 references): what is skipped, chains, and refusals."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import statestream as ss
from statestream.format import encode_commit
from statestream.testing import faults

MB = 1 << 20


def _state(seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {"frozen": rng.standard_normal((512, 512)).astype(np.float32),   # 1 MiB
            "lora": rng.standard_normal((32, 64)).astype(np.float32),       # 8 KiB
            "step": 0}


def _data_bytes(ck: Path) -> int:
    return sum(p.stat().st_size for p in (ck / "data").iterdir())


def _manifest(ck: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((ck / "manifest.json").read_bytes())
    return doc


def _rewrite(ck: Path, change: Callable[[dict[str, Any]], None]) -> None:
    """Change the manifest and re-seal it (a consistent, hostile manifest)."""
    doc = _manifest(ck)
    change(doc)
    data = json.dumps(doc, separators=(",", ":")).encode()
    (ck / "manifest.json").write_bytes(data)
    (ck / "COMMITTED").write_bytes(encode_commit(data))


def _chunks(doc: dict[str, Any], key: str) -> list[Any]:
    tree = doc["tree"]
    chunks: list[Any] = doc["arrays"][tree["c"][tree["k"].index(key)]["a"]]["chunks"]
    return chunks


def _check(out: dict[str, Any], want: dict[str, Any]) -> None:
    for k, v in want.items():
        if isinstance(v, np.ndarray):
            np.testing.assert_array_equal(out[k], v)
        else:
            assert out[k] == v


def test_unchanged_chunks_are_not_written(tmp_path: Path) -> None:
    s = _state()
    ss.save(tmp_path / "s1", s, hashes=True)
    assert _data_bytes(tmp_path / "s1") >= MB
    s["lora"] = s["lora"] + 1
    s["step"] = 1
    ss.save(tmp_path / "s2", s, base=tmp_path / "s1")
    # only the trained array's bytes are in the new checkpoint's files
    assert _data_bytes(tmp_path / "s2") == s["lora"].nbytes
    doc = _manifest(tmp_path / "s2")
    assert doc["version"] == 2 and doc["bases"] == ["s1"]
    (ref,) = _chunks(doc, "frozen")
    assert ref[7]["ref"] == 0 and len(ref[7]["hash"]) == 32
    assert "ref" not in _chunks(doc, "lora")[0][7]
    _check(ss.load(tmp_path / "s2"), s)
    md = ss.metadata(tmp_path / "s2")
    assert md.bases == ["s1"] and md.referenced_bytes == s["frozen"].nbytes
    assert ss.verify(tmp_path / "s2").ok
    # the base itself is unchanged and still loads on its own
    assert ss.metadata(tmp_path / "s1").bases == []
    assert ss.load(tmp_path / "s1")["step"] == 0


def test_a_chain_of_steps_refers_to_the_checkpoint_holding_the_bytes(tmp_path: Path) -> None:
    s = _state()
    s["opt"] = np.zeros((256, 256), np.float32)  # 256 KiB; changes once, at step 3
    io = ss.IOOptions(max_chunk_bytes=64 << 10)  # several chunks per array
    ss.save(tmp_path / "step1", s, hashes=True, io=io)
    states = {1: {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in s.items()}}
    for step in (2, 3, 4, 5):
        s["lora"] = s["lora"] * 0.5 + step
        s["step"] = step
        if step == 3:
            s["opt"][:64] = 3.0  # one of its four chunks
        ss.save(tmp_path / f"step{step}", s, base=tmp_path / f"step{step - 1}", io=io)
        states[step] = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in s.items()}
    opt_chunk = 64 << 10
    assert _data_bytes(tmp_path / "step2") == s["lora"].nbytes
    assert _data_bytes(tmp_path / "step3") == s["lora"].nbytes + opt_chunk
    assert _data_bytes(tmp_path / "step5") == s["lora"].nbytes
    # flattened: step5 names the checkpoints that hold its bytes, never a reference chain
    doc = _manifest(tmp_path / "step5")
    assert sorted(doc["bases"]) == ["step1", "step3"]
    for step, want in states.items():
        _check(ss.load(tmp_path / f"step{step}"), want)
        assert ss.verify(tmp_path / f"step{step}").ok
    part = ss.load(tmp_path / "step5", items=["opt"])
    np.testing.assert_array_equal(part["opt"], states[5]["opt"])
    # partial reads into a target that takes a different row split
    like = {"frozen": np.empty((512, 512), np.float32), "lora": np.empty((32, 64), np.float32),
            "opt": np.empty((256, 256), np.float32), "step": 0}
    _check(ss.load(tmp_path / "step5", like), states[5])


def test_compressed_base_chunks_are_referenced(tmp_path: Path) -> None:
    s = {"a": np.zeros((256, 256), np.float32), "b": np.arange(1000, dtype=np.int64)}
    ss.save(tmp_path / "s1", s, hashes=True, compression="zstd")
    s["b"] = s["b"] + 1
    ss.save(tmp_path / "s2", s, base=tmp_path / "s1")
    (ref,) = _chunks(_manifest(tmp_path / "s2"), "a")
    assert ref[7]["codec"] == "zstd" and ref[7]["ref"] == 0
    assert _data_bytes(tmp_path / "s2") == s["b"].nbytes
    _check(ss.load(tmp_path / "s2"), s)
    assert ss.verify(tmp_path / "s2").ok


def test_async_save_and_a_checkpoint_of_references_only(tmp_path: Path) -> None:
    s = _state()
    ss.save_async(tmp_path / "s1", s, hashes=True).result()
    h = ss.save_async(tmp_path / "s2", s, base=tmp_path / "s1")
    h.result()
    assert _data_bytes(tmp_path / "s2") == 0  # nothing changed: nothing written
    _check(ss.load(tmp_path / "s2"), s)
    assert ss.verify(tmp_path / "s2").ok


def test_a_base_without_hashes_is_written_in_full(tmp_path: Path) -> None:
    s = _state()
    ss.save(tmp_path / "s1", s)
    assert _manifest(tmp_path / "s1")["version"] == 1
    ss.save(tmp_path / "s2", s, base=tmp_path / "s1")
    assert _data_bytes(tmp_path / "s2") == _data_bytes(tmp_path / "s1")
    assert "bases" not in _manifest(tmp_path / "s2")
    _check(ss.load(tmp_path / "s2"), s)


def test_identity_is_the_hash_shape_and_raw_size(tmp_path: Path) -> None:
    """The 128-bit hash with shape and raw size decide identity; a match takes the base's CRC."""
    s = _state()
    ss.save(tmp_path / "s1", s, hashes=True)
    ss.save(tmp_path / "probe", {"lora": s["lora"] + 1}, hashes=True)
    new_hash = _chunks(_manifest(tmp_path / "probe"), "lora")[0][7]["hash"]
    # the base claims its lora chunk has the hash of the new bytes: it is referred to,
    # with the base's own CRC-32C (no checksum of the new bytes decides anything)
    _rewrite(tmp_path / "s1", lambda d: _chunks(d, "lora")[0][7].update(hash=new_hash))
    ss.save(tmp_path / "s2", {"lora": s["lora"] + 1}, base=tmp_path / "s1")
    got = _chunks(_manifest(tmp_path / "s2"), "lora")[0]
    base = _chunks(_manifest(tmp_path / "s1"), "lora")[0]
    assert got[7]["ref"] == 0 and got[3] == base[3]  # the crc32c of the base
    assert _manifest(tmp_path / "s2")["bases"] == ["s1"]
    # the same bytes in another shape are another chunk: written
    ss.save(tmp_path / "s3", {"lora": s["lora"].reshape(64, 32)}, base=tmp_path / "s1")
    assert "ref" not in _chunks(_manifest(tmp_path / "s3"), "lora")[0][7]
    _check(ss.load(tmp_path / "s3"), {"lora": s["lora"].reshape(64, 32)})


def test_base_must_be_a_committed_sibling(tmp_path: Path) -> None:
    s = _state()
    (tmp_path / "a").mkdir()
    ss.save(tmp_path / "a" / "s1", s, hashes=True)
    with pytest.raises(ss.CheckpointError, match="not a sibling"):
        ss.save(tmp_path / "s2", s, base=tmp_path / "a" / "s1")
    with pytest.raises(ss.CheckpointError, match="missing"):
        ss.save(tmp_path / "a" / "s2", s, base=tmp_path / "a" / "gone")
    with pytest.raises(ss.CheckpointError, match="itself"):
        ss.save(tmp_path / "a" / "s1", s, base=tmp_path / "a" / "s1", overwrite=True)
    assert not (tmp_path / "s2").exists() and not (tmp_path / "a" / "s2").exists()


def test_loading_after_the_base_was_deleted_names_it(tmp_path: Path) -> None:
    s = _state()
    ss.save(tmp_path / "s1", s, hashes=True)
    ss.save(tmp_path / "s2", s, base=tmp_path / "s1")
    shutil.rmtree(tmp_path / "s1")
    with pytest.raises(ss.TruncatedFileError, match="base checkpoint s1 .* is missing"):
        ss.load(tmp_path / "s2")
    rep = ss.verify(tmp_path / "s2")
    assert not rep.ok and "s1" in rep.problems[0]
    assert ss.metadata(tmp_path / "s2").bases == ["s1"]  # no data read: still describable


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_base_deleted_while_the_save_runs_fails_the_save(tmp_path: Path, mode: str) -> None:
    """The base is checked when the save begins; one removed before the commit (someone's
    own retention deleting old checkpoints while the next one is written) failed nothing:
    the save reported success and committed a checkpoint that no load could read."""
    s = _state()
    ss.save(tmp_path / "s1", s, hashes=True)
    s["lora"] = s["lora"] + 1
    faults.on("save.data_synced", lambda: shutil.rmtree(tmp_path / "s1"))
    try:
        with pytest.raises(ss.CheckpointError, match="refers to chunks of s1, which is no "
                           "longer the checkpoint this save read") as err:
            if mode == "sync":
                ss.save(tmp_path / "s2", s, base=tmp_path / "s1")
            else:
                ss.save_async(tmp_path / "s2", s, base=tmp_path / "s1").result()
    finally:
        faults.clear()
    assert str(tmp_path / "s2") in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing committed, nothing left
    ss.save(tmp_path / "s2", s)  # a full save goes through
    np.testing.assert_array_equal(ss.load(tmp_path / "s2")["lora"], s["lora"])


@pytest.mark.parametrize("holder", [False, True], ids=["base", "base-of-base"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_base_replaced_while_the_save_runs_fails_the_save(tmp_path: Path, mode: str,
                                                             holder: bool) -> None:
    """A base replaced (``overwrite=True``) while the save runs is still committed, so
    only its being committed was checked: the save reported success and committed
    references to chunks the new base does not hold (its load: "whose record there
    differs"). The same for a checkpoint the base refers to."""
    s0 = _state()
    s = {**s0, "lora": s0["lora"] + 1}  # frozen refers to s0, lora to s1
    ss.save(tmp_path / "s0", s0, hashes=True)
    ss.save(tmp_path / "s1", s, base=tmp_path / "s0", hashes=True)
    replaced = tmp_path / ("s0" if holder else "s1")
    changed = {k: v + 7 for k, v in s0.items()}

    def replace() -> None:  # s1 refers to s0: an overwrite of s0 is refused, so by hand
        if holder:
            shutil.rmtree(replaced)
        ss.save(replaced, changed, hashes=True, overwrite=not holder)

    faults.on("save.data_synced", replace)
    try:
        with pytest.raises(ss.CheckpointError, match=f"refers to chunks of {replaced.name}, "
                           "which is no longer the checkpoint this save read"):
            if mode == "sync":
                ss.save(tmp_path / "s2", s, base=tmp_path / "s1")
            else:
                ss.save_async(tmp_path / "s2", s, base=tmp_path / "s1").result()
    finally:
        faults.clear()
    assert not (tmp_path / "s2").exists()
    if not holder:  # (s1 itself cannot be loaded now: what it refers to is gone)
        ss.save(tmp_path / "s2", s, base=tmp_path / "s1")  # against what is there now
        np.testing.assert_array_equal(ss.load(tmp_path / "s2")["frozen"], s["frozen"])


@pytest.mark.parametrize("damage", ["flipped", "truncated"])
def test_a_base_manifest_damaged_after_this_process_wrote_it_is_refused(
        tmp_path: Path, damage: str) -> None:
    """This process keeps the index of a checkpoint it committed, checked against the
    commit marker only: a base whose manifest was damaged since was used anyway, and the
    save committed references that no load could follow (a fresh process refused it)."""
    s = _state()
    ss.save(tmp_path / "s1", s, hashes=True)
    f = tmp_path / "s1" / "manifest.json"
    raw = bytearray(f.read_bytes())
    if damage == "flipped":
        raw[len(raw) // 2] ^= 0x01
    else:
        del raw[len(raw) // 2:]
    f.write_bytes(bytes(raw))
    s["lora"] = s["lora"] + 1
    with pytest.raises(ss.CheckpointCorruptError, match="does not match its commit marker") as err:
        ss.save(tmp_path / "s2", s, base=tmp_path / "s1")
    assert str(f) in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s1"]


@pytest.mark.parametrize("damage", ["flipped", "truncated"])
def test_damage_in_a_base_names_the_bases_own_file(tmp_path: Path, damage: str) -> None:
    """A damaged chunk that s2 refers to is reported under s1's file, where it is; it was
    reported under the reader's alias 's2/../s1/data/...' (a path in no listing, and on
    an object store no object at all, tests/storage/test_incremental_s3.py)."""
    s1, s2 = _pair(tmp_path)
    (f,) = [p for p in (s1 / "data").iterdir() if p.stat().st_size >= MB]
    raw = bytearray(f.read_bytes())
    if damage == "flipped":
        raw[1000] ^= 0xFF
    else:
        del raw[len(raw) // 2:]
    f.write_bytes(bytes(raw))
    with pytest.raises(ss.CheckpointCorruptError) as err:
        ss.load(s2)
    assert str(f) in str(err.value) and ".." not in str(err.value), err.value
    problems = ss.verify(s2).problems
    assert problems and all(".." not in p for p in problems), problems
    assert any(str(f) in p for p in problems), problems


def _pair(tmp_path: Path) -> tuple[Path, Path]:
    s = _state()
    ss.save(tmp_path / "s1", s, hashes=True)
    s["lora"] = s["lora"] + 1
    ss.save(tmp_path / "s2", s, base=tmp_path / "s1")
    return tmp_path / "s1", tmp_path / "s2"


def _ref(d: dict[str, Any]) -> list[Any]:
    return _chunks(d, "frozen")[0]


@pytest.mark.parametrize("tamper", [
    pytest.param(lambda d: _ref(d).__setitem__(3, _ref(d)[3] ^ 1), id="crc"),
    pytest.param(lambda d: _ref(d)[7].update(hash="0" * 32), id="hash"),
    pytest.param(lambda d: _ref(d).__setitem__(1, _ref(d)[1] + 64), id="offset"),
    pytest.param(lambda d: _ref(d).__setitem__(0, 5), id="file"),
])
def test_a_reference_the_base_does_not_list_is_unsafe(tmp_path: Path,
                                                      tamper: Callable[[Any], None]) -> None:
    _, s2 = _pair(tmp_path)
    _rewrite(s2, tamper)
    with pytest.raises(ss.UnsafeCheckpointError):
        ss.load(s2)
    assert not ss.verify(s2).ok


@pytest.mark.parametrize("name", ["..", "../s1", "s1/../s1", "/etc", ".hidden"])
def test_a_base_outside_the_parent_is_unsafe(tmp_path: Path, name: str) -> None:
    _, s2 = _pair(tmp_path)
    _rewrite(s2, lambda d: d.update(bases=[name]))
    with pytest.raises(ss.UnsafeCheckpointError):
        ss.load(s2)


def test_a_base_replaced_by_a_symlink_out_of_the_parent_is_unsafe(tmp_path: Path) -> None:
    """A base name is one path component, but the sibling itself may be a link:
    following it would read a checkpoint outside the parent directory."""
    (tmp_path / "parent").mkdir()
    s1, s2 = _pair(tmp_path / "parent")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.move(s1, outside / "s1")
    s1.symlink_to(outside / "s1", target_is_directory=True)
    with pytest.raises(ss.UnsafeCheckpointError, match="symbolic link"):
        ss.load(s2)
    report = ss.verify(s2)
    assert not report.ok and "symbolic link" in report.problems[0]
    assert ss.load(outside / "s1")["step"] == 0  # the user may name a link themselves


def test_an_uncommitted_base_is_unsafe(tmp_path: Path) -> None:
    s1, s2 = _pair(tmp_path)
    (s1 / "COMMITTED").unlink()
    with pytest.raises(ss.UnsafeCheckpointError, match="not committed"):
        ss.load(s2)


def test_a_base_that_itself_refers_is_not_followed(tmp_path: Path) -> None:
    """References are flattened: one pointing at a base's own reference is refused,
    even when that reference records exactly the same bytes."""
    s = _state()
    ss.save(tmp_path / "s1", s, hashes=True)
    ss.save(tmp_path / "s2", s, base=tmp_path / "s1")  # nothing changed: all references
    ss.save(tmp_path / "s3", s, base=tmp_path / "s2")
    assert _manifest(tmp_path / "s3")["bases"] == ["s1"]  # flattened past s2
    # s2 lists (as references) the very records s3 refers to: point s3 at s2 instead
    _rewrite(tmp_path / "s3", lambda d: d.update(bases=["s2"]))
    with pytest.raises(ss.UnsafeCheckpointError, match="lists no chunk of its own"):
        ss.load(tmp_path / "s3")


def test_cli_shows_what_a_checkpoint_depends_on(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    from statestream.cli import main

    _, s2 = _pair(tmp_path)
    assert main(["inspect", str(s2)]) == 0
    assert "depends on  s1" in capsys.readouterr().out
    assert main(["ls", str(tmp_path)]) == 0
    assert "depends on s1" in capsys.readouterr().out
    assert main(["inspect", str(s2), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["bases"] == ["s1"]


def test_a_base_replaced_behind_the_writers_back_is_read_again(tmp_path: Path) -> None:
    """The writer reuses the chunk index of a checkpoint it just committed only while
    that very manifest is committed there."""
    s = _state()
    ss.save(tmp_path / "s1", s, hashes=True)
    other = _state(seed=7)
    ss.save(tmp_path / "elsewhere", other, hashes=True)
    shutil.rmtree(tmp_path / "s1")
    (tmp_path / "elsewhere").rename(tmp_path / "s1")
    ss.save(tmp_path / "s2", other, base=tmp_path / "s1")
    assert _data_bytes(tmp_path / "s2") == 0
    _check(ss.load(tmp_path / "s2"), other)


def test_a_base_whose_own_base_is_gone_is_not_referred_through(tmp_path: Path) -> None:
    """References are flattened, so a save against s2 would refer to s1's chunks: with s1
    deleted, those chunks are written (with a warning naming both), never committed as
    references nothing can follow."""
    s = _state()
    ss.save(tmp_path / "s1", s, hashes=True)
    s["lora"] = s["lora"] + 1
    ss.save(tmp_path / "s2", s, base=tmp_path / "s1")  # 'frozen' refers to s1
    shutil.rmtree(tmp_path / "s1")
    s["step"] = 3
    with pytest.warns(RuntimeWarning, match=r"base checkpoint s2 .* s1 .* is missing"):
        ss.save(tmp_path / "s3", s, base=tmp_path / "s2")
    assert _manifest(tmp_path / "s3")["bases"] == ["s2"]  # 'lora', held by s2
    assert _data_bytes(tmp_path / "s3") == s["frozen"].nbytes
    _check(ss.load(tmp_path / "s3"), s)


def test_a_base_whose_own_base_was_replaced_is_not_referred_through(tmp_path: Path) -> None:
    """s1 overwritten with other bytes: s2's references into it no longer hold, so a save
    against s2 writes those chunks; the chunks s2 holds itself are still referred to."""
    s = _state()
    ss.save(tmp_path / "s1", s, hashes=True)
    s["lora"] = s["lora"] + 1
    ss.save(tmp_path / "s2", s, base=tmp_path / "s1")
    shutil.rmtree(tmp_path / "s1")  # replaced behind statestream's back (overwrite refuses)
    ss.save(tmp_path / "s1", _state(seed=9), hashes=True)
    with pytest.warns(RuntimeWarning, match="no longer list those chunks"):
        ss.save(tmp_path / "s3", s, base=tmp_path / "s2")
    assert _manifest(tmp_path / "s3")["bases"] == ["s2"]  # 'lora', held by s2
    assert _data_bytes(tmp_path / "s3") == s["frozen"].nbytes
    _check(ss.load(tmp_path / "s3"), s)


def test_golden_v2_incremental_loads_through_its_base() -> None:
    """The format's golden incremental checkpoint (tests/golden/v2) reads through ``base``."""
    golden = Path(__file__).resolve().parents[1] / "golden" / "v2"
    out = ss.load(golden / "incremental")
    np.testing.assert_array_equal(out["a"], np.arange(16, dtype=np.float32))
    np.testing.assert_array_equal(out["c"], np.zeros((64, 8), dtype=np.float32) + 1.5)
    np.testing.assert_array_equal(out["b"], np.arange(8, dtype=np.int32) * -2)
    assert ss.verify(golden / "incremental").ok
    assert ss.metadata(golden / "incremental").bases == ["base"]


@pytest.mark.parametrize("n,block", [(0, 0), (1, 0), (3 << 20, 0), (1000, 64), (4096, 1000)])
def test_one_pass_hash_and_checksums_equal_the_separate_ones(n: int, block: int) -> None:
    import xxhash

    from statestream.engine._refs import digest_and_checksums
    from statestream.format import checksum

    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    digest, crc, blocks = digest_and_checksums(data, block)
    assert digest == xxhash.xxh3_128(data.tobytes()).digest()
    if block:
        want = tuple(checksum(data[a:a + block]) for a in range(0, n, block))
        assert blocks == want and crc == checksum(np.array(want, dtype="<u4").tobytes())
    else:
        assert blocks == () and crc == checksum(data)


def test_scalars_empty_arrays_and_odd_dtypes(tmp_path: Path) -> None:
    s = {"scalar": np.float64(3.5) * np.ones(()), "empty": np.zeros((0, 4), np.float32),
         "b": np.array([True, False]), "c": np.arange(6, dtype=np.complex64),
         "big": np.arange(300_000, dtype=np.int16).reshape(3000, 100)}
    io = ss.IOOptions(max_chunk_bytes=64 << 10)
    ss.save(tmp_path / "s1", s, hashes=True, io=io)
    ss.save(tmp_path / "s2", s, base=tmp_path / "s1", io=io)
    assert _data_bytes(tmp_path / "s2") == 0
    s["big"][1500:1510] = -1  # one of the ten row blocks
    ss.save(tmp_path / "s3", s, base=tmp_path / "s2", io=io)
    assert 0 < _data_bytes(tmp_path / "s3") <= 64 << 10
    _check(ss.load(tmp_path / "s3"), s)
    assert ss.verify(tmp_path / "s3").ok


def test_overwriting_a_base_is_refused_naming_its_dependents(tmp_path: Path) -> None:
    """A committed checkpoint that incremental siblings refer to is not replaced by
    save, save_async or convert with overwrite=True (that would leave the siblings
    unloadable); nothing is written, and once the dependents are gone it is replaced."""
    frozen = np.arange(1 << 18, dtype=np.float32)
    ss.save(tmp_path / "a", {"frozen": frozen, "lora": np.zeros(8)}, hashes=True)
    ss.save(tmp_path / "b", {"frozen": frozen, "lora": np.ones(8)}, base=tmp_path / "a",
            hashes=True)
    c = {"frozen": frozen, "lora": np.full(8, 2.0)}
    ss.save(tmp_path / "c", c, base=tmp_path / "b")  # 'frozen' refers to a (flattened)
    ss.save(tmp_path / "plain", {"x": np.ones(3)})  # format v1: not read
    before = (tmp_path / "a" / "manifest.json").read_bytes()
    other = {"frozen": frozen + 1, "lora": np.zeros(8)}
    match = r"a is the base of the incremental checkpoint\(s\) b, c next to it"
    with pytest.raises(ss.CheckpointError, match=match):
        ss.save(tmp_path / "a", other, overwrite=True)
    with pytest.raises(ss.CheckpointError, match=match):
        ss.save_async(tmp_path / "a", other, overwrite=True).result()
    with pytest.raises(ss.CheckpointError, match=match):
        ss.convert(tmp_path / "plain", tmp_path / "a", overwrite=True)
    with pytest.raises(ss.CheckpointError, match=match):  # another format's directory
        ss.convert(tmp_path / "plain", tmp_path / "a", to="dcp", overwrite=True)
    assert (tmp_path / "a" / "manifest.json").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "c", "plain"]
    _check(ss.load(tmp_path / "c"), c)
    # nothing refers to b (c's references were flattened to a): replacing b is fine
    ss.save(tmp_path / "b", other, overwrite=True)
    # a full copy of c (convert follows the references) frees a once c is gone
    ss.convert(tmp_path / "c", tmp_path / "c-full")
    assert not ss.metadata(tmp_path / "c-full").bases
    shutil.rmtree(tmp_path / "c")
    ss.save(tmp_path / "a", other, overwrite=True)
    _check(ss.load(tmp_path / "c-full"), c)


def test_finding_the_dependents_decodes_only_manifests_that_name_the_base(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Siblings' manifests are searched for the base's name (as JSON writes it) before
    they are decoded (their heads only, up to ``bases``:
    tests/api/test_overwrite_hostile_sibling.py); a name no manifest may record as a base
    is not searched for."""
    from statestream.engine import _refs

    decoded: list[str] = []
    real = _refs._names_as_base
    monkeypatch.setattr(_refs, "_names_as_base",
                        lambda text, own: decoded.append(text) or real(text, own))
    ss.save(tmp_path / "s1", _state(), hashes=True)
    for i in range(3):  # format v2, not dependents: read, never decoded
        ss.save(tmp_path / f"other{i}", {"x": np.ones(3)}, hashes=True)
    ss.save(tmp_path / "dep", _state(), base=tmp_path / "s1")
    with pytest.raises(ss.CheckpointError, match=r"base of the incremental checkpoint\(s\) dep "):
        ss.save(tmp_path / "s1", _state(seed=1), overwrite=True)
    # dep's manifest alone
    assert decoded == [(tmp_path / "dep" / "manifest.json").read_text()]
    decoded.clear()
    ss.save(tmp_path / "bäse", _state(), hashes=True)  # no base may be named so
    ss.save(tmp_path / "bäse", _state(seed=1), overwrite=True)
    assert decoded == []


def test_a_base_replaced_behind_its_dependents_fails_them_loudly(tmp_path: Path) -> None:
    """A base replaced outside statestream (deleted and saved again) leaves a checkpoint
    that refers to it unloadable (UnsafeCheckpointError naming the base), never reading
    other bytes."""
    frozen = np.arange(1 << 18, dtype=np.float32)
    ss.save(tmp_path / "a", {"frozen": frozen, "lora": np.zeros(8)}, hashes=True)
    ss.save(tmp_path / "b", {"frozen": frozen, "lora": np.ones(8)}, base=tmp_path / "a")
    assert ss.metadata(tmp_path / "b").bases
    shutil.rmtree(tmp_path / "a")
    ss.save(tmp_path / "a", {"frozen": frozen + 1, "lora": np.zeros(8)}, hashes=True)
    with pytest.raises(ss.UnsafeCheckpointError, match="refers to a chunk of base checkpoint a"):
        ss.load(tmp_path / "b")


@pytest.mark.parametrize("cut", ["half", "all", "deleted"])
def test_verify_reports_a_truncated_base_file_once(tmp_path: Path, cut: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """A base's data file that is short (or gone) is one problem of the later step's
    report, naming the file, its sizes and the arrays it lacks: it was two, the file's
    size against the manifest and the read of the chunks past its end, each "is N
    bytes ... it is truncated" (also in ``statestream verify``: "2 problem(s)")."""
    from statestream.cli import main

    s1, s2 = _pair(tmp_path)
    (f,) = [p for p in (s1 / "data").iterdir() if p.stat().st_size >= MB]
    size = f.stat().st_size
    if cut == "deleted":
        f.unlink()
    else:
        os.truncate(f, size // 2 if cut == "half" else 0)
    problems = ss.verify(s2, io=ss.IOOptions(max_request_bytes=64 << 10)).problems
    assert len(problems) == 1, problems
    (p,) = problems
    assert str(f) in p and "key path 'frozen'" in p and "lora" not in p, p
    if cut != "deleted":
        assert f"is {size // 2 if cut == 'half' else 0} bytes, the manifest says {size}" in p
        assert p.count("truncated") == 1, p
    assert main(["verify", str(s2)]) == 1
    err = capsys.readouterr().err
    assert "1 problem(s)" in err and err.count(str(f)) == 1, err


def _forge_hashes(path: Path, values: np.ndarray) -> None:
    """Make every chunk record of the checkpoint at ``path`` claim the hash of
    ``values``'s bytes (its data untouched), and reseal it: a hostile or edited base."""
    import xxhash

    forged = xxhash.xxh3_128(values.tobytes()).hexdigest()

    def change(doc: dict[str, Any]) -> None:
        exts = [x for a in doc["arrays"] for c in a["chunks"] for x in c
                if isinstance(x, dict) and "hash" in x]
        assert exts
        for ext in exts:
            ext["hash"] = forged

    _rewrite(path, change)


@pytest.mark.parametrize("kind", ["small", "compressed", "large"])
def test_verify_checks_the_hashes_a_save_matched_chunks_by(tmp_path: Path, kind: str) -> None:
    """A save refers to a base chunk whose recorded XXH3-128 equals its own chunk's; the
    base's bytes are never read. A base whose records lie (edited, resealed) made the
    new checkpoint load the base's bytes, and ``verify`` said both were fine (their
    CRC-32Cs are right). ``verify`` now checks each recorded hash against the bytes:
    small, compressed (decoded first) and large chunks (read in steps)."""
    n = (3 << 20) if kind == "large" else 1024  # 12 MiB: checked in steps
    zeros, ones = np.zeros(n, np.float32), np.ones(n, np.float32)
    kw = {"compression": "zstd"} if kind == "compressed" else {}
    ss.save(tmp_path / "a", {"w": zeros}, hashes=True, **kw)
    assert ss.verify(tmp_path / "a").ok
    _forge_hashes(tmp_path / "a", ones)
    ss.save(tmp_path / "b", {"w": ones}, base=tmp_path / "a", **kw)  # matched by the lie
    for name in ("a", "b"):
        rep = ss.verify(tmp_path / name)
        assert not rep.ok
        assert "hash mismatch in array at key path 'w'" in rep.problems[0]
        assert "CRC-32C correct" in rep.problems[0]
