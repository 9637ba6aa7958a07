"""No function in the library is longer than about 80 lines (issue 13).

Length counts every line from the ``def`` (decorators excluded) to the end
of the body, docstring and comments included. A longer function is split
into helpers with clear names.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "statestream"
MAX_LINES = 80


def long_functions(root: Path = SRC, limit: int = MAX_LINES) -> list[str]:
    """``path:line name (N lines)`` for every function or method over ``limit`` lines."""
    out = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                end = node.end_lineno if node.end_lineno is not None else node.lineno
                lines = end - node.lineno + 1
                if lines > limit:
                    rel = path.relative_to(root.parent)
                    out.append(f"{rel}:{node.lineno} {node.name} ({lines} lines)")
    return out


def test_counter_finds_a_long_function(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    (tmp_path / "m.py").write_text(f"def short():\n    pass\n\n\ndef long():\n{body}\n")
    found = long_functions(tmp_path)
    assert len(found) == 1 and "long" in found[0] and f"({MAX_LINES + 1} lines)" in found[0]


def test_no_function_over_80_lines() -> None:
    offenders = long_functions()
    assert not offenders, "split these functions into helpers:\n" + "\n".join(offenders)
