"""The shape of the library: packages layered by part of the pipeline, no import circles (lazy imports inside
functions count: they are circles all the same), no module over 600 lines, and no module using
another module's private names. Static (the AST), so it needs neither a GPU nor the imports to work."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "gdsckpt"
MAX_LINES = 600


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(module: str, level: int, name: str | None, here: str, is_package: bool) -> str:
    if level == 0:
        return name or ""
    base = here.split(".") if is_package else here.split(".")[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _imports(mod: str) -> list[tuple[str, list[str]]]:
    """(imported module, names taken from it) for every import in `mod`, at any depth."""
    path = MODULES[mod]
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names if a.name.startswith("gdsckpt")]
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(mod, node.level, node.module, mod, path.name == "__init__.py")
            if not target.startswith("gdsckpt"):
                continue
            names = [a.name for a in node.names]
            out.append((target, names))
            for n in names:  # `from . import codecs` imports the module gdsckpt.codecs
                if f"{target}.{n}" in MODULES:
                    out.append((f"{target}.{n}", []))
    return out


def _graph() -> dict[str, set[str]]:
    graph = {}
    for mod in MODULES:
        deps = set()
        for target, _ in _imports(mod):
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            # a package's own __init__ is not a dependency of its modules' structure
            if target and target != mod and not mod.startswith(target + ".") and target != "gdsckpt":
                deps.add(target)
        graph[mod] = deps
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    assert _cycles(_graph()) == []


@pytest.mark.parametrize("mod", sorted(MODULES))
def test_module_size(mod):
    lines = len(MODULES[mod].read_text().splitlines())
    assert lines <= MAX_LINES, f"{mod} has {lines} lines (at most {MAX_LINES}): split it by job"


def test_no_private_names_across_modules():
    reaches = []
    for mod in MODULES:
        path = MODULES[mod]
        tree = ast.parse(path.read_text(), str(path))
        aliases = {}  # local name -> gdsckpt module it names
        for target, names in _imports(mod):
            for n in names:
                if n.startswith("_") and not n.startswith("__") and target != mod:
                    reaches.append(f"{mod} imports {target}.{n}")
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                target = _resolve(mod, node.level, node.module, mod, path.name == "__init__.py")
                for a in node.names:
                    if f"{target}.{a.name}" in MODULES:
                        aliases[a.asname or a.name] = f"{target}.{a.name}"
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in MODULES and a.asname:
                        aliases[a.asname] = a.name
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases and node.attr.startswith("_") and not node.attr.startswith("__")):
                reaches.append(f"{mod} uses {aliases[node.value.id]}.{node.attr}")
    assert sorted(set(reaches)) == []


# The packages, lowest first: a module imports from its own part or from parts below it. The top
# level holds only the public face (the modules named here without a package) and the entry points.
LAYERS = ["errors", "_version", "core", "stats", "codecs", "stores", "format", "engine", "writing",
          "reading", "api", "dcp", "manager", "options", "integrations", "cli", "bench", "__main__", ""]
# The one arrow back up: reserve() sizes the memory tier's slots ahead of need with the tier's own
# rule, so that a slot made ahead always fits the step it is made for.
ARROWS_UP = {("gdsckpt.writing.reserve", "gdsckpt.manager.memory.snapshot")}
TOP_LEVEL_MAX = 8
GPU_PACKAGE = "gdsckpt.engine.gpu"
# gdsckpt-bench measures KvikIO itself as a baseline (and names the versions it ran with).
GPU_IMPORT_EXCEPTIONS = {"gdsckpt.bench.baselines", "gdsckpt.bench.provenance"}


def _part(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_packages_are_layered():
    """Every import goes to the module's own part or a part below it, but for ARROWS_UP."""
    up = set()
    for mod, deps in _graph().items():
        for dep in deps:
            a, b = _part(mod), _part(dep)
            assert a in LAYERS and b in LAYERS, f"{mod} or {dep} is in no layer: add its part to LAYERS"
            if a != b and LAYERS.index(b) > LAYERS.index(a):
                up.add((mod, dep))
    assert up == ARROWS_UP


def test_top_level_is_the_public_face():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= TOP_LEVEL_MAX, f"{len(top)} modules directly in gdsckpt/: {top}"
    for sub in PACKAGE.iterdir():
        if sub.is_dir() and sub.name != "__pycache__" and any(sub.rglob("*.py")):
            assert (sub / "__init__.py").is_file(), f"{sub.name}/ has no __init__.py saying what it is"


def test_gpu_imports_only_in_the_engines_gpu_package():
    found = []
    for mod, path in MODULES.items():
        if mod.startswith(GPU_PACKAGE) or mod in GPU_IMPORT_EXCEPTIONS:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            found += [f"{mod} imports {n}" for n in names if n.split(".")[0] in ("cupy", "kvikio")
                      or n.startswith("nvidia.nvcomp")]
    assert found == []
