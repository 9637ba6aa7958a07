"""allow_pickle trusts key paths: a pickle leaf outside them is refused and never run."""

from __future__ import annotations

import os

import numpy as np
import pytest

import statestream as ss


def _touch(path: str) -> str:
    """Run by unpickling a :class:`Touch`: leaves a file behind, the side effect tests look for."""
    with open(path, "w") as f:
        f.write("unpickled")
    return path


class Touch:
    """A value whose unpickling writes a file (as a hostile pickle would do anything)."""

    def __init__(self, path: os.PathLike[str] | str) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (_touch, (self.path,))


def _save_two(tmp_path):
    """A checkpoint with a trusted pickle at extra/tok and a hostile one at extra/evil."""
    tok, evil = tmp_path / "tok-ran", tmp_path / "evil-ran"
    c = tmp_path / "c"
    ss.save(c, {"extra": {"tok": Touch(tok), "evil": Touch(evil), "n": 1}, "w": np.ones(3)},
            pickle_paths=["extra"])
    return c, tok, evil


def test_pickle_outside_trusted_paths_never_runs(tmp_path):
    c, tok, evil = _save_two(tmp_path)
    with pytest.raises(ss.PickleNotAllowedError) as ei:
        ss.load(c, allow_pickle=["extra/tok"])
    msg = str(ei.value)
    assert "extra/evil" in msg and "'extra/tok'" not in msg.split("pickled data")[0]
    assert isinstance(ei.value, PermissionError)
    # nothing was unpickled: neither the refused leaf nor the trusted one
    assert not evil.exists() and not tok.exists()
    # a bare string is one key path
    with pytest.raises(ss.PickleNotAllowedError):
        ss.load(c, allow_pickle="extra/tok")
    assert not evil.exists() and not tok.exists()


def test_no_paths_trusts_nothing(tmp_path):
    c, tok, evil = _save_two(tmp_path)
    for allow in (False, [], ()):
        with pytest.raises(ss.PickleNotAllowedError) as ei:
            ss.load(c, allow_pickle=allow)
        # every refused leaf is named, not just the first
        assert "extra/tok" in str(ei.value) and "extra/evil" in str(ei.value)
    assert not evil.exists() and not tok.exists()


def test_trusted_paths_load(tmp_path):
    c, tok, evil = _save_two(tmp_path)
    # a target that leaves the hostile leaf out loads the trusted one only
    out = ss.load(c, {"extra": {"tok": None}}, allow_pickle=["extra/tok"])
    assert out["extra"]["tok"] == str(tok) and tok.exists() and not evil.exists()
    tok.unlink()
    # items= without the pickles needs no trust at all
    np.testing.assert_array_equal(ss.load(c, items=["w"], allow_pickle=[])["w"], np.ones(3))
    # a prefix covers its subtree, as pickle_paths does on save
    out = ss.load(c, allow_pickle=["extra"])
    assert out["extra"] == {"tok": str(tok), "evil": str(evil), "n": 1}
    assert tok.exists() and evil.exists()


def test_true_means_every_pickle_leaf(tmp_path):
    c, tok, evil = _save_two(tmp_path)
    out = ss.load(c, allow_pickle=True)
    assert out["extra"]["evil"] == str(evil) and evil.exists() and tok.exists()


def test_int_keys_and_escaped_segments(tmp_path):
    c = tmp_path / "c"
    a, b = tmp_path / "a-ran", tmp_path / "b-ran"
    ss.save(c, {"x/y": [Touch(a), Touch(b)]}, pickle_paths=["x~1y"])
    with pytest.raises(ss.PickleNotAllowedError) as ei:
        ss.load(c, allow_pickle=["x~1y/0"])
    assert "x~1y/1" in str(ei.value) and not a.exists() and not b.exists()
    out = ss.load(c, {"x/y": [None, None]}, allow_pickle=["x~1y/0", "x~1y/1"])
    assert out["x/y"] == [str(a), str(b)]


def test_allow_pickle_rejects_non_paths(tmp_path):
    c, tok, evil = _save_two(tmp_path)
    with pytest.raises(TypeError):
        ss.load(c, allow_pickle=[1])
    assert not evil.exists() and not tok.exists()


def test_manager_load_forwards_trusted_paths(tmp_path):
    tok, evil = tmp_path / "tok-ran", tmp_path / "evil-ran"
    with ss.CheckpointManager(tmp_path / "run", async_save=False) as mgr:
        # the manager's save takes no pickle_paths: write the step with ss.save
        ss.save(mgr.step_path(1), {"extra": {"tok": Touch(tok), "evil": Touch(evil)}},
                pickle_paths=["extra"])
        with pytest.raises(ss.PickleNotAllowedError) as ei:
            mgr.load(1, allow_pickle=["extra/tok"])
        assert "extra/evil" in str(ei.value) and not evil.exists() and not tok.exists()
        out = mgr.load(1, allow_pickle=["extra/tok", "extra/evil"])
        assert out["extra"]["evil"] == str(evil) and evil.exists()


@pytest.mark.parametrize("root", ["", "<root>", [""], ["a", "<root>"]])
def test_a_key_path_naming_the_root_is_refused_not_trusting_every_leaf(tmp_path, root):
    """``""`` and ``"<root>"`` parse to the root, which covers every leaf: a caller who
    meant a top-level key of that name trusted every pickle of the checkpoint (found by
    the randomized campaign). Trusting all is said with True."""
    marker = tmp_path / "ran"
    ss.save(tmp_path / "c", {"": {1, 2}, "other": Touch(marker)},
            pickle_paths=["", "other"])
    with pytest.raises(ss.InvalidOptionError, match="names the root"):
        ss.load(tmp_path / "c", allow_pickle=root)
    assert not marker.exists()
