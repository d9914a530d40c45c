"""The CPU put split over the kernels' threads stores exactly what one thread stores: checked
against a plain torch indexing copy over random run layouts (tiny, page-boundary, empty runs,
overlapping sources), with every thread count and threshold, and hostile runs rejected
before any byte is written."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tokenlake as tl
from tokenlake.engines.core import puts
from tokenlake.engines.core.kv_pool import KVPool
from tokenlake.engines.kernels import cpu

ALWAYS, NEVER = 0, 1 << 62  # min_parallel_bytes: split every put / none


def random_runs(rng: np.random.Generator, num_slots: int, page_len: int, num_rows: int):
    """Runs into distinct tokens (no two runs write one token), sources anywhere (reads may
    overlap), lengths from 0 to a whole page, many ending at the page boundary."""
    free = rng.permutation(num_slots * page_len)  # candidate first tokens, in random order
    runs = []
    for start in free[: rng.integers(1, 12)]:
        slot, off = divmod(int(start), page_len)
        room = page_len - off
        length = int(rng.choice([0, 1, room, rng.integers(0, room + 1)]))
        length = min(length, num_rows)
        runs.append([int(rng.integers(0, num_rows - length + 1)), length, slot, off])
    # keep only runs that do not write a token an earlier run writes
    taken = np.zeros(num_slots * page_len, dtype=bool)
    kept = []
    for src, n, slot, off in runs:
        span = slice(slot * page_len + off, slot * page_len + off + n)
        if not taken[span].any():
            taken[span] = True
            kept.append([src, n, slot, off])
    return np.array(kept, dtype=np.int32).reshape(-1, 4)


def reference(pool: KVPool, runs: np.ndarray, kv: torch.Tensor, layer: int) -> torch.Tensor:
    """What a put must store: one advanced-indexing assignment of every row (runs into
    distinct tokens), independent of the C++ copy."""
    out = pool.data.clone()
    src = [np.arange(s, s + n) for s, n, _, _ in runs.tolist()]
    slot = [np.full(n, d) for _, n, d, _ in runs.tolist()]
    off = [np.arange(o, o + n) for _, n, _, o in runs.tolist()]
    if runs.size:
        src_i, slot_i, off_i = (
            torch.from_numpy(np.concatenate(a)).long() for a in (src, slot, off)
        )
        for kv_half in (0, 1):
            out[layer, slot_i, kv_half, off_i] = kv[src_i, kv_half]
    return out


@pytest.mark.parametrize("num_threads", [1, 2, 3])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_parallel_put_matches_an_indexing_copy(num_threads, dtype):
    before = cpu.get_num_threads()
    cpu.set_num_threads(num_threads)
    try:
        rng = np.random.default_rng(num_threads)
        for case in range(40):
            page_len = int(rng.choice([1, 2, 7, 16]))
            num_slots, num_rows = int(rng.integers(1, 6)), int(rng.integers(1, 40))
            heads, dim = int(rng.choice([1, 2])), int(rng.choice([1, 4, 8]))
            shape = tl.ModelShape(2, heads, heads, dim, dtype)
            kv = torch.randn(
                (num_rows, 2, heads, dim), generator=torch.Generator().manual_seed(case)
            )
            kv = kv.to(shape.torch_dtype)
            runs = random_runs(rng, num_slots, page_len, num_rows)
            layer = case % 2
            for threshold in (ALWAYS, 1, 64, puts.PUT_PARALLEL_MIN_BYTES, NEVER):
                pool = KVPool(shape, num_slots, page_len)
                pool.data.copy_(torch.randn(pool.data.shape).to(pool.data.dtype))
                expected = reference(pool, runs, kv, layer)
                puts.write_runs(pool, runs, kv, layer, min_parallel_bytes=threshold)
                assert torch.equal(pool.data, expected), (case, threshold, runs.tolist())
    finally:
        cpu.set_num_threads(before)


def test_parallel_put_of_a_large_chunk_matches_one_thread():
    """A put split into many chunks (2 KiB rows, 64 KiB chunks) equals the one-thread put."""
    shape = tl.ModelShape(1, 4, 4, 64, "float32")
    page_len, num_rows = 64, 1500  # 1500 rows x 2 KiB: over 1 MiB
    rng = np.random.default_rng(5)
    slots = rng.permutation(40)[: -(-num_rows // page_len)]
    runs = np.array(
        [
            [s, min(page_len, num_rows - s), slots[k], 0]
            for k, s in enumerate(range(0, num_rows, page_len))
        ],
        dtype=np.int32,
    )
    kv = torch.randn((num_rows, 2, 4, 64))
    one, split = KVPool(shape, 40, page_len), KVPool(shape, 40, page_len)
    puts.write_runs(one, runs, kv, 0, min_parallel_bytes=NEVER)
    puts.write_runs(split, runs, kv, 0, min_parallel_bytes=1 << 20)
    assert torch.equal(one.data, split.data)
    assert torch.equal(one.data, reference(KVPool(shape, 40, page_len), runs, kv, 0))


def test_overlapping_runs_are_written_in_order_as_by_one_thread():
    """A hostile plan whose runs write the same tokens gets what one thread writes (the last
    run wins), never a mix decided by thread timing."""
    shape = tl.ModelShape(1, 1, 1, 4, "float32")
    kv = torch.randn((30, 2, 1, 4))
    runs = np.array([[0, 10, 1, 0], [10, 10, 1, 5], [20, 6, 0, 2], [3, 4, 1, 8]], dtype=np.int32)
    expected = KVPool(shape, 3, 16)
    for s, n, slot, off in runs.tolist():  # in order: later runs overwrite earlier ones
        expected.data[0, slot, :, off : off + n] = kv[s : s + n].transpose(0, 1)
    for threshold in (ALWAYS, NEVER):
        pool = KVPool(shape, 3, 16)
        puts.write_runs(pool, runs, kv, 0, min_parallel_bytes=threshold)
        assert torch.equal(pool.data, expected.data)


@pytest.mark.parametrize("threshold", [ALWAYS, NEVER])
def test_hostile_runs_are_rejected_before_any_write(threshold):
    shape = tl.ModelShape(2, 4, 2, 8, "float32")
    pool = KVPool(shape, 4, 8)
    pool.data.normal_()
    kv = torch.randn((6, 2, 2, 8))
    before = pool.data.clone()
    good = [0, 6, 2, 1]
    for bad, name in [
        ([1, 6, 0, 0], "src_row"),
        ([0, -3, 0, 0], "length"),
        ([0, 1, 4, 0], "dst_slot"),
        ([0, 1, -(2**31), 0], "dst_slot"),
        ([0, 2, 0, 7], "dst_offset"),
        ([2**31 - 1, 1, 0, 0], "src_row"),
        ([0, 2**31 - 1, 0, 0], "src_row"),
    ]:
        runs = np.array([good, good, bad], dtype=np.int32)
        with pytest.raises(ValueError, match=f"runs: {name} out of range in run 2"):
            puts.write_runs(pool, runs, kv, 1, min_parallel_bytes=threshold)
        assert torch.equal(pool.data, before)


def test_engine_put_splits_by_the_configured_threshold():
    """Through the engine clients, a put split on every call (threshold 0) and one never split
    store the same bytes, which are the planned rows of every destination."""
    from tokenlake.engines.clusters.local import LocalCluster
    from tokenlake.engines.dataplane_config import DataPlaneConfig

    shape = tl.ModelShape(2, 4, 2, 8, "float32")
    cfg = tl.PoolConfig(shape, 2, num_slots=16, segment_len=8)
    ids = np.arange(70, dtype=np.int32) % 17
    kv = torch.randn((2, 70, 2, 2, 8), generator=torch.Generator().manual_seed(1))
    stored = []
    for threshold in (ALWAYS, NEVER):
        pool = tl.Pool(cfg)
        dp = DataPlaneConfig(max_q_rows=128, max_kv_rows=128, put_parallel_min_bytes=threshold)
        cluster = LocalCluster(cfg, dataplane=dp)
        plans = pool.gen_plans([[tl.Chunk("r", ids, 0)]], dops=[1])
        tp = plans.transfer_plans[0]
        engine = cluster.engine(tp.origin)
        kv_buf = engine.init_transfer(tp)
        kv_buf.copy_(kv)
        for layer in range(2):
            engine.put(kv_buf, layer)
        cluster.synchronize()
        for d, dst in enumerate(tp.dst_ids.tolist()):
            src, slot, off = (torch.from_numpy(np.asarray(a)).long() for a in tp.rows_to(d))
            for layer in range(2):
                got = cluster.kv_pools[dst].data[layer][slot, :, off]  # [rows, 2, H, D]
                assert torch.equal(got, kv[layer, src])
        stored.append([p.data.clone() for p in cluster.kv_pools])
        pool.commit(plans)
    assert all(torch.equal(a, b) for a, b in zip(*stored, strict=True))


def test_config_rejects_a_bad_threshold():
    from tokenlake.engines.dataplane_config import DataPlaneConfig

    for bad in (-1, True, 1.5, "1"):
        with pytest.raises(tl.InvalidArgumentError, match="put_parallel_min_bytes"):
            DataPlaneConfig(put_parallel_min_bytes=bad)
    assert DataPlaneConfig(put_parallel_min_bytes=0).put_parallel_min_bytes == 0
