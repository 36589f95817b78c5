"""The code's shape, as docs/ARCHITECTURE.md states it: packages import only the layers below them, no import
cycle in src/ (imports inside functions counted), the training and parallelism packages in files and functions one
can read, and no module reaching into another's private names."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80
SIZE_CHECKED = ("train", "parallel")
# Package -> the packages of attnpool's it may import (docs/ARCHITECTURE.md's table).
BASE = {"errors", "sizes", "console", "kinds"}
LAYERS = {
    "plan": BASE, "comm": BASE, "sparse": BASE | {"plan"}, "kernels": BASE | {"sparse"},
    "runtime": BASE | {"plan", "comm", "kernels", "sparse"}, "model": BASE, "data": BASE | {"plan"},
    "parallel": BASE | {"model", "plan"}, "sim": BASE | {"plan", "data", "model"},
    "train": BASE | {"plan", "comm", "sparse", "kernels", "runtime", "model", "data", "parallel", "sim"},
}


def modules() -> dict[str, Path]:
    out = {}
    for path in (SRC / "attnpool").rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def import_nodes(tree: ast.AST):
    """Every import statement, inside functions too, but not those only a type checker runs."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        yield from import_nodes(node)


def imported_module(node: ast.ImportFrom, name: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = name.split(".") if is_package else name.split(".")[:-1]
    base = base[:len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph() -> dict[str, set[str]]:
    """module -> the modules it imports. A name a package's ``__init__`` only hands on (``from attnpool.plan import
    plan_attention``) counts as an import of the module that defines it."""
    mods = modules()
    trees = {name: ast.parse(path.read_text()) for name, path in mods.items()}

    def handed_on(package: str) -> dict[str, str]:
        out = {}
        for node in import_nodes(trees[package]):
            if isinstance(node, ast.ImportFrom):
                source = imported_module(node, package, True)
                if source in mods and source != package:
                    out.update({alias.asname or alias.name: source for alias in node.names})
        return out

    graph = {}
    for name, tree in trees.items():
        is_package = mods[name].name == "__init__.py"
        edges = set()
        for node in import_nodes(tree):
            if isinstance(node, ast.Import):
                edges.update(alias.name for alias in node.names if alias.name in mods)
                continue
            source = imported_module(node, name, is_package)
            for alias in node.names:
                if f"{source}.{alias.name}" in mods:
                    edges.add(f"{source}.{alias.name}")
                elif source in mods and mods[source].name == "__init__.py" and source != name:
                    edges.add(handed_on(source).get(alias.name, source))
                elif source in mods:
                    edges.add(source)
        graph[name] = edges - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_in_src():
    assert cycles(import_graph()) == []


def test_packages_import_only_the_layers_below_them():
    crossing = set()
    for module, imported in import_graph().items():
        package = module.split(".")[1] if module.count(".") else None
        for other in imported:
            target = other.split(".")[1] if other.count(".") else None
            if package in LAYERS and target != package and target not in LAYERS[package]:
                crossing.add(f"{module} -> {other}")
    assert sorted(crossing) == []


def test_the_cycle_check_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_train_and_parallel_files_and_functions_stay_readable():
    too_long = []
    for package in SIZE_CHECKED:
        for path in sorted((SRC / "attnpool" / package).glob("*.py")):
            text = path.read_text()
            if len(text.splitlines()) > MAX_FILE_LINES:
                too_long.append(f"{path.name}: {len(text.splitlines())} lines")
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > MAX_FUNCTION_LINES:
                        too_long.append(f"{path.name}: {node.name} has {lines} lines")
    assert too_long == []


def test_no_module_imports_another_modules_private_names():
    reached = []
    for name, path in modules().items():
        for node in import_nodes(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("attnpool"):
                reached += [f"{name} takes {node.module}.{a.name}" for a in node.names
                            if a.name.startswith("_") and not a.name.startswith("__")]
    assert reached == []
