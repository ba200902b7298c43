"""The layering of docs/architecture.md, checked on the source: no import (module level or inside a function) points
up the layer list, and the packages' import graph has no cycle. Reference: the ```layers block of that file."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "trtllm_kivi"


def layers() -> dict[str, int]:
    """Top-level module/package name -> layer rank (0 = bottom)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = re.search(r"```layers\n(.*?)```", text, re.S)
    assert block, "docs/architecture.md has no ```layers block"
    lines = [ln.split() for ln in block.group(1).strip().splitlines()]
    return {name: len(lines) - 1 - i for i, names in enumerate(lines) for name in names}


def unit(module: str) -> str:
    """trtllm_kivi.runtime.scheduler -> runtime; trtllm_kivi.cache -> cache; trtllm_kivi -> __init__."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports() -> list[tuple[str, str, int]]:
    """(importing module, imported trtllm_kivi module, line) for every import in the package."""
    out = []
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        mod = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        pkg = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                out += [(mod, a.name, node.lineno) for a in node.names if a.name.startswith("trtllm_kivi")]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if target.startswith("trtllm_kivi"):
                    names = [target] if node.module else [f"{target}.{a.name}" for a in node.names]
                    out += [(mod, t, node.lineno) for t in names]
    return out


def test_every_module_is_in_the_layer_list():
    ranks = layers()
    units = {unit(".".join(p.relative_to(ROOT).with_suffix("").parts)) for p in PKG.rglob("*.py")}
    assert units - set(ranks) == set(), "add these to docs/architecture.md's layer list"


def test_no_import_points_up_the_layers():
    ranks = layers()
    up = [f"{m}:{line} imports {t}" for m, t, line in imports()
          if unit(t) in ranks and unit(m) in ranks and ranks[unit(t)] > ranks[unit(m)]]
    assert up == []


def test_no_import_cycle_between_packages():
    edges: dict[str, set[str]] = {}
    for m, t, _ in imports():
        if unit(m) != unit(t):
            edges.setdefault(unit(m), set()).add(unit(t))
    state: dict[str, int] = {}

    def visit(n: str, path: list[str]) -> None:
        state[n] = 1
        for t in edges.get(n, ()):
            assert state.get(t) != 1, f"import cycle: {' -> '.join(path + [n, t])}"
            if t not in state:
                visit(t, path + [n])
        state[n] = 2

    for n in list(edges):
        if n not in state:
            visit(n, [])


def test_the_scan_finds_an_upward_import():
    """The check can fail: the scan sees runtime -> builder if a runner imported the builder."""
    ranks = layers()
    assert ranks["builder"] > ranks["runtime"] > ranks["cache"] > ranks["reference"] > ranks["format"]
    assert any(unit(t) == "op" and unit(m) == "runtime" for m, t, _ in imports())  # the scan sees real imports
