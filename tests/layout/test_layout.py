"""The house rules of the layout: no import circle in the control plane, imports point one
way between the floors, and ``import tokenlake`` stays torch-free."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from import_cycles import cycles, import_graph, module_files

ROOT = Path(__file__).parents[2]
SCRIPT = Path(__file__).with_name("import_cycles.py")
# (floor folder, package) pairs whose modules may not form a circle
FLOORS = [
    ("tokenlake", "tokenlake"),
    ("scheduler", "tokenlake.scheduler"),
]
# floor -> packages it may never import (docs/architecture.md, "Dependency direction")
FORBIDDEN = {
    "tokenlake": ("tokenlake.engines", "tokenlake.scheduler", "tokenlake.serve",
                  "tokenlake.benchmarks", "tokenlake.cli"),
    "engines": ("tokenlake.scheduler", "tokenlake.serve", "tokenlake.benchmarks", "tokenlake.cli"),
    "scheduler": ("tokenlake.engines", "tokenlake.serve", "tokenlake.benchmarks", "tokenlake.cli"),
    "serve": ("tokenlake.benchmarks", "tokenlake.cli"),
}  # fmt: skip


def test_the_cycle_finder_finds_a_constructed_cycle():
    graph = {"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a"}, "p.d": {"p.a"}, "p.e": set()}
    assert cycles(graph) == [["p.a", "p.b", "p.c"]]
    assert cycles({"p.a": {"p.b"}, "p.b": set()}) == []


def test_the_cycle_finder_reads_type_checking_and_function_imports(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from pkg import b\n")
    (pkg / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import f\n"
    )
    assert cycles(import_graph(module_files(pkg, "pkg"))) == [["pkg.a", "pkg.b"]]


def test_no_import_cycle_in_the_control_plane_or_the_scheduler():
    for folder, package in FLOORS:
        out = subprocess.run(
            [sys.executable, str(SCRIPT), str(ROOT / folder), package],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert out.returncode == 0, out.stdout


def test_imports_point_one_way_between_the_floors():
    offenders = []
    for folder, banned in FORBIDDEN.items():
        package = "tokenlake" if folder == "tokenlake" else f"tokenlake.{folder}"
        graph = import_graph_all(ROOT / folder, package)
        for module, targets in graph.items():
            offenders += [f"{module} -> {t}" for t in targets if t.startswith(banned)]
    assert not offenders, offenders


def import_graph_all(root: Path, package: str) -> dict[str, set[str]]:
    """Every absolute import of each module (not only the package's own)."""
    import ast

    out = {}
    for name, path in module_files(root, package).items():
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module)
                names |= {f"{node.module}.{a.name}" for a in node.names}
        # the control plane's own subpackages are not the data plane
        out[name] = {n for n in names if not (folder_of(n) == package and package != "tokenlake")}
    return out


def folder_of(name: str) -> str:
    return ".".join(name.split(".")[:2])


def test_import_tokenlake_needs_no_torch():
    """torch is imported lazily where a control-plane helper measures or converts a dtype."""
    code = "import sys, tokenlake; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
