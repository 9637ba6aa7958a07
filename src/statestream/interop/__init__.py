"""Other libraries' checkpoint formats, read and written without their runtimes.

Each format is parsed by our own code as untrusted input and exposed as a
:class:`statestream.format.Manifest` plus a reader over its files, so that
``load`` (targets, ``items=``, resharding, byte-range reads) works on it
unchanged. See docs/interop.md.
"""

from statestream.interop._dcpwrite import write_dcp
from statestream.interop._deps import MissingDependencyError
from statestream.interop._detect import ForeignCheckpoint, detect_format, open_foreign
from statestream.interop._files import FileSetReader
from statestream.interop._orbaxwrite import write_orbax
from statestream.interop._torchwrite import write_torch
from statestream.interop._writers import write_safetensors, write_statestream

__all__ = [
    "FileSetReader",
    "MissingDependencyError",
    "ForeignCheckpoint",
    "detect_format",
    "open_foreign",
    "write_dcp",
    "write_orbax",
    "write_safetensors",
    "write_statestream",
    "write_torch",
]
