"""Fixtures shared by several test directories."""

from __future__ import annotations

import contextlib
import multiprocessing.util
import os
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="session", autouse=True)
def _temporary_files_under_basetemp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Every temporary file of the run goes under pytest's base directory.

    ``tempfile`` users (doctests, property tests, the emulators and the worker processes,
    which inherit ``TMPDIR``) then share the retention of ``tmp_path``: pyproject keeps only
    failed tests' directories and removes the base directory of a run that passed. A CI run
    once failed with "No space left on device" after earlier runs' leftovers filled /tmp.
    """
    # multiprocessing's own temporary directory stays where it is: its clean-up runs at
    # the interpreter's exit, after pytest has removed the base directory
    multiprocessing.util.get_temp_dir()
    d = tmp_path_factory.mktemp("tmp", numbered=False)
    old = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(d)
    tempfile.tempdir = None
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = old
        tempfile.tempdir = None


@pytest.fixture
def mount_tmpfs(tmp_path: Path) -> Iterator[Callable[[str], Path]]:
    """``mount_tmpfs("16m")`` mounts a tmpfs of that size under tmp_path (skips if not root)."""
    mounted: list[Path] = []

    def mount(size: str) -> Path:
        if os.geteuid() != 0:
            pytest.skip("mounting a tmpfs needs root")
        d = tmp_path / f"tmpfs-{len(mounted)}"
        d.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(d)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
        mounted.append(d)
        return d

    try:
        yield mount
    finally:
        for d in mounted:
            with contextlib.suppress(OSError):
                if subprocess.run(["umount", str(d)], capture_output=True).returncode != 0:
                    subprocess.run(["umount", "-l", str(d)], capture_output=True)
