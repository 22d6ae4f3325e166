"""Layering: the library never imports the training job, nothing imports a
top-level `training`, and the modules of both packages import each other without cycles.

Read with `ast`, so nothing is imported and the test is fast. Every import statement
counts, function-local ones and those under `if TYPE_CHECKING:` too: a cycle hidden inside
a function is still a cycle of the design. An edge goes to the most specific module named
(`from pkg import module` -> pkg.module, `from pkg import name` -> pkg); the parent packages
that Python initialises on the way are not edges, or every package whose __init__ imports
a submodule would be a cycle.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARY, TRAINING = "vllm_mtpspec", "vllm_mtpspec_train"
OLD_TRAINING = "training"  # the training job's name before it was namespaced


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def python_files(*folders: str) -> list[Path]:
    return [path for folder in folders for path in sorted((ROOT / folder).rglob("*.py"))]


def imports(path: Path, modules: set[str]) -> set[str]:
    """The modules path's import statements name, relative imports resolved: a module of
    `modules` where one is named, else the dotted name as written."""
    name = module_name(path)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    named = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            named.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # from . import x, from ..y import z
                anchor = package[:len(package) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                named.add(submodule if submodule in modules else base)
    return named


def module_graph() -> dict[str, set[str]]:
    """Module -> the modules of vllm_mtpspec and vllm_mtpspec_train it imports."""
    files = {module_name(path): path for path in python_files(LIBRARY, TRAINING)}
    return {name: {m for m in imports(path, set(files)) if m in files and m != name} for name, path in files.items()}


def strongly_connected_components(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; the components of more than one module."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_library_never_imports_the_training_package():
    graph = module_graph()
    assert set(graph) >= {f"{LIBRARY}.cli", f"{TRAINING}.train"}, "the packages were not found where expected"
    offending = {name: sorted(m for m in edges if m.split(".")[0] == TRAINING)
                 for name, edges in graph.items() if name.split(".")[0] == LIBRARY}
    offending = {name: edges for name, edges in offending.items() if edges}
    assert not offending, ("vllm_mtpspec imports vllm_mtpspec_train (file formats belong in the library; training "
                           f"commands register through the mtpspec.commands entry points): {offending}")


def test_nothing_imports_a_top_level_training_package():
    files = python_files(LIBRARY, TRAINING, "tests", "benchmarks", "scripts")
    offending = sorted(str(path.relative_to(ROOT)) for path in files
                       if any(m.split(".")[0] == OLD_TRAINING for m in imports(path, set())))
    assert not offending, f"these import `training`, now {TRAINING}: {offending}"


def test_no_import_cycles():
    graph = module_graph()
    cycles = strongly_connected_components(graph)
    described = "\n".join(
        " <-> ".join(component) + "\n    " + "; ".join(f"{m} -> {', '.join(sorted(graph[m] & set(component)))}"
                                                   for m in component)
        for component in cycles)
    assert not cycles, f"{len(cycles)} import cycle(s) (break each by moving the shared piece down):\n{described}"


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert strongly_connected_components(graph) == [["a", "b", "c"]]
