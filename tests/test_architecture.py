"""The layering of docs/architecture.md, checked on the source: no import (module level or inside a function) points
up the layer list, and neither the packages' import graph nor the modules' has a cycle (every import counts, inside a
function too: a lazy import only hides a cycle). Reference: the ```layers block of that file."""

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


def module_name(path: Path) -> str:
    """trtllm_kivi/cuda/model.py -> trtllm_kivi.cuda.model; trtllm_kivi/cuda/__init__.py -> trtllm_kivi.cuda."""
    rel = path.relative_to(ROOT).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


MODULES = {module_name(p) for p in PKG.rglob("*.py")}


def resolve(name: str) -> str:
    """The module an imported name lives in: the longest prefix of it that is a module of the package
    (trtllm_kivi.cuda.launch.LaunchPlan -> trtllm_kivi.cuda.launch; trtllm_kivi.cuda.fragments -> itself)."""
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def scan(mod: str, is_package: bool, source: str) -> list[tuple[str, str, int]]:
    """(mod, imported trtllm_kivi module, line) for every import in `source` (at any depth: inside functions too);
    `from X import a` imports module X.a when that is a module, else module X."""
    pkg = mod if is_package else mod.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(mod, resolve(a.name), node.lineno) for a in node.names if a.name.startswith("trtllm_kivi")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("trtllm_kivi"):
                out += [(mod, resolve(f"{target}.{a.name}"), node.lineno) for a in node.names]
    return out


def imports() -> list[tuple[str, str, int]]:
    """scan() of every module of the package."""
    return [i for path in PKG.rglob("*.py")
            for i in scan(module_name(path), path.name == "__init__.py", path.read_text())]


def test_every_module_is_in_the_layer_list():
    ranks = layers()
    units = {unit(".".join(p.relative_to(ROOT).with_suffix("").parts)) for p in PKG.rglob("*.py")}
    assert units - set(ranks) == set(), "add these to docs/architecture.md's layer list"


def test_no_import_points_up_the_layers():
    ranks = layers()
    up = [f"{m}:{line} imports {t}" for m, t, line in imports()
          if unit(t) in ranks and unit(m) in ranks and ranks[unit(t)] > ranks[unit(m)]]
    assert up == []


def find_cycle(edges: dict[str, set[str]]) -> list[str]:
    """One cycle of the directed graph as [a, b, ..., a], or [] when it has none (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(n: str, path: list[str]) -> list[str]:
        state[n] = 1
        for t in sorted(edges.get(n, ())):
            if state.get(t) == 1:
                return path[path.index(t):] + [n, t] if t in path else [n, t]
            if t not in state and (found := visit(t, path + [n])):
                return found
        state[n] = 2
        return []

    for n in sorted(edges):
        if n not in state and (found := visit(n, [])):
            return found
    return []


def import_graph(key, found: list[tuple[str, str, int]]) -> dict[str, set[str]]:
    """The edges key(importer) -> key(imported) between different keys (packages: unit; modules: the name)."""
    edges: dict[str, set[str]] = {}
    for m, t, _ in found:
        if key(m) != key(t):
            edges.setdefault(key(m), set()).add(key(t))
    return edges


def test_no_import_cycle_between_packages():
    cycle = find_cycle(import_graph(unit, imports()))
    assert cycle == [], f"import cycle: {' -> '.join(cycle)}"


def test_no_import_cycle_between_modules():
    cycle = find_cycle(import_graph(lambda m: m, imports()))
    assert cycle == [], f"import cycle: {' -> '.join(cycle)}"


def test_the_cycle_check_can_fail():
    """A lazy import inside a function closes a cycle as well: the scan records it, and with it the module graph of
    the package has a cycle (the CPU kernel model imports the launch plan; here the plan imports it back)."""
    lazy = scan("trtllm_kivi.cuda.launch", False, "def plan():\n    from .model import append\n")
    assert lazy == [("trtllm_kivi.cuda.launch", "trtllm_kivi.cuda.model", 2)]
    cycle = find_cycle(import_graph(lambda m: m, imports() + lazy))
    assert cycle[0] == cycle[-1] and {"trtllm_kivi.cuda.launch", "trtllm_kivi.cuda.model"} <= set(cycle)
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}}) == []


def test_the_scan_finds_an_upward_import():
    """The check can fail: the scan sees runtime -> builder if a runner imported the builder."""
    ranks = layers()
    assert ranks["builder"] > ranks["runtime"] > ranks["cache"] > ranks["reference"] > ranks["format"]
    assert any(unit(t) == "op" and unit(m) == "runtime" for m, t, _ in imports())  # the scan sees real imports
