"""The device check rehearsed on CPU (tests/gpu/device_check.sh; no GPU here).

- The Makefile fetches exactly the three pinned wheels for the device's Python 3.12 into an
  ignored folder, and the check's steps come in their order (bench before the tests).
- The payload: built from those wheels by the same builder ``make gpu-wheels`` uses, it fits
  one device call with room to spare; the check's own install step, run by a bare Python 3.12
  venv holding what the device image has for these imports (no torch: none exists for it
  here), installs it with ``--no-index --no-deps --target`` and imports ``tvm_ffi`` and ``zmq``
  from there; ``flashinfer`` gets as far as ``torch``. The same FlashInfer wheel, installed the
  same way, then imports with torch (this venv's Python 3.11; FlashInfer is pure Python).
- Every other step runs on the CPU path, reports one JSON line, and a failed step stops none
  after it.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests/gpu/device_check.sh"
WHEELS = ROOT / ".gpu-wheels"
sys.path.insert(0, str(ROOT / "tests/gpu"))
import gpu_payload  # noqa: E402

STEPS = ["install", "build", "jit", "bench", "tests"]


def run_check(tmp_path: Path, steps: str, **env: str) -> list[dict]:
    """Run the check's ``steps``; its JSON lines (steps.jsonl)."""
    out = tmp_path / "out"
    full_env = {**os.environ, "OUT": str(out), "STEPS": steps, **env}
    subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=full_env, capture_output=True,
                   text=True, timeout=300, check=True)  # fmt: skip
    return [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]


def summary(lines: list[dict], step: str) -> dict:
    """The step's own line (the one with ``rc``), exactly one."""
    found = [r for r in lines if r.get("step") == step and "rc" in r]
    assert len(found) == 1, (step, lines)
    return found[0]


def test_dry_run_lists_the_steps_in_order_and_real_gpu_tests():
    out = subprocess.run(["bash", str(SCRIPT), "--dry-run"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, check=True).stdout  # fmt: skip
    lines = [line[2:] for line in out.splitlines() if line.startswith("+ ")]
    assert [line.split(":", 1)[0] for line in lines] == STEPS
    install, _, jit, bench, tests = (line.split(": ", 1)[1] for line in lines)
    assert "--no-index --no-deps" in install and "--target" in install
    assert "imports" in install and "flashinfer tvm_ffi zmq" in install
    assert "jit_warmup.py" in jit
    assert "decode_layer_bench.py --context 1024 2048" in bench
    selected = tests.split("-m gpu", 1)[1].split()
    assert selected
    for path in selected:
        files = [ROOT / path] if path.endswith(".py") else sorted((ROOT / path).glob("test_*.py"))
        assert files and all(f.exists() for f in files), path
    assert any("@pytest.mark.gpu" in (ROOT / p).read_text() for p in selected if p.endswith(".py"))


def test_makefile_fetches_exactly_the_pinned_wheels_into_ignored_folders():
    makefile = (ROOT / "Makefile").read_text()
    pins = re.search(r"^GPU_WHEELS := (.*)$", makefile, re.M).group(1).split()
    assert pins == [
        "flashinfer-python==0.7.2.post1",
        "apache-tvm-ffi==0.1.15.post2",
        "pyzmq==27.3.0",
    ]
    download = makefile.split("$(GPU_WHEELS_DIR)/.downloaded:", 1)[1].split("\n\n", 1)[0]
    for flag in (
        "--no-deps",
        "--only-binary=:all:",
        "--python-version 3.12",
        "manylinux_2_28_x86_64",
    ):
        assert flag in download, flag
    assert "$(GPU_WHEELS_DIR)/.downloaded" in re.search(r"^test: (.*)$", makefile, re.M).group(1)
    ignored = (ROOT / ".gitignore").read_text().splitlines()
    assert ".gpu-wheels/" in ignored and ".gpu-payload/" in ignored


def _device_python() -> str | None:
    """A Python 3.12 (the device's version) on this machine, if any."""
    candidates = [shutil.which("python3.12"), *glob.glob(os.path.expanduser("~/.pyenv/versions/3.12*/bin/python3.12"))]  # fmt: skip
    for path in filter(None, candidates):
        probe = subprocess.run([path, "-c", "import sys, venv; print(sys.version_info[:2] == (3, 12))"],
                               capture_output=True, text=True)  # fmt: skip
        if probe.stdout.strip() == "True":
            return path
    return None


@pytest.fixture(scope="module")
def payload(tmp_path_factory) -> Path:
    if len(list(WHEELS.glob("*.whl"))) != 3:
        pytest.skip("no device wheels: `make test` downloads them (no package index was reachable)")
    return gpu_payload.build(WHEELS, tmp_path_factory.mktemp("payload") / "gpu-payload.tar.xz")


def test_payload_fits_one_call_with_room_to_spare(payload):
    sizes = gpu_payload.report(ROOT, payload)
    print(json.dumps(sizes))
    assert sizes["fits"], sizes
    # the whole wheel set, deflated, would not fit: the packing is what makes room
    assert sum(w.stat().st_size for w in WHEELS.glob("*.whl")) > 60 << 20
    assert payload.stat().st_size < 30 << 20
    assert sizes["total_mib"] <= gpu_payload.BUDGET_BYTES / (1 << 20) < 64


def test_install_step_installs_the_payload_into_a_bare_device_python(payload, tmp_path):
    python312 = _device_python()
    if python312 is None:
        pytest.skip("no Python 3.12 (the device's) on this machine")
    venv = tmp_path / "device-venv"
    subprocess.run([python312, "-m", "venv", str(venv)], check=True, timeout=120)
    # what the device image has that these imports need, besides torch (no CPU torch for 3.12)
    image = subprocess.run([str(venv / "bin/python"), "-m", "pip", "install", "-q",
                            "typing_extensions", "filelock"], capture_output=True, text=True,
                           timeout=180)  # fmt: skip
    if image.returncode:
        pytest.skip(f"no package index for the device-image stand-in: {image.stderr[-200:]}")
    site = tmp_path / "site"
    lines = run_check(
        tmp_path, "install", PYTHON=str(venv / "bin/python"), SITE=str(site), PAYLOAD=str(payload)
    )
    imported = next(r for r in lines if "imports" in r)["imports"]
    assert imported["tvm_ffi"] == {"version": "0.1.15.post2", "from_site": True}
    assert imported["zmq"] == {"version": "27.3.0", "from_site": True}
    assert imported["flashinfer"] == {"error": "ModuleNotFoundError: No module named 'torch'"}
    assert summary(lines, "install")["rc"] == 1  # flashinfer needs torch, which is not here
    # the same FlashInfer wheel, with torch and tvm_ffi: it imports from where it went
    wheel = next((site.parent / "site.wheels").glob("flashinfer_python-*.whl"))
    with_torch = tmp_path / "with-torch"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                    "--no-compile", "--target", str(with_torch), str(wheel)], check=True,
                   timeout=180)  # fmt: skip
    probe = subprocess.run(
        [sys.executable, str(ROOT / "tests/gpu/gpu_payload.py"), "imports", str(with_torch), "flashinfer"],
        env={**os.environ, "PYTHONPATH": str(with_torch)}, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    result = json.loads(probe.stdout)
    assert result == {
        "imports": {"flashinfer": {"version": "0.7.2.post1", "from_site": True}},
        "ok": True,
    }


def test_every_step_runs_and_reports_on_the_cpu_path(tmp_path):
    # no payload: the install step fails, and every step after it still runs and reports
    lines = run_check(
        tmp_path, "install jit bench tests", PYTHON=sys.executable, SITE=str(tmp_path / "none"),
        PAYLOAD=str(tmp_path / "missing.tar.xz"),
        BENCH_ARGS="--context 40 72 --batch 1 4 --num-q-heads 4 --num-kv-heads 2 --head-dim 16 "
        "--page-len 8 --iters 1",
    )  # fmt: skip
    assert [r["step"] for r in lines if "rc" in r] == ["install", "jit", "bench", "tests"]
    assert summary(lines, "install")["rc"] != 0
    for step in ("jit", "bench", "tests"):
        line = summary(lines, step)
        assert line["rc"] == 0 and not line["timed_out"], line
    jit = [r for r in lines if r["step"] == "jit" and "rc" not in r]
    assert jit == [{"step": "jit", "modules": 0, "note": jit[0]["note"]}]
    bench = [r for r in lines if r["step"] == "bench" and "rc" not in r]
    assert [(r["context"], r["batch"]) for r in bench] == [(39, 1), (39, 4), (71, 1), (71, 4)]
    assert all(r["tokenlake_host_reads_per_layer"] == 0 for r in bench)
    assert (
        "passed" in summary(lines, "tests")["last_line"]
        or "skipped" in summary(lines, "tests")["last_line"]
    )


def test_a_step_past_the_deadline_is_reported_not_run(tmp_path):
    lines = run_check(tmp_path, "jit bench", PYTHON=sys.executable, DEADLINE_S="3")
    assert [(r["step"], r["rc"]) for r in lines] == [("jit", None), ("bench", None)]
    assert all("deadline" in r["note"] for r in lines)
