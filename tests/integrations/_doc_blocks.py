"""The code blocks of README.md and docs/*.md, and the directives that say how each runs.

A ```python (or ```sh) block runs as it is written, in a fresh interpreter whose
working directory is an empty scratch directory. A block that needs more says so in
an HTML comment right above it (invisible on the rendered page)::

    <!-- doc-test: setup=torch-model; check=readme-load; s3 -->

Directives, separated by ``;``:

- ``setup=NAME[,NAME]``: code from ``_doc_setups.SETUPS`` runs first (what the
  page's text assumes: a ``model``, a ``state``, a saved checkpoint).
- ``check=NAME``: code from ``_doc_setups.CHECKS`` runs after the block and asserts
  what the text next to it claims.
- ``continues``: the block runs after the page's previous block, in the same process.
- ``procs=N``: N real processes on loopback (``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/
  ``MASTER_PORT`` set; a setup joins them into a torch.distributed or JAX job).
- ``s3``: ``AWS_*`` point at a loopback S3 server holding the buckets ``my-bucket``
  and ``bucket``; ``s3-server``: the server only, for a block that configures
  its own endpoint (see ``replace``).  ``devices=N``: N CPU devices for JAX.
- ``replace=OLD->NEW``: OLD is replaced in the block by NEW, where ``{tmp}`` is the
  scratch directory and ``{s3_endpoint}`` the loopback server (for paths and
  endpoints that only exist on the reader's machine).
- ``skip=REASON``: the block does not run here; REASON appears in the test id.

Every other block kind (```json, plain ```) is not collected here.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
_DIRECTIVE = re.compile(r"<!--\s*doc-test:((?:(?!-->).)*)-->\s*\Z", re.S)
RUNNABLE = ("python", "sh")


@dataclasses.dataclass
class Block:
    page: str  # relative to the repository root
    line: int  # of the opening fence
    lang: str
    code: str
    opts: dict[str, str]

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"


def parse_directive(text: str) -> dict[str, str]:
    opts: dict[str, str] = {}
    for part in text.split(";"):
        part = part.strip()
        if part:
            key, _, value = part.partition("=")
            opts[key.strip()] = value.strip()
    return opts


def page_blocks(path: Path) -> list[Block]:
    """Every fenced block of a page, with the directive right above it (if any)."""
    text = path.read_text(encoding="utf-8")
    out = []
    for m in _FENCE.finditer(text):
        before = text[:m.start()]
        d = _DIRECTIVE.search(before)
        opts = parse_directive(d.group(1)) if d else {}
        out.append(Block(str(path.relative_to(ROOT)), before.count("\n") + 1, m.group(1),
                         m.group(2), opts))
    return out


def runnable_groups() -> list[list[Block]]:
    """The runnable blocks, a ``continues`` block joined to the one before it."""
    groups: list[list[Block]] = []
    for page in PAGES:
        for block in page_blocks(page):
            if block.lang not in RUNNABLE:
                continue
            if "continues" in block.opts:
                assert groups and groups[-1][0].page == block.page, block.name
                groups[-1].append(block)
            else:
                groups.append([block])
    return groups


def group_id(group: list[Block]) -> str:
    first = group[0]
    name = first.name + "".join(f"+{b.line}" for b in group[1:])
    reason = first.opts.get("skip")
    return f"{name}[skip: {reason}]" if reason else name


def apply_replacements(block: Block, values: dict[str, str]) -> str:
    code = block.code
    if "replace" in block.opts:
        for pair in block.opts["replace"].split(","):
            old, _, new = pair.partition("->")
            assert old.strip() in code, f"{block.name}: {old.strip()!r} is not in the block"
            code = code.replace(old.strip(), new.strip().format(**values))
    return code
