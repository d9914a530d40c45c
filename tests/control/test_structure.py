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
