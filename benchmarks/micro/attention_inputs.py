"""Inputs and timing of the attention benchmark (bench_attention.py): a case's shapes, a paged
pool with shuffled slots, the kernel's arguments plus the same K/V gathered for SDPA, and a
timer whose every run starts with a cold last-level cache."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

PAGE_LEN = 16
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Case:
    name: str  # "decode" or "prefill"
    num_reqs: int
    rows_per_req: int
    prefix_len: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int


@dataclass
class Inputs:
    """Kernel arguments plus the same K/V gathered for SDPA (``[B, H_kv, L, D]`` each)."""

    args: tuple[torch.Tensor, ...]  # q, q_indptr, pool_layer, kv_indptr, kv_indices, last_len
    sdpa_q: torch.Tensor  # [B, H_q, rows, D]
    sdpa_k: torch.Tensor
    sdpa_v: torch.Tensor


def build_pool(case: Case, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 pool ``[num_slots, 2, PAGE_LEN, H_kv, D]`` and shuffled slot ids ``[num_pages]``."""
    num_pages = case.num_reqs * case.prefix_len // PAGE_LEN
    shape = (num_pages, 2, PAGE_LEN, case.num_kv_heads, case.head_dim)
    pool = torch.empty(shape).normal_(generator=gen)
    slots = torch.randperm(num_pages, generator=gen).to(torch.int32)
    return pool, slots


def make_inputs(case: Case, pool: torch.Tensor, slots: torch.Tensor, gen) -> Inputs:
    b, rows, d = case.num_reqs, case.rows_per_req, case.head_dim
    q = torch.randn(b * rows, case.num_q_heads, d, generator=gen).to(pool.dtype)
    pages_per_req = case.prefix_len // PAGE_LEN
    q_indptr = torch.arange(0, b * rows + 1, rows, dtype=torch.int32)
    kv_indptr = torch.arange(0, b * pages_per_req + 1, pages_per_req, dtype=torch.int32)
    last_len = torch.full((b,), PAGE_LEN, dtype=torch.int32)
    gathered = pool.index_select(0, slots.long()).view(b, pages_per_req, *pool.shape[1:])
    k, v = (
        gathered[:, :, i].reshape(b, case.prefix_len, case.num_kv_heads, d).transpose(1, 2)
        for i in (0, 1)
    )
    sdpa_q = q.view(b, rows, case.num_q_heads, d).transpose(1, 2).contiguous()
    args = (q, q_indptr, pool, kv_indptr, slots, last_len)
    return Inputs(args, sdpa_q, k.contiguous(), v.contiguous())


class Timer:
    """Median wall time of a callable, each run preceded by writes that evict the LLC."""

    def __init__(self, flush_mib: int):
        self.flush_buf = torch.empty(flush_mib << 20, dtype=torch.uint8)

    def median_ms(self, fn: Callable[[], object], repeats: int, warmup: int) -> float:
        return self.alternating({"fn": fn}, repeats, warmup)["fn"][0]

    def alternating(self, fns: dict, repeats: int, warmup: int) -> dict[str, tuple[float, float]]:
        """Median wall and process-CPU ms of each callable, run in turn, the order reversed
        every other round, so machine load and position skew them alike. CPU time counts
        this process's threads only: on a loaded machine it is the steadier of the two."""
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in fns}
        for i in range(warmup + repeats):
            for name, fn in list(fns.items())[:: -1 if i % 2 else 1]:
                self.flush_buf.fill_(i & 0xFF)
                start, cpu_start = time.perf_counter(), time.process_time()
                fn()
                if i >= warmup:
                    times[name].append(
                        (time.perf_counter() - start, time.process_time() - cpu_start)
                    )
        return {
            name: tuple(1e3 * statistics.median(col) for col in zip(*t, strict=True))
            for name, t in times.items()
        }

    def memcpy_gbps(self, num_bytes: int, repeats: int) -> float:
        # at least the LLC-evicting size: copied from and to memory, not the cache
        src = torch.ones(max(num_bytes, self.flush_buf.numel()), dtype=torch.uint8)
        dst = torch.empty_like(src)
        ms = self.median_ms(lambda: dst.copy_(src), repeats, warmup=1)
        return src.numel() / ms / 1e6
