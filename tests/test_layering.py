"""specserve's subpackages import only downward, so each layer can be read, tested and replaced without the
ones above it. Every import counts, those inside functions and under TYPE_CHECKING too: a deferred import
still ties the lower package to the upper one."""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path


ROOT = "specserve"
PACKAGE = Path(__file__).resolve().parents[1] / ROOT

# Lowest first. A package may import its own layer and those below it; the bottom holds what everything
# shares (step types, frozen config, switches, shipped configs and heads).
LAYERS = (
    ("core", "config", "envs", "transfer", "graph_shapes", "model_configs", "draft_heads", "distributed"),
    ("kernels",),
    ("layers",),
    ("sampling", "structured"),
    ("models",),
    ("kv",),
    ("speculative",),
    ("engine",),
    ("llm",),
    ("server", "bench", "train"),
    ("cli",),
)
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}
# Left while the GEMV kernels still reach up into layers: specserve.kernels.triton.gemv imports
# specserve.layers.linear (at module level and in two functions), which imports the kernels back.
def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def subpackage(module: str) -> str | None:
    """The first component under the root (`specserve.engine.runner` -> `engine`); None for the root."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def root_exports() -> dict[str, str]:
    """Names the root package re-exports -> the module each comes from (`LLM` -> `specserve.llm`)."""
    exports = {}
    for node in ast.walk(ast.parse(MODULES[ROOT].read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(ROOT + "."):
            exports.update({alias.asname or alias.name: node.module for alias in node.names})
    return exports


EXPORTS = root_exports()


def imported_modules(module: str) -> list[tuple[int, str]]:
    """(line, module) for every specserve module that `module` imports, wherever the import stands. `from
    a import b` names `a.b` where that is a module, else `a` (or, for a name the root re-exports, its source)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join([*parts[: len(parts) - node.level + 1], *([base] if base else [])])
            for alias in node.names:
                found.append((node.lineno, _source_of(base, alias.name)))
    return [(line, name) for line, name in found if name == ROOT or name.startswith(ROOT + ".")]


def _source_of(base: str, name: str) -> str:
    if f"{base}.{name}" in MODULES:
        return f"{base}.{name}"
    return EXPORTS.get(name, base) if base == ROOT else base


def edges() -> dict[tuple[str, str], list[str]]:
    """(importing subpackage, imported subpackage) -> the imports that make the edge, as 'module:line name'."""
    graph = defaultdict(list)
    for module in MODULES:
        source = subpackage(module)
        if source is None:
            continue  # the root: its eager imports are checked on their own
        for line, name in imported_modules(module):
            target = subpackage(name)
            if target is not None and target != source:
                graph[(source, target)].append((module, line, name))
    return {edge: [f"{m}:{line} imports {name}" for m, line, name in sorted(set(sites))]
            for edge, sites in graph.items()}


def test_every_subpackage_has_a_layer():
    unplaced = sorted({subpackage(m) for m in MODULES} - set(RANK) - {None})
    assert not unplaced, f"place these in LAYERS: {unplaced}"


def test_the_root_package_eagerly_imports_only_the_bottom_layer():
    # Importing any submodule runs the root's __init__ first, so what it imports at module level sits under
    # everything; the rest (LLM) it imports lazily.
    tree = ast.parse(MODULES[ROOT].read_text())
    eager = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = [alias.name if isinstance(n, ast.Import) else n.module for n in eager for alias in n.names]
    above = [n for n in names if n.startswith(ROOT + ".") and RANK.get(subpackage(n), 1) > 0]
    assert not above, f"{ROOT}/__init__.py imports these at module level: {above}"


def test_no_subpackage_imports_one_above_it():
    upward = [f"{src} -> {dst}: {site}" for (src, dst), sites in sorted(edges().items())
              if RANK.get(dst, 0) > RANK.get(src, 0) for site in sites]
    assert not upward, "imports of a higher layer:\n" + "\n".join(upward)


def test_subpackages_import_each_other_without_cycles():
    graph = edges()
    cycles = _cycles({src for src, _ in graph} | {dst for _, dst in graph}, graph)
    report = []
    for cycle in cycles:
        report.append(" -> ".join([*cycle, cycle[0]]))
        for src, dst in zip(cycle, [*cycle[1:], cycle[0]]):
            report += [f"    {site}" for site in graph[(src, dst)]]
    assert not cycles, "import cycles between subpackages:\n" + "\n".join(report)


def _cycles(nodes: set[str], graph: dict[tuple[str, str], list[str]]) -> list[list[str]]:
    """One shortest cycle through each subpackage that lies on any, deduplicated."""
    successors = defaultdict(set)
    for src, dst in graph:
        successors[src].add(dst)
    found = {}
    for start in sorted(nodes):
        paths, seen = [[start]], {start}
        while paths:
            path = paths.pop(0)
            for nxt in sorted(successors[path[-1]]):
                if nxt == start:
                    cycle = path[path.index(min(path)):] + path[: path.index(min(path))]
                    found.setdefault(tuple(cycle), list(cycle))
                    paths = []
                    break
                if nxt not in seen:
                    seen.add(nxt)
                    paths.append([*path, nxt])
    return list(found.values())
