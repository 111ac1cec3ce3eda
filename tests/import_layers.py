"""The project's import graph and its layer order, for tests/test_layers.py.

Every ``import`` statement of every module counts, also those inside functions (a lazy import that points up is
still an arrow up), except those under ``if TYPE_CHECKING:``.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

# Bottom to top: a module may import modules of its own layer and of the layers before it. ``runtime`` alone is
# the entry point (runtime/__main__.py) that calls the CLI; ``bench`` stands on everything and nothing imports it.
LAYERS = ("runtime.core", "backends", "runtime.model", "runtime.engine", "runtime.app", "containers", "runtime",
          "bench")
# The one arrow allowed to point up: the CLI calls the composition root.
ALLOWED_UP = {("runtime.app", "containers")}
PACKAGES = ("runtime", "backends", "bench")
ROOT_MODULES = ("containers",)


def layer_of(module: str) -> str:
    """The longest layer name that is ``module`` or a package above it."""
    best = ""
    for layer in LAYERS:
        if (module == layer or module.startswith(layer + ".")) and len(layer) > len(best):
            best = layer
    if not best:
        raise ValueError(f"module {module!r} belongs to no layer; add its package to LAYERS in {__file__}")
    return best


def project_modules(root: Path) -> dict[str, Path]:
    """Module name -> file, for the project's packages and root modules under ``root``."""
    mods = {}
    for pkg in PACKAGES:
        for p in sorted((root / pkg).rglob("*.py")):
            parts = p.relative_to(root).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            mods[name] = p
    for m in ROOT_MODULES:
        if (root / f"{m}.py").exists():
            mods[m] = root / f"{m}.py"
    return mods


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def import_edges(root: Path, type_checking: bool = False) -> dict[str, set[str]]:
    """Module -> the project modules it imports (each ``from a import b`` counts as ``a``, and as ``a.b`` when
    that is a module). ``type_checking``: also the imports under ``if TYPE_CHECKING:`` (an annotation that names
    a module is still a dependency on it, and two modules that name each other still form a circle)."""
    mods = project_modules(root)
    edges: dict[str, set[str]] = defaultdict(set)
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        skip = set() if type_checking else _type_checking_nodes(tree)
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(tree):
            if id(node) in skip or not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                if node.level:
                    base = base[: len(base) - node.level + 1]
                    prefix = ".".join(base + ([node.module] if node.module else []))
                else:
                    prefix = node.module or ""
                targets = [prefix] + [f"{prefix}.{a.name}" for a in node.names]
            for t in targets:
                while t and t not in mods:  # `import a.b.c` of a package path: the deepest project module
                    t = t.rpartition(".")[0]
                if t and t != mod and not mod.startswith(t + "."):
                    edges[mod].add(t)
    return edges


def layer_violations(edges: dict[str, set[str]]) -> list[str]:
    """Every import that points to a higher layer (but the allowed ones), as 'a imports b (layer x above y)'."""
    rank = {layer: i for i, layer in enumerate(LAYERS)}
    out = []
    for a, targets in sorted(edges.items()):
        la = layer_of(a)
        for b in sorted(targets):
            lb = layer_of(b)
            if rank[lb] > rank[la] and (la, lb) not in ALLOWED_UP:
                out.append(f"{a} imports {b}: layer {lb} is above {la} (order, bottom first: {', '.join(LAYERS)})")
    return out


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import circle as [a, b, ..., a], or None."""
    color: dict[str, int] = {}
    stack: list[str] = []

    def dfs(u: str) -> list[str] | None:
        color[u] = 1
        stack.append(u)
        for v in sorted(edges.get(u, ())):
            if color.get(v) == 1:
                return stack[stack.index(v):] + [v]
            if v not in color and (c := dfs(v)):
                return c
        color[u] = 2
        stack.pop()
        return None

    for u in sorted(edges):
        if u not in color and (c := dfs(u)):
            return c
    return None
