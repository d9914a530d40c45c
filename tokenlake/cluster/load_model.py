"""Cache-load isolation (paper §6.1): the share ``L`` of the cluster's time that TokenLake's
prefix attention and puts take, so the scheduler can leave room for it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokenlake.cluster.profiles import HardwareProfile, ModelProfile
from tokenlake.errors import InvalidArgumentError


@dataclass(frozen=True)
class LoadModel:
    """Roofline estimate of TokenLake's load for a set of requests on ``num_instances``
    instances of ``hardware`` serving ``model``."""

    hardware: HardwareProfile
    model: ModelProfile

    def min_iteration_time(self, reqs: Sequence[tuple[int, int]], num_instances: int) -> float:
        """``T_r``: the iteration time if all instances were perfectly used (roofline over
        the whole forward: weights read once per instance, linear and attention FLOPs, and
        the KV read and written — prefix attention included, so ``L`` is TokenLake's share
        of the whole iteration; a scheduler whose latency model leaves prefix attention out
        scales its batch times by ``1 / (1 - L)``)."""
        m, hw = self.model, self.hardware
        num_new = sum(n for _, n in reqs)
        flops = m.linear_flops(num_new) + sum(m.attention_flops(n, p + n) for p, n in reqs)
        kv_bytes = sum(p + n for p, n in reqs) * m.shape.kv_bytes_per_token
        memory = num_instances * m.weight_bytes + kv_bytes
        return max(
            flops / (num_instances * hw.peak_flops), memory / (num_instances * hw.mem_bandwidth)
        )

    def cache_load(self, reqs: Sequence[tuple[int, int]], num_instances: int) -> float:
        """``L = max(M/(M + N·B·T), F/(F + N·F_peak·T))`` with ``M`` the KV bytes TokenLake
        reads and writes (prefix read + new KV written, all layers) and ``F`` the prefix
        attention FLOPs (``4·layers·H_q·D·prefix·new``: QK^T and PV)."""
        if num_instances < 1:
            raise InvalidArgumentError(f"num_instances: expected >= 1, got {num_instances}")
        for i, pair in enumerate(reqs):
            if len(pair) != 2 or min(pair) < 0:
                raise InvalidArgumentError(
                    f"reqs[{i}]: expected (prefix_len, input_len) >= 0, got {pair!r}"
                )
        if not reqs:
            return 0.0
        m, hw = self.model, self.hardware
        t_r = self.min_iteration_time(reqs, num_instances)
        mem = sum(p + n for p, n in reqs) * m.shape.kv_bytes_per_token
        flops = sum(m.attention_flops(n, p) for p, n in reqs)
        mem_share = mem / (mem + num_instances * hw.mem_bandwidth * t_r)
        flop_share = flops / (flops + num_instances * hw.peak_flops * t_r) if flops else 0.0
        return max(mem_share, flop_share)
