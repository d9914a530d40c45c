"""Boundary cost of the attention kernels (bench_attention.py's ``boundary_*`` lines): what
the public functions add to the C++ core on a decode step -- argument validation, conversion and output allocation -- measured as the per-call CPU
time (``time.process_time``, so other load on the machine does not count) of
``tokenlake.engines.kernels.partial_attention`` / ``merge`` (``public_us``) against ``tokenlake._C``
called directly with arguments converted beforehand and preallocated outputs (``core_us``), in
alternating blocks of ``--boundary-calls`` warm-cache calls (median over 7 blocks each), on one
kernel thread, for decode batches of 8 requests over ``--boundary-prefix-lens`` with small heads
(``--boundary-heads``), so the core's own time stays short next to what the boundary adds.

Also the direct calls of a ``_C`` core (this build's or another's, for ``--baseline-core``).
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import time
from collections.abc import Callable

import torch

from tokenlake import _C
from tokenlake.benchmarks.micro.attention_inputs import Case, make_inputs
from tokenlake.engines.kernels import cpu, merge, partial_attention


def bare_core_args(kernel_args: tuple) -> list:
    """Arguments as the C++ core reads them, converted beforehand: NumPy views (they cross
    the binding faster than DLPack), tensors where NumPy has no dtype (bfloat16)."""
    return [t if t.dtype == torch.bfloat16 else t.numpy() for t in kernel_args]


def load_core(path: str):
    """The ``_C`` extension module of another build, loaded next to this one's."""
    spec = importlib.util.spec_from_file_location("_C", path)  # its init is PyInit__C
    if spec is None:
        raise SystemExit(f"--baseline-core: cannot load {path!r}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def core_call(core, kernel_args: tuple, head_dim: int) -> tuple[Callable[[], object], tuple]:
    """An uncapped direct call of ``core.partial_attention`` into preallocated outputs (the
    soft-cap argument is passed only to builds that take one)."""
    q = kernel_args[0]
    o, lse = torch.empty(q.shape), torch.empty(q.shape[:2])
    call = [*bare_core_args(kernel_args), o.numpy(), lse.numpy(), False, head_dim**-0.5]
    if "logit_cap" in (core.partial_attention.__doc__ or ""):
        call.append(0.0)
    return (lambda: core.partial_attention(*call)), (o, lse)


def per_call_us(public: Callable[[], object], core: Callable[[], object], calls: int):
    """Median per-call CPU microseconds of two callables, timed in alternating blocks."""
    times: dict[str, list[float]] = {"public": [], "core": []}
    for _ in range(calls):  # warm-up
        public(), core()
    for _ in range(7):
        for name, fn in (("public", public), ("core", core)):
            start = time.process_time()
            for _ in range(calls):
                fn()
            times[name].append((time.process_time() - start) / calls * 1e6)
    return statistics.median(times["public"]), statistics.median(times["core"])


def boundary_cases(case: Case, dtype: str, pool: torch.Tensor, slots, calls: int, gen) -> list:
    """Per-call cost of the public partial_attention and merge over the bare C++ core."""
    args = make_inputs(case, pool, slots, gen).args
    q = args[0]
    o_b, lse_b = torch.randn(q.shape, generator=gen), torch.randn(q.shape[:2], generator=gen)
    # The core's cheapest call: arguments converted beforehand and outputs preallocated.
    o, lse = torch.empty(q.shape).numpy(), torch.empty(q.shape[:2]).numpy()
    merge_args = bare_core_args((o_b, lse_b, o_b, lse_b))
    pairs = {
        "boundary_partial_attention": (
            lambda: partial_attention(*args),
            core_call(_C, args, case.head_dim)[0],
        ),
        "boundary_merge": (
            lambda: merge(o_b, lse_b, o_b, lse_b),
            lambda: _C.merge(*merge_args, o, lse),
        ),
    }
    rows = []
    threads = cpu.get_num_threads()
    cpu.set_num_threads(1)  # the kernel runs in the calling thread: no wake-up jitter
    for name, (public, core) in pairs.items():
        public_us, core_us = per_call_us(public, core, calls)
        rows.append(
            {
                "case": name,
                "dtype": dtype,
                "prefix_len": case.prefix_len,
                "num_reqs": case.num_reqs,
                "num_pages": int(args[4].numel()),
                "heads": f"{case.num_q_heads}/{case.num_kv_heads}x{case.head_dim}",
                "public_us": round(public_us, 2),
                "core_us": round(core_us, 2),
                "overhead_us": round(public_us - core_us, 2),
                "overhead_fraction": round((public_us - core_us) / core_us, 4),
                "load_avg_1m": round(os.getloadavg()[0], 2),
            }
        )
    cpu.set_num_threads(threads)
    return rows
