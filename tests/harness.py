"""Test harness: a Pool + LocalCluster + SyntheticModel that runs iterations and compares
every row of every layer against monolithic causal attention over the whole sequence."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

import tokenlake as tl
from tokenlake.engines.client.synthetic import SyntheticModel, run_iteration
from tokenlake.engines.clusters.local import LocalCluster

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
        logit_cap: float = 0.0,
        eviction: tl.EvictionConfig | None = None,
        num_tier_blocks: int = 0,
    ) -> None:
        self.shape = tl.ModelShape(
            num_layers, num_q_heads, num_kv_heads, head_dim, dtype, logit_cap=logit_cap
        )
        self.config = tl.PoolConfig(
            self.shape, num_instances, num_slots, segment_len, num_tier_blocks=num_tier_blocks
        )
        self.pool = tl.Pool(self.config, hasher, balancer=balancer, eviction=eviction)
        self.cluster = LocalCluster(self.pool, backend=backend)
        self.model = SyntheticModel(self.shape, seed=1)
        self.tolerance = TOLERANCE[dtype]
        self.last_plans: tl.Plans | None = None

    def step(self, batches: Sequence[Sequence[tl.Chunk]], dops=None) -> float:
        """Plan, execute, commit one iteration; return the max abs error vs monolithic."""
        plans = self.pool.gen_plans(batches, dops)
        self.pool.check_invariants()
        err = self.execute(plans, batches)
        self.pool.commit(plans)
        self.cluster.retire(plans.epoch)
        self.pool.check_invariants()
        self.last_plans = plans
        return err

    def execute(self, plans: tl.Plans, batches: Sequence[Sequence[tl.Chunk]]) -> float:
        """Run planned ``batches`` on the cluster; return the max abs error of every row and
        layer vs monolithic attention (and check every new row was computed once)."""
        chunks = {c.request_id: c for batch in batches for c in batch}
        results = run_iteration(self.cluster, plans, chunks, self.model)
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

    def fail_over(self, plans: tl.Plans, error) -> list[int | str]:
        """The control plane's reaction to a ``PeerFailedError`` raised while executing
        ``plans``: abort the iteration, drop the failed instance from the pool and from the
        data plane, retire the epoch. Returns the running requests that lost data."""
        self.pool.abort(plans)
        failed = self.pool.drop_instance(error.instance_id)
        self.cluster.mark_lost(error.instance_id)
        self.cluster.retire(plans.epoch)
        return failed


def program_error(model: SyntheticModel, results: list, chunks: dict) -> float:
    """Largest |difference| of compute processes' ``SyntheticProgram`` results (one list per
    process, ``None`` without work) from monolithic attention; checks every new row of every
    layer came back exactly once."""
    import torch

    err, rows = 0.0, {}
    for result in results:
        for rid, first, end, layer, o, lse in result or []:
            ref_o, ref_lse = model.reference(chunks[rid].token_ids, first, end, layer)
            o = torch.from_numpy(o.copy()).view(ref_o.shape)
            lse = torch.from_numpy(lse.copy()).view(ref_lse.shape)
            err = max(err, float((o - ref_o).abs().max()), float((lse - ref_lse).abs().max()))
            rows[rid] = rows.get(rid, 0) + end - first
    for rid, chunk in chunks.items():
        assert rows[rid] == chunk.num_new_tokens * model.model.num_layers
    return err


def tokens(seed: int, n: int, vocab: int = 1000) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, n).astype(np.int32)


def prefill_decode_dedup_multiturn(h, num_instances: int, segment_len: int) -> None:
    """The exactness scenario every data plane runs: chunked prefill ending mid-segment, a
    second request sharing the document (hit + copy of part of a segment), batched decodes, a
    fresh empty-prefix request, then the first request's next turn reusing its partial tail."""
    c = segment_len
    doc = tokens(1, 5 * c + c // 2)
    a_ids = np.concatenate([doc, tokens(2, c + 3)])
    errs = [
        h.step([[tl.Chunk("a", a_ids, 0, 2 * c + c // 4)]]),
        h.step([[tl.Chunk("a", a_ids, 2 * c + c // 4)]]),
    ]
    b_ids = np.concatenate([doc, tokens(3, 2 * c)])
    hit = h.cached(b_ids)
    assert hit == 5 * c + c // 2
    errs.append(h.step([[tl.Chunk("b", b_ids, hit)]]))
    for step in range(3):  # decode both in one batch
        a_ids = np.append(a_ids, 7 + step)
        b_ids = np.append(b_ids, 9 + step)
        na, nb = h.pool.num_stored_tokens("a"), h.pool.num_stored_tokens("b")
        errs.append(h.step([[tl.Chunk("a", a_ids, na), tl.Chunk("b", b_ids, nb)]]))
    batches = [
        [tl.Chunk("a", np.append(a_ids, 1), len(a_ids))],
        [tl.Chunk("d", tokens(4, c + 5), 0)],
        [tl.Chunk("b", np.append(b_ids, 1), len(b_ids))],
    ]
    errs.append(h.step(batches[:num_instances]))
    a_ids = np.append(a_ids, 1)
    h.pool.finish("a")  # its next turn: sealed segments and the partial tail (copy-on-extend)
    turn2 = np.concatenate([a_ids, tokens(5, 2 * c + 1)])
    hit2 = h.cached(turn2)
    assert hit2 == len(a_ids)
    errs.append(h.step([[tl.Chunk("a2", turn2, hit2)]]))
    copies = h.last_plans.transfer_plans[0].copy_len
    assert list(copies) == ([len(a_ids) % c] if len(a_ids) % c else [])
    assert max(errs) <= h.tolerance, errs


def dop_split_and_spread(h, num_instances: int) -> None:
    """A DoP>1 batch splits rows across instances; the prefix lives on several holders."""
    ids = tokens(11, 16 * 12 + 5)
    assert h.step([[tl.Chunk("p", ids, 0, 16 * 9)]], dops=[num_instances]) <= h.tolerance
    assert len(set(h.last_plans.groups[0])) == num_instances
    assert h.step([[tl.Chunk("p", ids, 16 * 9)]], dops=[2]) <= h.tolerance
    holders = {int(i) for qp in h.last_plans.query_plans for i in qp.holder_ids}
    assert len(holders) >= 2, "prefix should be spread over several instances"


def tier_round_trip(h, num_instances: int) -> None:
    """A document evicted from a full pool into the host tier comes back exactly: its next
    turn runs at DoP ``num_instances`` (every sub-batch reads, and loads, its segments from
    the tier), then decodes over the promoted prefix. ``h``: a pool of 6 slots per instance
    and a host tier."""
    c = h.config.segment_len
    doc = tokens(41, 6 * c)
    errs = [h.step([[tl.Chunk("a", np.append(doc, 1), 0)]], dops=[num_instances])]
    h.pool.finish("a")
    flood = tokens(42, h.config.capacity_tokens - 3 * c)  # needs most of the pool
    errs.append(h.step([[tl.Chunk("b", flood, 0)]], dops=[2]))
    h.pool.finish("b")
    assert h.pool.get_stats()["tier_demotions"] > 0
    turn = np.concatenate([doc, tokens(43, 2 * c + 3)])
    hit = h.cached(turn)
    assert hit >= 3 * c, hit  # the demoted segments still match
    errs.append(h.step([[tl.Chunk("a2", turn, hit)]], dops=[num_instances]))
    loads = [tp.num_loads for tp in h.last_plans.transfer_plans]
    assert sum(loads) >= 3 and min(loads) > 0, loads  # every sub-batch loads what it reads
    for step in range(3):
        turn = np.append(turn, step)
        errs.append(h.step([[tl.Chunk("a2", turn, h.pool.num_stored_tokens("a2"))]]))
    stats = h.pool.get_stats()
    assert stats["tier_promotions"] >= 3 and stats["tier_hit_tokens"] >= 3 * c, stats
    assert max(errs) <= h.tolerance, errs
