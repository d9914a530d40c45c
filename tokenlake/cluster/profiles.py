"""Hardware and model profiles for cost models: ``get_cache_load``, the scheduler's latency
model and the cluster simulator all read these. Numbers are vendor datasheet peaks (dense
BF16, no sparsity) and the paper's testbed links; see each constant."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from functools import cached_property

from tokenlake.config import ModelShape
from tokenlake.errors import InvalidArgumentError

GiB = 2**30


@dataclass(frozen=True)
class HardwareProfile:
    """One instance (accelerator) and its links.

    Args:
        peak_flops: dense FLOP/s at the KV dtype. mem_bandwidth: bytes/s of device memory.
        mem_bytes: device memory. intra_node_bandwidth / inter_node_bandwidth: bytes/s one
        instance can send to a peer in its node / in another node. net_latency_s: one-way
        latency of a small message.
    """

    name: str
    peak_flops: float
    mem_bandwidth: float
    mem_bytes: int
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    net_latency_s: float = 10e-6

    def __post_init__(self) -> None:
        for field in (
            "peak_flops",
            "mem_bandwidth",
            "mem_bytes",
            "intra_node_bandwidth",
            "inter_node_bandwidth",
        ):
            if not getattr(self, field) > 0:
                raise InvalidArgumentError(
                    f"HardwareProfile.{field}: expected > 0, got {getattr(self, field)!r}"
                )
        if self.net_latency_s < 0:
            raise InvalidArgumentError(
                f"HardwareProfile.net_latency_s: expected >= 0, got {self.net_latency_s}"
            )


# NVIDIA A100 SXM 80GB: 312 TFLOP/s BF16 dense, 2.039 TB/s HBM2e. The paper's servers: NVLink
# 400 GB/s, four 200 Gbps InfiniBand NICs per 8-GPU server (100 GB/s / 8 per GPU).
A100_80G = HardwareProfile("A100-80G", 312e12, 2.039e12, 80 * GiB, 400e9, 100e9 / 8)
# H100 SXM5 80GB: 989 TFLOP/s BF16 dense, 3.35 TB/s HBM3, NVLink 4 at 900 GB/s (450 GB/s
# per direction), one 400 Gbps NIC per GPU.
H100 = HardwareProfile("H100", 989e12, 3.35e12, 80 * GiB, 450e9, 50e9)
# H200 SXM 141GB: H100 compute with 4.8 TB/s HBM3e.
H200 = HardwareProfile("H200", 989e12, 4.8e12, 141 * GiB, 450e9, 50e9)

HARDWARE = {p.name: p for p in (A100_80G, H100, H200)}


@dataclass(frozen=True)
class ModelProfile:
    """A Llama-architecture decoder: enough to count weights, FLOPs and KV bytes."""

    name: str
    num_layers: int
    hidden_size: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    dtype: str = "bfloat16"

    @cached_property  # a frozen profile: computed once (hot in the simulator)
    def shape(self) -> ModelShape:
        return ModelShape(
            self.num_layers, self.num_q_heads, self.num_kv_heads, self.head_dim, self.dtype
        )

    @cached_property
    def num_params(self) -> int:
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        attn = h * self.num_q_heads * self.head_dim * 2 + h * kv * 2  # q, o, k, v projections
        mlp = 3 * h * self.intermediate_size  # gate, up, down
        return self.num_layers * (attn + mlp) + 2 * self.vocab_size * h

    @cached_property
    def weight_bytes(self) -> int:
        return self.num_params * self.shape.dtype_bytes

    def linear_flops(self, num_tokens: int) -> float:
        """FLOPs of every matmul except attention scores, for ``num_tokens`` tokens."""
        return 2.0 * self.num_params * num_tokens

    def attention_flops(self, num_new: int, kv_len: int) -> float:
        """FLOPs of QK^T and PV for ``num_new`` query rows over ``kv_len`` keys, all layers."""
        return 4.0 * self.num_layers * self.num_q_heads * self.head_dim * num_new * kv_len


# Llama-2-7B (LWM-Text-1M, the paper's model, has the same architecture).
LLAMA2_7B = ModelProfile("Llama-2-7B", 32, 4096, 32, 32, 128, 11008, 32000)
LWM_7B_1M = ModelProfile("LWM-Text-1M", 32, 4096, 32, 32, 128, 11008, 32000)
LLAMA3_8B = ModelProfile("Llama-3-8B", 32, 4096, 32, 8, 128, 14336, 128256)

MODELS = {p.name: p for p in (LLAMA2_7B, LWM_7B_1M, LLAMA3_8B)}


def calibrate_cpu(
    num_bytes: int = 256 * 2**20, matmul_size: int = 1024, repeats: int = 3
) -> HardwareProfile:
    """Measure this machine (memcpy bandwidth, fp32 matmul FLOP/s) as a CPU profile.

    Links are modelled as shared memory at memcpy speed; takes about a second.
    """
    import torch  # measuring needs it; importing the control plane does not

    src = torch.ones(num_bytes // 4)
    dst = torch.empty_like(src)
    a = torch.randn(matmul_size, matmul_size)
    best_copy = best_mm = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best_copy = min(best_copy, time.perf_counter() - t0)
        t0 = time.perf_counter()
        torch.mm(a, a)
        best_mm = min(best_mm, time.perf_counter() - t0)
    copy_bw = 2 * num_bytes / best_copy  # read + write
    flops = 2 * matmul_size**3 / best_mm
    mem_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return HardwareProfile(
        "CPU (calibrated)", flops, copy_bw, mem_bytes, copy_bw / 2, copy_bw / 2, 50e-6
    )
