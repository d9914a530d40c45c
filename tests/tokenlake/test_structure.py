"""Structure the control plane promises: ``import tokenlake`` needs no torch, and helper
modules reach the pool only through its public methods."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import tokenlake

PACKAGE = Path(tokenlake.__file__).parent


def test_import_tokenlake_does_not_import_torch():
    code = (
        "import sys, time\n"
        "t = time.perf_counter()\n"
        "import tokenlake, tokenlake.config, tokenlake.plans, tokenlake.pool\n"
        "print(time.perf_counter() - t)\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)[:5]\n"
        "tokenlake.Pool(tokenlake.PoolConfig(tokenlake.ModelShape(1, 1, 1, 8), 2, 4, 16))\n"
        "assert 'torch' not in sys.modules\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    print(f"import tokenlake: {float(out.stdout):.3f} s")


def test_helper_modules_use_no_private_pool_fields():
    offenders = []
    for path in sorted(PACKAGE.glob("*.py")):
        if path.name == "pool.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\bpool\._[a-z]", line):
                offenders.append(f"{path.name}:{n}: {line.strip()}")
    assert not offenders, offenders


def test_plan_arrays_are_read_only_contiguous_int32():
    """Plans hold slices of a few shared arrays (one allocation per iteration, not per
    sub-batch); each must still be what the wire encoder and the kernels take."""
    import dataclasses

    import numpy as np

    import tokenlake as tl

    rng = np.random.default_rng(0)
    pool = tl.Pool(tl.PoolConfig(tl.ModelShape(1, 1, 1, 8), 4, 64, 8))
    prompts = {r: rng.integers(0, 50, int(rng.integers(3, 40))) for r in range(12)}
    steps = [
        ([[tl.Chunk(r, prompts[r], 0)] for r in range(4)], None),
        ([[tl.Chunk(r, prompts[r], 0) for r in range(4, 12)]], [3]),  # dop > 1 splits chunks
    ]
    for batches, dops in steps:
        pool.commit(pool.gen_plans(batches, dops))
    for _ in range(9):  # decode steps: in the open tail, then filling and starting segments
        batches = [[], []]
        for r, ids in prompts.items():
            prompts[r] = np.append(ids, int(rng.integers(0, 50)))
            batches[r % 2].append(tl.Chunk(r, prompts[r], len(ids)))
        plans = pool.gen_plans(batches, [2, 1])
        for plan in (*plans.query_plans, *plans.transfer_plans):
            for f in dataclasses.fields(plan):
                value = getattr(plan, f.name)
                if isinstance(value, np.ndarray):
                    assert value.dtype == np.int32, (f.name, value.dtype)
                    assert value.ndim == 1 and value.flags.c_contiguous, f.name
                    assert not value.flags.writeable, f.name
        pool.commit(plans)
        pool.check_invariants()
