"""The map is true: imports point only downward, frameworks only where they belong.

The order is the one ``docs/architecture.md`` draws. A package may import
any package on a lower level, never one on its own level or above; the
framework runtimes (torch, JAX) are imported -- or looked up in
``sys.modules`` -- only by providers, distributed and integrations (and by
the ``testing`` helpers, which compare framework values in tests).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "statestream"

#: top to bottom; packages on one level must not import each other
LAYERS: list[set[str]] = [
    # testing sits above the CLI: the fuzzing harness runs ``statestream inspect``
    {"__init__", "__main__", "testing"},
    {"cli", "integrations"},
    {"manager"},
    {"api"},
    {"interop"},
    {"engine"},
    {"plan", "providers"},
    {"storage"},
    {"format"},
    {"distributed"},
    {"tree"},
    {"errors", "_version", "_hooks", "_gc", "_memory"},
]
LEVEL = {pkg: i for i, level in enumerate(LAYERS) for pkg in level}
FRAMEWORKS = ("torch", "jax", "jaxlib", "flax", "optax")
# interop writes torch.save / DCP files (torch imported lazily, only by those writers)
FRAMEWORK_HOMES = {"providers", "distributed", "integrations", "interop", "testing"}
_NAMES = "|".join(FRAMEWORKS)
_LOOKUP = re.compile(r"""sys\.modules(?:\.get\(|\[)\s*["'](""" + _NAMES + r""")\b""")


def _modules() -> list[tuple[str, Path]]:
    out = []
    for p in sorted(SRC.rglob("*.py")):
        rel = p.relative_to(SRC)
        pkg = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        out.append((pkg, p))
    return out


def _imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.lineno, node.module))
    return found


def test_every_package_has_a_level() -> None:
    missing = sorted({pkg for pkg, _ in _modules()} - set(LEVEL))
    assert not missing, f"packages not placed in LAYERS (and docs/architecture.md): {missing}"


@pytest.mark.parametrize("pkg,path", _modules(), ids=lambda x: str(x))
def test_imports_point_down(pkg: str, path: Path) -> None:
    bad = []
    for line, mod in _imports(path):
        parts = mod.split(".")
        if parts[0] != "statestream" or len(parts) < 2 or parts[1] == pkg:
            continue
        target = parts[1]
        if target not in LEVEL:
            bad.append(f"line {line}: {mod} (package not in LAYERS)")
        elif LEVEL[target] <= LEVEL[pkg] and pkg not in ("__init__", "__main__"):
            bad.append(f"line {line}: {pkg} imports {mod}, which is not below it")
    assert not bad, f"{path.relative_to(SRC)}: " + "; ".join(bad)


@pytest.mark.parametrize("pkg,path", _modules(), ids=lambda x: str(x))
def test_framework_code_only_in_its_homes(pkg: str, path: Path) -> None:
    if pkg in FRAMEWORK_HOMES:
        return
    bad = [f"line {line}: import {mod}" for line, mod in _imports(path)
           if mod.split(".")[0] in FRAMEWORKS]
    text = path.read_text()
    bad += [f"sys.modules lookup of {m.group(1)}" for m in _LOOKUP.finditer(text)]
    assert not bad, f"{path.relative_to(SRC)} uses a framework outside providers/: {bad}"


def test_the_rules_catch_violations(tmp_path: Path) -> None:
    # the checks are not vacuous: an upward import and a framework import are seen
    p = tmp_path / "x.py"
    p.write_text("import torch\nfrom statestream.api import save\nimport sys\n"
                 "jax = sys.modules.get('jax')\n")
    mods = [m for _, m in _imports(p)]
    assert "torch" in mods and "statestream.api" in mods
    assert LEVEL["api"] < LEVEL["engine"]
    assert _LOOKUP.search(p.read_text())


@pytest.mark.parametrize("pkg,path", _modules(), ids=lambda x: str(x))
def test_no_private_names_from_other_packages(pkg: str, path: Path) -> None:
    # e.g. api reading a provider registry's private type cache
    bad = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            parts = node.module.split(".")
            if parts[0] == "statestream" and len(parts) > 1 and parts[1] != pkg:
                bad += [f"line {node.lineno}: {a.name} from {node.module}" for a in node.names
                        if a.name.startswith("_") and a.name != "__version__"]
    assert not bad, f"{path.relative_to(SRC)}: {bad}"
