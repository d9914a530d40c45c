"""Build the FlashInfer JIT modules the device check needs, in parallel, before anything times.

FlashInfer compiles a module the first time a wrapper of a new shape runs (one ``.cu`` file per
kernel family, 8-20 CPU-seconds each for FA2 and the CUDA-core decode). Built one after the
other inside the benchmark or pytest, they would eat the check's minutes serially; here each
module is built by its own process, all at once, by running the same planner the engines use
(:class:`~tokenlake.engines.kernels.flashinfer_backend.FlashInferPlanner`, FA2), so the build
matches what later runs exactly. FlashInfer caches the builds on disk; later processes load them.

Prints one JSON line per module (its seconds or its error) as each finishes. Without CUDA or
FlashInfer it prints one line saying so and builds nothing (the CPU rehearsal).
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context

# (name, H_q, H_kv, D, page, soft cap, rows per request): the benchmark's layer, the GPU tests'
# shapes (tests/engines/test_gpu_path.py) with and without a soft cap (a module parameter), a
# CUDA-core decode (group < 4) and the merge kernels (FlashInfer's cascade module)
MODULES = (
    ("bench_decode_tc", 32, 8, 128, 16, 0.0, 1),
    ("tests_decode_tc", 8, 2, 64, 16, 0.0, 1),
    ("tests_prefill", 8, 2, 64, 16, 0.0, 3),
    ("tests_prefill_cap", 8, 2, 64, 16, 2.0, 3),
    ("tests_decode_cuda_cores", 4, 2, 64, 16, 0.0, 1),
    ("merge_states", 8, 2, 64, 16, 0.0, 0),
)


def build_one(module: tuple) -> dict:
    """Run one module's kernel once (so FlashInfer builds and loads it); its seconds."""
    import torch

    start = time.perf_counter()
    name, h_q, h_kv, d, page, cap, rows_each = module
    import flashinfer

    dev, dtype = torch.device("cuda"), torch.bfloat16
    if rows_each == 0:
        v = torch.randn((4, 3, h_q, d), device=dev, dtype=dtype)
        s = torch.randn((4, 3, h_q), device=dev, dtype=torch.float32)
        flashinfer.merge_states(v, s)
        flashinfer.merge_state(v[:, 0].contiguous(), s[:, 0].contiguous(), v[:, 1].contiguous(),
                               s[:, 1].contiguous())  # fmt: skip
    else:
        from tokenlake.engines.kernels.flashinfer_backend import FlashInferPlanner
        from tokenlake.engines.kernels.inputs import PagedCSR

        batch, pages_each = 2, 3
        i32 = dict(dtype=torch.int32, device=dev)
        planner = FlashInferPlanner(flashinfer, dev, (h_q, h_kv, d, page), dtype, logit_cap=cap)
        part = planner.plan(
            PagedCSR(
                torch.arange(batch + 1, **i32) * rows_each,
                torch.arange(batch + 1, **i32) * pages_each,
                torch.arange(batch * pages_each, **i32),
                torch.full((batch,), page, **i32),
            ),
            causal=rows_each > 1,
        )
        pool = torch.randn((batch * pages_each, 2, page, h_kv, d), device=dev, dtype=dtype)
        part.run(torch.randn((batch * rows_each, h_q, d), device=dev, dtype=dtype), pool)
    torch.cuda.synchronize()
    return {"module": name, "seconds": round(time.perf_counter() - start, 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=len(MODULES))
    args = p.parse_args(argv)
    import torch

    try:
        import flashinfer  # noqa: F401
    except ImportError as e:
        print(json.dumps({"modules": 0, "note": f"no FlashInfer: {e}"}), flush=True)
        return 0
    if not torch.cuda.is_available():
        print(json.dumps({"modules": 0, "note": "no CUDA device: nothing to build"}), flush=True)
        return 0
    failed = 0
    # spawn: CUDA cannot be used in a forked child of a process that touched it
    with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as pool:
        futures = {pool.submit(build_one, m): m[0] for m in MODULES}
        for future in as_completed(futures):
            try:
                line = future.result()
            except Exception as e:  # one module's failure must not hide the others' builds
                failed += 1
                line = {"module": futures[future], "error": f"{type(e).__name__}: {e}"[:400]}
            print(json.dumps(line), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
