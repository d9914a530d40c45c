#!/usr/bin/env python3
"""Print the import cycles among the modules of one package folder.

Usage: ``python tests/layout/import_cycles.py DIR PACKAGE`` (e.g. ``tokenlake tokenlake``).
Every import counts: module-level, inside functions and under ``TYPE_CHECKING``, since a cycle
that only type checkers see is still two modules that cannot be read one without the other.
Prints one ``cycle: a b c`` line per strongly connected group, then a count; exits 1 if any.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path


def module_files(root: Path, package: str) -> dict[str, Path]:
    files = {}
    for path in sorted(root.rglob("*.py")):
        parts = [p for p in path.relative_to(root).with_suffix("").parts if p != "__init__"]
        files[".".join([package, *parts])] = path
    return files


def import_graph(files: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (packages' ``__init__`` excluded as
    targets: importing ``a.b.c`` runs ``a.b`` first, which is not an edge of the design)."""
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    target = ".".join(base[: len(base) - node.level + 1] + [node.module or ""])
                    target = target.rstrip(".")
                else:
                    target = node.module or ""
                candidates = [target] + [f"{target}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                candidates = [a.name for a in node.names]
            else:
                continue
            for c in candidates:
                if c in files and c != name and files[c].name != "__init__.py":
                    graph[name].add(c)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (iterative Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                group = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    group.append(w)
                    if w == v:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return found


def main(argv: list[str]) -> int:
    root, package = Path(argv[0]), argv[1]
    files = module_files(root, package)
    found = cycles(import_graph(files))
    for group in found:
        print("cycle:", " ".join(group))
    print(f"{len(found)} import cycles among {len(files)} modules of {package}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
