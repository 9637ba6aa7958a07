"""Fixtures shared by several test directories."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest


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
