"""``statestream convert``: the command over :func:`statestream.convert`."""

from __future__ import annotations

import argparse
import fractions
import re

import statestream as ss
from statestream.cli._main import (
    add_max_arrays,
    add_memory_budget,
    memory_options,
    path_arg,
    safe,
)
from statestream.cli._progress import progress_bar

__all__ = ["add_parser", "parse_size"]

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}

EXAMPLE = """examples:
  statestream convert ckpts/step_0000001000 model.safetensors --items model
  statestream convert model.safetensors ckpts/imported
  statestream convert model.safetensors ckpts/imported-zstd --compression zstd
  statestream convert ckpts/step_0000001000 hf-export/ --to safetensors --max-shard-size 5GB
"""


def parse_size(text: str) -> int:
    """``"5GB"`` -> 5_000_000_000; ``"512MiB"``, ``"1000"`` too.

    Example:
        >>> parse_size("5GB"), parse_size("1KiB")
        (5000000000, 1024)
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if m is None or m.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 5GB, 512MiB)")
    # exact: float() made 10**400 infinity (an OverflowError traceback, not a usage error)
    n = int(fractions.Fraction(m.group(1)) * _UNITS[m.group(2).upper()])
    if n <= 0:
        raise argparse.ArgumentTypeError(f"not a positive size: {text!r}")
    if n >= 1 << 63:
        raise argparse.ArgumentTypeError(f"not a size: {text!r:.40} is 2**63 bytes or more")
    return n


def _cmd(args: argparse.Namespace) -> int:
    try:
        with progress_bar("convert") as cb:
            out = ss.convert(args.src, args.dst, to=args.to, items=args.items,
                             overwrite=args.overwrite, allow_pickle=args.allow_pickle,
                             max_shard_bytes=args.max_shard_size, progress=cb,
                             compression=args.compression, memory=memory_options(args),
                             max_arrays=args.max_arrays)
    except ss.CheckpointExistsError as exc:  # the API's advice in the command's words
        raise ss.CheckpointExistsError(
            str(exc).replace("pass overwrite=True", "pass --overwrite")) from None
    print(f"converted {safe(str(args.src))} -> {safe(str(out))}")
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("convert", help="convert a checkpoint to another format",
                       epilog=EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", type=path_arg, help="checkpoint to read (any format statestream reads)")
    p.add_argument("dst", type=path_arg, help="where to write")
    p.add_argument("--to", choices=["statestream", "safetensors", "torch", "dcp", "orbax"],
                   help="output format (default: from DST's extension, else statestream)")
    p.add_argument("--items", nargs="+", metavar="K", help="only these checkpointables")
    p.add_argument("--max-shard-size", type=parse_size, metavar="SIZE",
                   help="largest safetensors shard when DST is a directory (e.g. 5GB; with "
                        "--to safetensors or a DST ending in .safetensors)")
    p.add_argument("--compression", choices=["zstd"], default=None,
                   help="compress the arrays of a statestream DST (default: raw)")
    p.add_argument("--allow-pickle", action="store_true",
                   help="admit arbitrary pickle in SRC (only for a source you trust)")
    p.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    add_memory_budget(p)
    add_max_arrays(p)
    p.set_defaults(fn=_cmd)
