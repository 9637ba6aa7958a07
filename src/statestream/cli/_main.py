"""``statestream`` command line: a thin shell over the public API."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import statestream as ss
from statestream.format import over_max_arrays

__all__ = ["add_max_arrays", "json_text", "main", "nonnegative", "path_arg"]


def _human(n: int) -> str:
    x = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if x < 1024 or unit == "TiB":
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1024
    return f"{n} B"  # pragma: no cover


_SHORT = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def safe(text: str) -> str:
    """``text`` with everything a terminal could act on escaped.

    Whatever came out of a checkpoint (keys, strings, type names, user
    metadata, error messages quoting them) goes through here before it is
    printed: control characters (escape sequences, newlines, carriage
    returns), format characters (bidirectional overrides) and lone
    surrogates become ``\\xNN`` / ``\\uNNNN`` escapes, so one printed line
    is one line and nothing in it moves the cursor or recolours the terminal.

    Example:
        >>> safe("a\\x1b[2Jb\\nc\\ud800") == "a" + "\\\\x1b[2Jb" + "\\\\nc" + "\\\\ud800"
        True
    """
    if text.isprintable():
        return text
    out = []
    for ch in text:
        if ch.isprintable():
            out.append(ch)
        elif ch in _SHORT:
            out.append(_SHORT[ch])
        else:
            o = ord(ch)
            out.append(f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}" if o < 0x10000
                       else f"\\U{o:08x}")
    return "".join(out)


def int_text(v: int) -> str:
    """Decimal for ordinary ints; a huge one (Python refuses to print more than 4,300
    digits by default) as its size and the ends of its hex form."""
    if v.bit_length() <= 128:
        return str(v)
    h = format(abs(v), "x")
    return f"{'-' if v < 0 else ''}0x{h[:8]}...{h[-8:]} ({v.bit_length()}-bit int)"


_Row = tuple[str, str, str, str, int, int, "str | None"]


def _describe(leaf: Any) -> tuple[str, str, str, int, int, str | None]:
    if isinstance(leaf, ss.ArrayMetadata):
        dims = ", ".join(str(s) for s in leaf.shape)
        shape = f"({dims},)" if len(leaf.shape) == 1 else f"({dims})"
        return leaf.kind, leaf.dtype, shape, leaf.nbytes, leaf.stored_bytes, leaf.codec
    if isinstance(leaf, int) and not isinstance(leaf, bool):
        text = int_text(leaf)
    else:  # repr escapes control characters and surrogates of a str
        text = safe(repr(leaf[:64] if isinstance(leaf, str) else leaf))
    if len(text) > 40:
        text = text[:37] + "..."
    return "value", type(leaf).__name__, text, 0, 0, None


_PLAIN = (type(None), bool, int, float, str)


def _rows(tree: Any, collapse: bool) -> list[_Row]:
    """One row per leaf; long runs of plain values (RNG states, ...) fold into one row."""
    from statestream.tree import format_keypath

    out: list[_Row] = []

    def walk(x: Any, p: tuple[Any, ...]) -> None:
        if isinstance(x, dict):
            for k, v in x.items():
                walk(v, p + (k,))
        elif isinstance(x, (list, tuple)):
            if collapse and len(x) > 8 and all(isinstance(v, _PLAIN) for v in x):
                types = sorted({type(v).__name__ for v in x})
                out.append((format_keypath(p), "values", "|".join(types),
                            f"{type(x).__name__}[{len(x)}]", 0, 0, None))
                return
            for i, v in enumerate(x):
                walk(v, p + (i,))
        else:
            out.append((format_keypath(p),) + _describe(x))

    walk(tree, ())
    return out


def _cmd_inspect(args: argparse.Namespace) -> int:
    md = ss.metadata(args.path, max_arrays=args.max_arrays)
    rows = _rows(md.tree, collapse=not (args.all or args.json))
    if args.json:
        out = {
            "path": md.path,
            "format": md.format,
            "format_version": md.format_version,
            "total_bytes": md.total_bytes,
            "num_arrays": md.num_arrays,
            "files": md.files,
            "meta": md.meta,
            "bases": md.bases,
            "referenced_bytes": md.referenced_bytes,
            "leaves": [
                {"key": k, "kind": kind, "dtype": dt, "shape": sh, "nbytes": nb,
                 "stored_bytes": st, "codec": codec}
                for k, kind, dt, sh, nb, st, codec in rows
            ],
        }
        print(json_text(out))
        return 0
    print(f"checkpoint  {safe(md.path)}")
    fmt = f"statestream v{md.format_version}" if md.format == "statestream" else md.format
    print(f"format      {safe(fmt)}  ({safe(str(md.meta.get('library', '?')))[:80]})")
    w = min(80, max([len("key path")] + [len(safe(r[0])) for r in rows]))
    coded = any(r[6] is not None for r in rows)  # stored size and codec columns
    extra = f" {'stored':>10}  codec" if coded else ""
    print(f"{'key path':<{w}}  {'kind':<7} {'dtype':<14} {'shape':<22} {'size':>10}{extra}")
    for k, kind, dt, sh, nb, st, codec in rows:
        plain = kind in ("value", "values")
        size = _human(nb) if not plain else ""
        more = f" {_human(st) if not plain else '':>10}  {safe(codec or '')}" if coded else ""
        print(f"{safe(k):<{w}}  {safe(kind):<7} {safe(dt):<14} {sh:<22} {size:>10}{more}")
    n_files = len(md.files)
    print(
        f"total       {md.num_arrays} arrays, {_human(md.total_bytes)} in {n_files} data "
        f"file{'s' if n_files != 1 else ''} ({_human(sum(s for _, s in md.files))} on disk), "
        f"{sum(1 for _ in md.leaves())} leaves"
    )
    if md.bases:
        print(f"depends on  {safe(', '.join(md.bases))} ({_human(md.referenced_bytes)} stored "
              "there, referenced by this incremental checkpoint)")
    return 0


def _json_default(x: Any) -> Any:  # pragma: no cover - meta is plain JSON
    return safe(repr(x))


#: ``--json`` prints containers nested this deep; deeper ones (a manifest's ``meta`` may
#: nest hundreds of levels, which Python's JSON encoder cannot indent) as a note
JSON_DEPTH = 64


def _finite(x: Any, depth: int = 0) -> Any:
    """``x`` with every NaN or infinite float as ``"nan"``, ``"inf"`` or ``"-inf"``, and
    containers below :data:`JSON_DEPTH` levels as the string saying so."""
    if isinstance(x, float):
        return x if math.isfinite(x) else "nan" if math.isnan(x) else "inf" if x > 0 else "-inf"
    if isinstance(x, (dict, list, tuple)) and depth >= JSON_DEPTH:
        return f"({type(x).__name__} nested deeper than {JSON_DEPTH} levels, not shown)"
    if isinstance(x, dict):
        return {_finite(k): _finite(v, depth + 1) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v, depth + 1) for v in x]
    return x


def json_text(doc: Any) -> str:
    """``doc`` as the ``--json`` of every command prints it: strict JSON, ASCII.

    A NaN or infinity (a step's ``loss`` metric, a hostile manifest's ``created_unix``)
    is the string ``"nan"`` / ``"inf"`` / ``"-inf"``: ``ls --json`` and ``inspect
    --json`` printed bare ``NaN`` and ``Infinity``, which no strict parser (JSON.parse,
    Go, serde) reads. ASCII-escaped: no control character or surrogate reaches the
    terminal.

    Example:
        >>> json.loads(json_text({"loss": float("nan"), "best": -float("inf")}))
        {'loss': 'nan', 'best': '-inf'}
    """
    return json.dumps(_finite(doc), indent=2, ensure_ascii=True, allow_nan=False,
                      default=_json_default)


def _cmd_verify(args: argparse.Namespace) -> int:
    from statestream.cli._progress import progress_bar

    # raised (exit 2), not reported as damage (exit 1): nothing at the path, a checkpoint
    # overwritten or deleted while being verified, a refused pickle, unsupported content
    with progress_bar("verify") as cb:
        rep = ss.verify(args.path, allow_pickle=args.allow_pickle, progress=cb,
                        memory=memory_options(args), max_arrays=args.max_arrays)
    if args.json:
        print(json_text({"path": rep.path, "ok": rep.ok, "checked_chunks": rep.checked_chunks,
                         "checked_bytes": rep.checked_bytes,
                         "problems": [str(p) for p in rep.problems]}))
        return 0 if rep.ok else 1
    if rep.ok:
        print(f"OK  {safe(rep.path)}: {rep.checked_chunks} chunks, "
              f"{_human(rep.checked_bytes)} verified")
        return 0
    print(f"DAMAGED  {safe(rep.path)}: {len(rep.problems)} problem(s)", file=sys.stderr)
    for p in rep.problems:
        print(f"  - {safe(p)}", file=sys.stderr)
    return 1


def _cmd_gc(args: argparse.Namespace) -> int:
    from statestream.storage import storage_for
    from statestream.storage._leftovers import sweep, sweep_error

    storage, path = storage_for(args.directory)
    if "://" not in args.directory and not os.path.isdir(path):
        # a mistyped path is not "nothing to remove": say so, as ls does
        raise ss.CheckpointNotFoundError(f"no directory at {args.directory}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        removed, failed = sweep(storage, path, max_age_s=args.max_age_hours * 3600)
    for w in caught:  # a checkpoint put back from an overwrite's .old is an action taken
        text = str(w.message)
        text = text if text.isprintable() else ascii(text)
        print(text, file=sys.stdout if text.startswith("restored ") else sys.stderr)
    for p in removed:
        print(f"removed {p if p.isprintable() else ascii(p)}")
    print(f"{len(removed)} leftover staging director{'y' if len(removed) == 1 else 'ies'} "
          "removed")
    if failed:  # a store that refused or did not answer: not "nothing to remove"
        print(f"error: {safe(str(sweep_error(path, removed, failed)))}", file=sys.stderr)
        return 2
    return 0


def path_arg(text: str) -> str:
    """A path argument: not empty. ``""`` resolved to the current directory, so
    ``statestream ls ""`` listed it and ``statestream gc ""`` collected in it (exit 0),
    from an unset shell variable (``statestream gc "$CKPT_DIR"``)."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path (write . for the current directory)")
    return text


def nonnegative(what: str) -> Callable[[str], float]:
    """An argparse type: a finite number >= 0, called ``what`` in the refusal (a NaN or
    negative tolerance was taken, and no difference could be within it; a NaN or
    negative ``--max-age-hours`` made every leftover of an unverifiable writer old
    enough to remove: another host's save in progress lost its staging area)."""

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not math.isfinite(v) or v < 0:
            raise argparse.ArgumentTypeError(f"{what} is a finite number >= 0, not {text!r}")
        return v

    return parse


def _quiet_stdout() -> None:
    """Point stdout at devnull so the interpreter's final flush cannot raise again."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # pragma: no cover - no real stdout
        pass


def add_memory_budget(p: argparse.ArgumentParser, help: str | None = None) -> None:
    """The ``--memory-budget SIZE`` option (``MemoryOptions.memory_budget_bytes``);
    ``help`` for a command whose use of it (and default) is not the library's."""
    from statestream.cli._convert import parse_size

    p.add_argument("--memory-budget", type=parse_size, metavar="SIZE", default=None,
                   help=help or "host memory for buffers beyond what is read, e.g. 512MiB "
                                "(default: 25%% of RAM, at most 4 GiB)")


def _max_arrays(text: str) -> int:
    """``--max-arrays N``: a whole number from 1 to the format's limit."""
    from statestream.format import MAX_ARRAYS

    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if not 1 <= n <= MAX_ARRAYS:
        raise argparse.ArgumentTypeError(
            f"from 1 to {MAX_ARRAYS} (the format's limit), not {text!r}")
    return n


def add_max_arrays(p: argparse.ArgumentParser, bases: bool = True) -> None:
    """The ``--max-arrays N`` option (the API's ``max_arrays``); ``bases``: the command
    reads an incremental checkpoint's bases too (``ls`` and ``inspect`` read none)."""
    p.add_argument("--max-arrays", type=_max_arrays, metavar="N", default=None,
                   help="refuse a checkpoint whose manifest "
                        + ("(or an incremental one's base's) " if bases else "")
                        + "declares more than N arrays, before decoding them (for checkpoints "
                        "from elsewhere; default: the format's limit, 2^24)")


def memory_options(args: argparse.Namespace) -> ss.MemoryOptions | None:
    n = getattr(args, "memory_budget", None)
    return None if n is None else ss.MemoryOptions(memory_budget_bytes=n)


def build_parser() -> argparse.ArgumentParser:
    """The ``statestream`` command's parser: every subcommand and option (docs/cli.md)."""
    parser = argparse.ArgumentParser(
        prog="statestream", description="Inspect, verify, list, compare and convert checkpoints."
    )
    parser.add_argument("--version", action="version", version=f"statestream {ss.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    from statestream.cli import _convert, _diff, _ls

    raw = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser("inspect", help="show the tree with shapes, dtypes and sizes",
                       formatter_class=raw, epilog="examples:\n  statestream inspect "
                       "ckpts/step_0000001000\n  statestream inspect model.safetensors --json\n")
    p.add_argument("path", type=path_arg)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--all", action="store_true", help="list every value of long sequences")
    add_max_arrays(p, bases=False)
    p.set_defaults(fn=_cmd_inspect)
    p = sub.add_parser("verify", help="re-read every chunk and check its checksum",
                       formatter_class=raw, epilog="examples:\n  statestream verify "
                       "ckpts/step_0000001000\n  statestream verify ckpt --json\n")
    p.add_argument("path", type=path_arg)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--allow-pickle", action="store_true",
                   help="admit arbitrary pickle in a torch.save/DCP checkpoint (only for "
                        "checkpoints you trust)")
    add_memory_budget(p)
    add_max_arrays(p)
    p.set_defaults(fn=_cmd_verify)
    p = sub.add_parser("gc", help="remove what killed saves left in DIRECTORY",
                       formatter_class=raw, epilog="example:\n  statestream gc ckpts/\n")
    p.add_argument("directory", type=path_arg)
    p.add_argument("--max-age-hours", type=nonnegative("an age"), default=24.0,
                   help="remove leftovers whose writer cannot be checked (another host) "
                        "once unchanged this long (default 24)")
    p.set_defaults(fn=_cmd_gc)
    for mod in (_convert, _ls, _diff):
        mod.add_parser(sub)
    return parser


#: the API's advice in a PickleNotAllowedError ("pass allow_pickle=True only if you trust
#: this file", "pass allow_pickle=['k'] (or allow_pickle=True for every pickle leaf)")
_PICKLE_ADVICE = re.compile(
    r"pass allow_pickle=(?:True|\[.*\])(?: \(or allow_pickle=True for every pickle leaf\))?"
    r"(?P<trust> only if you trust this file)?")


def _pickle_advice(msg: str, args: argparse.Namespace) -> str:
    """A refused pickle's message in the command's words: ``--allow-pickle`` where the
    command has it and it was not given; else that this command cannot admit it."""
    def advice(m: re.Match[str]) -> str:
        if getattr(args, "allow_pickle", None) is False:
            return "pass --allow-pickle" + (m["trust"] or "")
        # no such option (inspect)
        trust = " (only if you trust this file)" if m["trust"] else ""
        return (f"statestream {args.command} has no option that admits it; in Python, "
                f"ss.load(path, allow_pickle=True) does{trust}")

    return _PICKLE_ADVICE.sub(advice, msg)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``statestream`` command.

    Example:
        >>> main(["--version"])  # doctest: +SKIP
    """
    args = build_parser().parse_args(argv)
    try:
        rc = int(args.fn(args))
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit flush
        return rc
    except BrokenPipeError:  # the reader went away (``| head``): end quietly
        _quiet_stdout()
        # what a shell reports for a command ended by SIGPIPE (``cat``, ``ls``): not 1,
        # which for ``diff`` and ``verify`` would claim a difference or damage
        return 128 + 13
    except ss.PickleNotAllowedError as exc:
        print(f"error: {safe(_pickle_advice(str(exc), args))}", file=sys.stderr)
        return 2
    except ss.CheckpointError as exc:
        msg = str(exc)
        if over_max_arrays(exc):  # the API's advice in the command's words
            msg = msg.replace("max_arrays); ", "--max-arrays); ").replace(
                "loads with max_arrays= set higher", "is read with --max-arrays set higher")
        print(f"error: {safe(msg)}", file=sys.stderr)
        return 2
    except OSError as exc:  # the path itself is unreadable (permissions, a special file, ...)
        print(f"error: {safe(str(exc))}", file=sys.stderr)
        return 2
