"""GPU memory of one SGLang worker, with and without TokenLake, by SGLang's own rules.

SGLang sizes its KV cache once, at start-up (``KVCacheConfigurator._profile_available_bytes``):
the free memory after loading the weights, less ``1 - mem_fraction_static`` of the free memory
before; what is left over is the headroom for activations (and CUDA graphs), which SGLang
keeps at least ``pre_capture_activation_reserve_mb`` when it picks ``mem_fraction_static``
itself. TokenLake's backend is built after that, so its pool and staging buffers must fit in
the headroom beside the activations: on one GPU, pass a ``--mem-fraction-static`` that
leaves room for them (:func:`max_mem_fraction_static`).

The numbers are SGLang 0.5.23's, pinned against its source in tests/sglang/test_sglang_memory.py;
they were not measured on a GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tokenlake.config import ModelShape
from tokenlake.engines.core.shared_buffers import Layout

from .config import SGLangPoolConfig

MIB = 1 << 20
# SGLang's activation reserve when it picks mem_fraction_static itself (arg_groups/
# memory_hook.py): 512 MiB + 1.5 MiB per chunked-prefill token + tp*pp/8 GiB, at least
# 10 GiB on a GPU of more than 60 GiB
ACTIVATION_BASE_MIB = 512
ACTIVATION_MIB_PER_TOKEN = 1.5
ACTIVATION_FLOOR_MIB = 10 * 1024
ACTIVATION_FLOOR_FROM_MIB = 60 * 1024


def activation_reserve_bytes(gpu_bytes: int, chunked_prefill_size: int, tp_pp: int = 1) -> int:
    """SGLang's activation headroom for a GPU of ``gpu_bytes`` (``pre_capture_activation_
    reserve_mb``, CUDA graphs off as the tokenlake backend runs)."""
    mib = ACTIVATION_BASE_MIB + max(chunked_prefill_size, 2048) * ACTIVATION_MIB_PER_TOKEN
    mib += tp_pp / 8 * 1024
    if gpu_bytes / MIB > ACTIVATION_FLOOR_FROM_MIB:
        mib = max(mib, ACTIVATION_FLOOR_MIB)
    return int(mib * MIB)


def sglang_default_mem_fraction(gpu_bytes: int, chunked_prefill_size: int) -> float:
    """``mem_fraction_static`` SGLang picks when none is given: what the reserve leaves."""
    reserve = activation_reserve_bytes(gpu_bytes, chunked_prefill_size)
    return round((gpu_bytes - reserve) / gpu_bytes, 3)


def sglang_kv_tokens(
    gpu_bytes: int, weights_bytes: int, mem_fraction_static: float, kv_bytes_per_token: int
) -> int:
    """Tokens of SGLang's KV cache: the free memory after the weights, less ``1 -
    mem_fraction_static`` of the free memory before them (a fresh GPU: all of it)."""
    budget = gpu_bytes - weights_bytes - gpu_bytes * (1 - mem_fraction_static)
    return max(0, int(budget // kv_bytes_per_token))


def tokenlake_bytes(config: SGLangPoolConfig, shape: ModelShape, num_instances: int) -> int:
    """Bytes TokenLake allocates on one worker's GPU for ``num_instances`` of ``config``'s
    instances (all of them for a pool of its own, one for a worker of a shared pool): slots
    and staging buffers, as the data plane lays them out (:class:`Layout`)."""
    rows = config.max_forward_rows
    layout = Layout(shape, config.num_instances, config.num_slots, config.segment_len, rows, rows)
    return num_instances * sum(layout.nbytes().values())


@dataclass(frozen=True)
class WorkerMemory:
    """One worker's GPU memory, bytes: SGLang's KV cache (and its tokens), TokenLake's
    allocation, the activation headroom SGLang wants, and what is left of the GPU."""

    sglang_kv_bytes: int
    sglang_kv_tokens: int
    tokenlake_bytes: int
    activation_bytes: int
    free_bytes: int


def worker_memory(
    gpu_bytes: int, weights_bytes: int, shape: ModelShape, mem_fraction_static: float,
    config: SGLangPoolConfig | None, num_instances: int, chunked_prefill_size: int,
) -> WorkerMemory:  # fmt: skip
    """The memory of one worker (``config`` ``None``: SGLang alone)."""
    tokens = sglang_kv_tokens(
        gpu_bytes, weights_bytes, mem_fraction_static, shape.kv_bytes_per_token
    )
    kv = tokens * shape.kv_bytes_per_token
    extra = 0 if config is None else tokenlake_bytes(config, shape, num_instances)
    activations = activation_reserve_bytes(gpu_bytes, chunked_prefill_size)
    free = gpu_bytes - weights_bytes - kv - extra - activations
    return WorkerMemory(kv, tokens, extra, activations, free)


def max_mem_fraction_static(
    gpu_bytes: int, config: SGLangPoolConfig, shape: ModelShape, num_instances: int,
    chunked_prefill_size: int,
) -> float:  # fmt: skip
    """The largest ``--mem-fraction-static`` (two decimals) leaving TokenLake's allocation and
    SGLang's activation headroom free."""
    need = tokenlake_bytes(config, shape, num_instances)
    need += activation_reserve_bytes(gpu_bytes, chunked_prefill_size)
    return math.floor((1 - need / gpu_bytes) * 100) / 100


def one_copy_memory(
    gpu_bytes: int, weights_bytes: int, shape: ModelShape, mem_fraction_static: float,
    config: SGLangPoolConfig, chunked_prefill_size: int,
) -> WorkerMemory:  # fmt: skip
    """One worker of a shared pool with one copy of the KV (:mod:`.one_copy`): SGLang's KV
    cache *is* the worker's instance's slots (``tokens // C + 1`` of them: slot 0 is SGLang's
    padding page), so TokenLake adds only its staging buffers (one instance's q, kv and
    output rows)."""
    tokens = sglang_kv_tokens(
        gpu_bytes, weights_bytes, mem_fraction_static, shape.kv_bytes_per_token
    )
    seg, rows = config.segment_len, config.max_forward_rows
    num_slots = tokens // seg + 1
    kv = num_slots * seg * shape.kv_bytes_per_token
    layout = Layout(shape, config.num_instances, num_slots, seg, rows, rows)
    extra = sum(v for k, v in layout.nbytes().items() if k != "pool")
    activations = activation_reserve_bytes(gpu_bytes, chunked_prefill_size)
    free = gpu_bytes - weights_bytes - kv - extra - activations
    return WorkerMemory(kv, (num_slots - 1) * seg, extra, activations, free)
