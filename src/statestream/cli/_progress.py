"""Progress bars for long CLI commands: rich when installed, on a terminal, for large work.

Silent when stdout is not a terminal (piped, redirected) or when the work is
small; without rich (the ``cli`` extra) commands run the same, without a bar.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["LARGE_BYTES", "progress_bar"]

#: Below this many bytes a command finishes too fast for a bar to help.
LARGE_BYTES = 64 << 20

Callback = Callable[[int, int], None]


def _wanted(total: int | None) -> bool:
    if total is not None and total < LARGE_BYTES:
        return False
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):  # closed or replaced stdout
        return False


@contextmanager
def progress_bar(label: str, total: int | None = None) -> Iterator[Callback | None]:
    """Yield a ``progress(done, total)`` callback drawing a rich bar, or None.

    None when stdout is not a terminal, ``total`` is known and small, or rich is
    not installed.

    Example:
        >>> with progress_bar("verify", total=10) as cb:
        ...     cb is None
        True
    """
    if not _wanted(total):
        yield None
        return
    try:
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )
    except ImportError:  # pragma: no cover - the cli extra is not installed
        yield None
        return
    columns: list[Any] = ["{task.description}", BarColumn(), DownloadColumn(),
                          TransferSpeedColumn(), TimeRemainingColumn()]
    with Progress(*columns, transient=True) as bar:
        # hidden until the first report shows the work is large (total unknown up front)
        task = bar.add_task(label, total=total, visible=total is not None)

        def update(done: int, tot: int) -> None:
            bar.update(task, completed=min(done, tot), total=tot, visible=tot >= LARGE_BYTES)

        yield update
