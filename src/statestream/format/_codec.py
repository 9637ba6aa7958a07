"""What a writer asks of a codec (format v2): its name, level and byte shuffling.

The encoding itself (zstandard, imported lazily) is the engine's
(``engine/_codec.py``); a reader needs only the chunk's record.
"""

from __future__ import annotations

import dataclasses

from statestream.errors import InvalidOptionError, InvalidOptionTypeError
from statestream.format._chunks import CODECS

__all__ = ["Compression"]

#: zstd's levels (negative: faster than 1, larger output)
_LEVELS = {"zstd": (-7, 22)}


@dataclasses.dataclass(frozen=True)
class Compression:
    """How ``save`` compresses an array's chunks.

    Attributes:
        codec: ``"zstd"`` (Zstandard, from the ``zstandard`` package).
        level: the codec's level (zstd: -7 to 22; 1 is fast and, on float
            weights, about as small as 3).
        shuffle: group the bytes of each element (all first bytes, then all
            second bytes, ...) before compressing. ``None`` (default): for
            floating-point and complex arrays only (their sign and exponent
            bytes compress far better grouped); ``True``: every array whose
            elements have more than one byte; ``False``: never.

    Example:
        >>> Compression("zstd", level=3, shuffle=True)
        Compression(codec='zstd', level=3, shuffle=True)
    """

    codec: str = "zstd"
    level: int = 1
    shuffle: bool | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.codec, str):
            raise InvalidOptionTypeError(f"Compression codec must be a str, not {self.codec!r}")
        if self.codec not in CODECS:
            raise InvalidOptionError(
                f"unknown codec {self.codec!r}; statestream writes {', '.join(CODECS)}")
        if type(self.level) is not int:
            raise InvalidOptionTypeError(f"Compression level must be an int, not {self.level!r}")
        lo, hi = _LEVELS[self.codec]
        if not lo <= self.level <= hi:
            raise InvalidOptionError(
                f"{self.codec} level must be in [{lo}, {hi}], got {self.level}")
        if self.shuffle is not None and type(self.shuffle) is not bool:
            raise InvalidOptionTypeError(
                f"Compression shuffle must be True, False or None, not {self.shuffle!r}")
