"""The import graph of a package folder, read from its source: what the architecture tests of both packages check.

Every import statement counts, including those inside functions; with ``runtime_only=True`` the imports under
``if TYPE_CHECKING:`` (annotations, not imports) are left out.

Example:
    >>> from pathlib import Path
    >>> modules, graph = import_graph(Path(__file__).resolve().parents[1] / "kernels" / "streamkl")
    >>> layer_unit("streamkl._triton.forward"), "streamkl.api" in modules
    ('_triton', True)
"""

from __future__ import annotations

import ast
from pathlib import Path

#: module -> ``(absolute module, imported names)`` of each of its imports
Graph = dict[str, list[tuple[str, list[str]]]]


def module_name(path: Path, package: Path) -> str:
    """The dotted name of the module at ``path`` inside the package folder ``package``."""
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_unit(module: str) -> str:
    """The layer unit of a module: its first component below the package."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """The ids of the nodes under ``if TYPE_CHECKING:``."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            skipped |= {id(n) for child in node.body for n in ast.walk(child)}
    return skipped


def imports(path: Path, package: Path, runtime_only: bool = False) -> list[tuple[str, list[str]]]:
    """``(absolute module, imported names)`` for every import in ``path``."""
    tree = ast.parse(path.read_text())
    name = module_name(path, package)
    parent = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    skipped = _type_checking_nodes(tree) if runtime_only else set()
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = parent.split(".")
                base = base[:len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            names = [alias.name for alias in node.names]
            if node.module is None:  # `from . import reference`
                found += [(f"{module}.{n}", []) for n in names]
            else:
                found.append((module, names))
    return found


def import_graph(package: Path, runtime_only: bool = False) -> tuple[dict[str, Path], Graph]:
    """The package's modules (name -> path) and their imports (name -> :func:`imports`)."""
    modules = {module_name(p, package): p for p in sorted(package.rglob("*.py"))}
    return modules, {name: imports(path, package, runtime_only) for name, path in modules.items()}


def internal_edges(modules: dict[str, Path], graph: Graph) -> dict[str, set[str]]:
    """module -> the package's modules it imports (a package import counts as its ``__init__``)."""
    return {m: {t for t, _ in imports if t in modules and t != m} for m, imports in graph.items()}


def import_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``edges`` (its modules in order, the first repeated at the end), or None.

    Example:
        >>> import_cycle({"a": {"b"}, "b": {"a"}}), import_cycle({"a": {"b"}, "b": set()})
        (['a', 'b', 'a'], None)
    """
    done: set[str] = set()
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        if node in path:
            return path[path.index(node):] + [node]
        if node in done:
            return None
        path.append(node)
        for target in sorted(edges.get(node, ())):
            cycle = visit(target)
            if cycle:
                return cycle
        path.pop()
        done.add(node)
        return None

    for module in sorted(edges):
        cycle = visit(module)
        if cycle:
            return cycle
    return None
