"""Which of the project's top-level packages import which, read from the source (ast), counting every import
statement that can run (module level and inside functions; `if TYPE_CHECKING:` blocks never run).

    python -m tools.import_graph            # one line per edge: importer -> imported  statements
    python -m tools.import_graph --files    # and the files behind each edge

tests/test_import_rules.py holds the project to its rules with the same reading."""
from __future__ import annotations

import ast
import sys
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("core", "appliance", "uaserver", "loader", "models", "kernels", "certs")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def runtime_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement that can run: all of them but those under `if TYPE_CHECKING:`."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def absolute_module(node: ast.ImportFrom, path: Path) -> str:
    """The module a `from ... import` statement names, relative imports resolved."""
    base = node.module or ""
    if node.level:
        name = module_name(path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
        base = ".".join(parts + ([base] if base else []))
    return base


def imported_modules(path: Path, known: set[str]) -> set[str]:
    """The modules of `known` that the file imports (relative imports resolved; `from pkg import sub` names the
    submodule, `from pkg import name` the package)."""
    found: set[str] = set()
    for node in runtime_imports(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in known}
            continue
        base = absolute_module(node, path)
        for alias in node.names:
            if f"{base}.{alias.name}" in known:
                found.add(f"{base}.{alias.name}")
            elif base in known:
                found.add(base)
    return found - {module_name(path)}


def imported_packages(path: Path) -> list[tuple[str, int]]:
    """(top-level package, line) for each import statement of the file, relative imports resolved, one entry per
    package a statement names."""
    found: list[tuple[str, int]] = []
    for node in runtime_imports(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(top, node.lineno) for top in sorted({a.name.split(".")[0] for a in node.names})]
        else:
            base = absolute_module(node, path)
            if base:
                found.append((base.split(".")[0], node.lineno))
    return found


def top_packages(path: Path) -> set[str]:
    return {top for top, _ in imported_packages(path)}


def package_edges(packages: tuple[str, ...] = PACKAGES) -> dict[tuple[str, str], list[str]]:
    """(importer, imported) -> 'file:line' of each statement, between the project's own packages."""
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for package in packages:
        for path in sorted((ROOT / package).rglob("*.py")) if (ROOT / package).is_dir() else []:
            for top, line in imported_packages(path):
                if top != package and top in packages:
                    edges[(package, top)].append(f"{path.relative_to(ROOT)}:{line}")
    return dict(edges)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
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

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def main(argv: list[str]) -> int:
    edges = package_edges()
    for (importer, imported), where in sorted(edges.items()):
        print(f"{importer} -> {imported}  {len(where)}")
        if "--files" in argv:
            for line in Counter(w.rsplit(":", 1)[0] for w in where).most_common():
                print(f"    {line[0]}  {line[1]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
