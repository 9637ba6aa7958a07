"""``load``'s pickle trust: which pickle leaves ``allow_pickle`` lets a load unpickle."""

from __future__ import annotations

from collections.abc import Collection
from typing import Union

from statestream.api._options import allow_pickle_option
from statestream.errors import PickleNotAllowedError
from statestream.tree import KeyPath, format_keypath, parse_keypath

#: ``load``'s ``allow_pickle``: ``True`` (every pickle leaf), ``False`` (none), or the
#: key paths trusted to hold pickles (each covers its whole subtree, as ``pickle_paths``
#: does on save). A Union, not ``|``: a runtime alias must work on Python 3.10.
AllowPickle = Union[bool, Collection[str]]  # noqa: UP007


class _PickleTrust:
    """Which pickle leaves a load may unpickle, and the ones it refused."""

    def __init__(self, allow: AllowPickle) -> None:
        allowed = allow_pickle_option(allow)
        self.all = allowed is True
        self.paths: list[str] = [] if isinstance(allowed, bool) else allowed
        self.prefixes = [parse_keypath(p) for p in self.paths]
        self.refused: list[tuple[KeyPath, str]] = []

    def trusts(self, path: KeyPath) -> bool:
        """Whether ``path`` is at or under a trusted key path (save's ``pickle_paths`` rule)."""
        if self.all:
            return True
        spath = tuple(str(k) for k in path)
        return any(spath[: len(p)] == p for p in self.prefixes)

    def check(self, where: str) -> None:
        """Raise naming every refused pickle leaf of checkpoint ``where``; called
        before anything is read."""
        if not self.refused:
            return
        n = len(self.refused)
        shown = ", ".join(f"'{format_keypath(p)}' ({t[:200]})" for p, t in self.refused[:10])
        more = f" and {n - 10} more" if n > 10 else ""
        named = [format_keypath(p) for p, _ in self.refused[:10]]
        how = (
            f"pass allow_pickle={named!r} (or allow_pickle=True for every pickle leaf)"
            if not self.paths
            else f"allow_pickle={self.paths!r} does not cover {'them' if n > 1 else 'it'}; "
            "add the key paths you trust"
        )
        raise PickleNotAllowedError(
            f"key path{'s' if n > 1 else ''} {shown}{more} of {where} "
            f"hold{'' if n > 1 else 's'} pickled data; unpickling can run arbitrary code, so "
            f"nothing was unpickled. Only if you trust this checkpoint, {how}"
        )
