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
    ("engines", "tokenlake.engines"),
    ("scheduler", "tokenlake.scheduler"),
    ("serve", "tokenlake.serve"),
    ("benchmarks", "tokenlake.benchmarks"),
    ("cli", "tokenlake.cli"),
]
# floor -> its wings (subfolders), lowest first: a wing imports only wings before it, and the
# floor's root modules (docs/architecture.md, "Dependency direction"). Root modules named in
# ENTRY_POINTS sit above every wing (command lines); other root modules import no wing after
# the first ROOT_AFTER wings.
WINGS = {
    "tokenlake": ["tree", "planning", "cluster", "iteration"],
    "engines": ["kernels", "transport", "core", "client", "clusters", "model", "sglang"],
    "serve": ["metrics", "api", "ray"],
    "benchmarks": [
        "workloads",
        "sim",
        "micro",
        "real",
        "demo",
        "wallclock",
        "calibrate",
        "goodput",
    ],
}
ROOT_AFTER = {"tokenlake": 4, "engines": 0, "serve": 1, "benchmarks": 1}
ENTRY_POINTS = {"serve": ("cli", "sglang_host", "__main__")}
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


def test_no_import_cycle_in_any_floor():
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


def _wing(folder: str, package: str, module: str) -> str:
    """The wing of ``module`` (its first subfolder), or "" for the floor's root modules."""
    rest = module[len(package) + 1 :].split(".") if module != package else []
    return rest[0] if rest and (ROOT / folder / rest[0]).is_dir() else ""


def wing_offenders(folder: str, package: str, graph: dict[str, set[str]]) -> list[str]:
    order = {w: i for i, w in enumerate(WINGS[folder])}
    offenders = []
    for module, targets in graph.items():
        src = _wing(folder, package, module)
        for t in targets:
            dst = _wing(folder, package, t)
            if src == dst or not dst:
                continue  # inside one wing, or down to the root's shared modules
            if not src:
                leaf = module.rsplit(".", 1)[-1]
                ok = leaf in ENTRY_POINTS.get(folder, ()) or order[dst] < ROOT_AFTER[folder]
            else:
                ok = order[dst] < order[src]
            if not ok:
                offenders.append(f"{module} -> {t}")
    return offenders


def test_wings_depend_one_way_inside_every_floor():
    for folder, package in FLOORS:
        if folder not in WINGS:
            continue
        assert set(WINGS[folder]) == {d.name for d in (ROOT / folder).iterdir()
                                      if (d / "__init__.py").exists()}, folder  # fmt: skip
        offenders = wing_offenders(
            folder, package, import_graph(module_files(ROOT / folder, package))
        )
        assert not offenders, offenders


def test_the_wing_check_catches_an_upward_import():
    graph = {"tokenlake.engines.core.puts": {"tokenlake.engines.clusters.mp"}}
    assert wing_offenders("engines", "tokenlake.engines", graph) == [
        "tokenlake.engines.core.puts -> tokenlake.engines.clusters.mp"
    ]


def test_no_folder_holds_more_than_fifteen_modules():
    crowded = {}
    for folder, _ in FLOORS:
        for d in [ROOT / folder, *(p for p in (ROOT / folder).rglob("*") if p.is_dir())]:
            modules = [f for f in d.glob("*.py") if f.name not in ("__init__.py", "__main__.py")]
            if len(modules) > 15:
                crowded[str(d.relative_to(ROOT))] = len(modules)
    assert not crowded, crowded


def test_a_floor_imported_under_its_bare_name_fails_naming_the_right_import():
    for folder, package in FLOORS[1:]:
        code = f"import sys; sys.path.insert(0, {str(ROOT)!r}); import {folder}"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             cwd="/", timeout=60)  # fmt: skip
        assert out.returncode != 0, folder
        assert f"import {package}, not {folder}" in out.stderr, out.stderr[-500:]
