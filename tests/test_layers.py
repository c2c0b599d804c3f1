"""Imports point one way (shared/DESIGN.md): library/io.py and the other leaf helpers of library/
at the bottom, then library/precision and library/data (side by side: neither imports the other),
then library/models, networks/, library/training, train_lora.py beside library/ui, and tools/ at the top. A module
imports only from its own layer or the layers below it, so a layer can be read, tested and
changed without the ones above it. The project's import graph has no cycles either.

Both tests read the source (ast), never import it: every import statement counts, also the lazy
ones inside functions (they run too, only later). bench/ and tests/ may import anything.
"""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROJECT = ("library", "networks", "tools", "train_lora")  # top-level names of the project's modules

# layer -> rank, bottom first; a module may import its own layer or a lower rank. precision and data
# share a rank and stay apart: fp8 storage and the training data have nothing to share.
# ui (the web UI) sits beside train_lora: it runs train_lora.py as a subprocess and never imports it.
RANKS = {"io": 0, "precision": 1, "data": 1, "models": 2, "networks": 3, "training": 4, "train_lora": 5, "ui": 5,
         "tools": 6}


def layer_of(path: str) -> str:
    """The layer of a project file (path relative to the repository root, '/'-separated)."""
    parts = path.split("/")
    if parts[0] == "library":
        return "io" if len(parts) == 2 else parts[1]  # library/*.py: io and the leaf helpers
    return "train_lora" if path == "train_lora.py" else parts[0]


def project_files() -> list[str]:
    files = ["train_lora.py"]
    for top in ("library", "networks", "tools"):
        for folder, _, names in os.walk(os.path.join(ROOT, top)):
            files += [os.path.relpath(os.path.join(folder, n), ROOT).replace(os.sep, "/") for n in names if n.endswith(".py")]
    return sorted(files)


def module_file(module: str) -> str | None:
    """The project file that defines `module` (a dotted name), or None if it is not one."""
    base = module.replace(".", "/")
    for path in (base + ".py", base + "/__init__.py"):
        if os.path.isfile(os.path.join(ROOT, path)):
            return path
    return None


def imports_of(path: str) -> list[tuple[int, str]]:
    """(line, imported project file) for every import statement anywhere in `path`. `from package
    import name` imports the module package/name where there is one, else the package."""
    tree = ast.parse(open(os.path.join(ROOT, path), encoding="utf-8").read(), path)
    package = path.rsplit("/", 1)[0].replace("/", ".") if "/" in path else ""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the file's own package upwards
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            modules = [f"{base}.{alias.name}" if module_file(f"{base}.{alias.name}") else base for alias in node.names]
        else:
            continue
        for module in modules:
            target = module_file(module) if module.split(".")[0] in PROJECT else None
            if target and not target.endswith("__init__.py"):  # the project's packages hold no code
                found.append((node.lineno, target))
    return found


def test_imports_point_down_the_layers():
    offending = []
    for path in project_files():
        layer = layer_of(path)
        for line, target in imports_of(path):
            other = layer_of(target)
            if other != layer and RANKS[other] >= RANKS[layer]:
                offending.append(f"{path}:{line} imports {target} (layer {layer} -> layer {other})")
    assert not offending, f"{len(offending)} imports point up or sideways:\n" + "\n".join(offending)


def test_project_imports_have_no_cycles():
    graph = {path: sorted({target for _, target in imports_of(path)} - {path}) for path in project_files()}
    cycles = [" -> ".join(cycle_in(graph, component)) for component in strongly_connected(graph) if len(component) > 1]
    assert not cycles, f"{len(cycles)} import cycles (modules that import each other, directly or not):\n" + "\n".join(cycles)


def strongly_connected(graph: dict[str, list[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components: a component of more than one module is a cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components = []

    def visit(node: str):
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, []):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            components.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return components


def cycle_in(graph: dict[str, list[str]], component: list[str]) -> list[str]:
    """One shortest import cycle through the first module of a strongly connected component."""
    start, members = component[0], set(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        node = frontier.pop(0)
        for nxt in graph[node]:
            if nxt == start:
                return paths[node] + [start]
            if nxt in members and nxt not in paths:
                paths[nxt] = paths[node] + [nxt]
                frontier.append(nxt)
    return component  # unreachable for a real component
