"""The device check's non-GPU steps, on CPU: its dry run names the wheels it installs, the
build and the GPU test selection, in that order, and every test file it selects exists and
carries ``gpu`` tests; the Makefile downloads exactly those wheels into the ignored folder;
the microbenchmark runs (CPU kernel) and reports 0 host reads per layer."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests/gpu/device_check.sh"


def dry_run() -> list[str]:
    out = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run"], cwd=ROOT, capture_output=True, text=True,
        timeout=60, check=True,
    )  # fmt: skip
    return [line[2:] for line in out.stdout.splitlines() if line.startswith("+ ")]


def test_dry_run_installs_wheels_builds_then_selects_gpu_tests():
    steps = dry_run()
    assert len(steps) == 4, steps
    install, build, tests, bench = steps
    assert "--no-index --find-links .gpu-wheels pyzmq flashinfer-python" in install
    assert "pip install -q --no-build-isolation --no-deps -e ." in build
    assert "-m pytest -q -m gpu" in tests
    selected = tests.split("-m gpu", 1)[1].split()
    assert selected, tests
    for path in selected:
        assert (ROOT / path).exists(), path
    gpu_marked = [p for p in selected if "@pytest.mark.gpu" in _text(ROOT / p)]
    assert gpu_marked, selected
    assert "tests/gpu/decode_layer_bench.py" in bench


def _text(path: Path) -> str:
    if path.is_dir():
        return "".join(p.read_text() for p in path.glob("test_*.py"))
    return path.read_text()


def test_makefile_downloads_the_same_wheels_into_the_ignored_folder():
    makefile = (ROOT / "Makefile").read_text()
    target = makefile.split("gpu-wheels:", 1)[1].split("\n\n", 1)[0]
    assert "--only-binary=:all:" in target and "--python-version 3.12" in target
    assert "manylinux_2_28_x86_64" in target and "-d .gpu-wheels" in target
    names = re.findall(r"\b(pyzmq|flashinfer-python)\b", target)
    assert set(names) == {"pyzmq", "flashinfer-python"}
    assert ".gpu-wheels/" in (ROOT / ".gitignore").read_text().splitlines()


def test_microbenchmark_reports_no_host_reads_per_layer():
    out = subprocess.run(
        [sys.executable, str(ROOT / "tests/gpu/decode_layer_bench.py"), "--device", "cpu",
         "--batch", "1", "4", "--context", "40", "--num-q-heads", "4", "--num-kv-heads", "2",
         "--head-dim", "16", "--page-len", "8", "--iters", "1"],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["batch"] for r in lines] == [1, 4]
    for r in lines:
        assert r["tokenlake_host_reads_per_layer"] == 0
        assert r["backend"] == "cpu" and "no FlashInfer" in r["note"]
    assert lines[0]["tokenlake_kernels_per_layer"] == lines[1]["tokenlake_kernels_per_layer"]
