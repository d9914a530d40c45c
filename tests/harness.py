"""Test harness: a Pool + LocalCluster + SyntheticModel that runs iterations and compares
every row of every layer against monolithic causal attention over the whole sequence."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

import tokenlake as tl
from tokenlake.engines.local_cluster import LocalCluster
from tokenlake.engines.synthetic import SyntheticModel, run_iteration

TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}


class Harness:
    def __init__(
        self,
        num_instances: int = 2,
        segment_len: int = 16,
        num_slots: int = 64,
        dtype: str = "float32",
        num_q_heads: int = 4,
        num_kv_heads: int = 2,
        head_dim: int = 16,
        num_layers: int = 2,
        backend: str | None = "torch",
        hasher: tl.SegmentHasher | None = None,
        balancer=None,
    ) -> None:
        self.shape = tl.ModelShape(num_layers, num_q_heads, num_kv_heads, head_dim, dtype)
        self.config = tl.PoolConfig(self.shape, num_instances, num_slots, segment_len)
        self.pool = tl.Pool(self.config, hasher, balancer=balancer)
        self.cluster = LocalCluster(self.pool, backend=backend)
        self.model = SyntheticModel(self.shape, seed=1)
        self.tolerance = TOLERANCE[dtype]
        self.last_plans: tl.Plans | None = None

    def step(self, batches: Sequence[Sequence[tl.Chunk]], dops=None) -> float:
        """Plan, execute, commit one iteration; return the max abs error vs monolithic."""
        plans = self.pool.gen_plans(batches, dops)
        self.pool.check_invariants()
        chunks = {c.request_id: c for batch in batches for c in batch}
        results = run_iteration(self.cluster, plans, chunks, self.model)
        self.pool.commit(plans)
        self.pool.check_invariants()
        self.last_plans = plans
        rows = {}
        err = 0.0
        for r in results:
            chunk = chunks[r.request_id]
            o, lse = self.model.reference(chunk.token_ids, r.first, r.end, r.layer)
            err = max(err, float((o - r.o).abs().max()), float((lse - r.lse).abs().max()))
            rows[r.request_id] = rows.get(r.request_id, 0) + (r.end - r.first)
        for rid, chunk in chunks.items():  # every new row was computed once per layer
            assert rows[rid] == chunk.num_new_tokens * self.shape.num_layers
        return err

    def cached(self, tokens: np.ndarray) -> int:
        return self.pool.get_prefix_tree().match(tokens).num_tokens


def tokens(seed: int, n: int, vocab: int = 1000) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, n).astype(np.int32)
