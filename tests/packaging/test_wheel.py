"""``pip install .`` as a user gets it: build the wheel (C++ extension inside), install it into a
fresh virtualenv, then from outside the repository run ``tokenlake --help`` and a tiny pool
with the C++ kernels. The new venv sees this venv's site-packages through a ``.pth`` file, so
the dependencies (torch, numpy, ...) are reused and nothing is downloaded; pip still resolves
the wheel's declared dependencies against them."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
CORE = {"torch", "numpy", "scipy", "xxhash", "msgpack", "pyzmq", "tqdm"}
EXTRAS = {
    "model": {"transformers", "safetensors", "tokenizers"},
    "serve": {"fastapi", "uvicorn", "prometheus-client"},
    "cluster": {"ray"},
    "cuda": {"flashinfer-python"},
    "sglang": {"sglang"},
}
TINY_POOL = textwrap.dedent(
    """
    import sys
    import numpy as np
    import tokenlake as tl
    from tokenlake.engines.clusters.local import LocalCluster
    from tokenlake.engines.client.synthetic import SyntheticModel, run_iteration

    shape = tl.ModelShape(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16)
    pool = tl.Pool(tl.PoolConfig(shape, num_instances=2, num_slots=32, segment_len=8))
    cluster = LocalCluster(pool.config, backend="cpu")   # the C++ kernels of the wheel
    model = SyntheticModel(shape, seed=1)
    ids = np.arange(40, dtype=np.int32)
    for rid, start in (("a", 0), ("b", None)):
        if start is None:
            start = min(pool.get_prefix_tree().match(ids).num_tokens, len(ids) - 1)
        chunk = tl.Chunk(rid, ids, start)
        plans = pool.gen_plans([[chunk]])
        results = run_iteration(cluster, plans, {rid: chunk}, model)
        pool.commit(plans)
        cluster.retire(plans.epoch)
        for r in results:
            o, lse = model.reference(chunk.token_ids, r.first, r.end, r.layer)
            assert float((o - r.o).abs().max()) < 1e-4
    assert pool.get_stats()["num_hit_tokens"] == 40 - 1  # all cached; the last token recomputed
    print(tl.__file__)
    print(tl._C.__file__)
    """
)


def _requirements(metadata: str) -> tuple[set[str], dict[str, set[str]]]:
    core, extras = set(), {}
    for req in Parser().parsestr(metadata).get_all("Requires-Dist") or []:
        name = req.split(";")[0].strip()
        for stop in "<>=!~[ (":
            name = name.split(stop)[0]
        name = name.lower().replace("_", "-")
        if "extra ==" in req:
            extra = req.split("extra ==")[1].strip().strip("'\"")
            extras.setdefault(extra, set()).add(name)
        else:
            core.add(name)
    return core, extras


@pytest.mark.slow
def test_wheel_installs_and_runs_outside_the_repository(tmp_path):
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation",
         "-q", "-w", str(dist)],
        check=True, timeout=900,
    )  # fmt: skip
    (wheel,) = dist.glob("tokenlake-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        (meta,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        metadata = z.read(meta).decode()
        entry_points = z.read(meta.replace("METADATA", "entry_points.txt")).decode()
    assert any(n.startswith("tokenlake/_C") and n.endswith((".so", ".pyd")) for n in names)
    for module in (
        "engines/clusters/mp.py",
        "scheduler/scheduler.py",
        "serve/api/app.py",
        "benchmarks/goodput/harness.py",
        "cli/main.py",
        "benchmarks/data/conversation_trace_head1000.jsonl.gz",
    ):
        assert f"tokenlake/{module}" in names, module  # fmt: skip
    assert not any(n.startswith(("tests/", "engines/", "benchmarks/", "csrc/")) for n in names)
    assert "tokenlake = tokenlake.cli.main:main" in entry_points
    core, extras = _requirements(metadata)
    assert core == CORE, "the core install stays light"
    for extra, wanted in EXTRAS.items():
        assert wanted <= extras.get(extra, set()), extra

    venv = tmp_path / "venv"
    # no pip/setuptools of its own (they would shadow the reused ones); this venv's pip installs
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = Path(
        subprocess.check_output(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            text=True,
        ).strip()
    )
    (site / "reuse_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    subprocess.run(
        # with the README's extras: pip resolves them too (against the reused packages)
        [sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-index",
         f"{wheel}[serve,model]"],
        check=True, timeout=600, env=env, cwd=tmp_path,
    )  # fmt: skip
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    help_out = subprocess.run(
        [str(venv / "bin" / "tokenlake"), "--help"],
        capture_output=True, text=True, timeout=120, env=env, cwd=outside,
    )  # fmt: skip
    assert help_out.returncode == 0, help_out.stderr
    assert "goodput" in help_out.stdout and "serve" in help_out.stdout
    serve_help = subprocess.run(
        [str(venv / "bin" / "tokenlake"), "serve", "--help"],
        capture_output=True, text=True, timeout=300, env=env, cwd=outside,
    )  # fmt: skip
    assert serve_help.returncode == 0, serve_help.stderr
    assert "--num-instances" in serve_help.stdout
    run = subprocess.run(
        [str(py), "-c", TINY_POOL],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=outside,
    )
    assert run.returncode == 0, run.stderr
    package, extension = run.stdout.split()
    assert package.startswith(str(site)) and extension.startswith(str(site))
