"""The GPU path: FlashInfer kernels and the CUDA data plane (CUDA IPC buffers, interprocess
events, NCCL between hosts). The ``gpu`` tests are skipped without CUDA — this path has not
been run on a GPU. The FlashInfer backend's host-side edge handling is tested everywhere."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tokenlake.engines.kernels import flashinfer_backend as fb
from tokenlake.engines.kernels import partial_attention, reference
from tokenlake.engines.kernels.inputs import PagedCSR

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def i32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def test_nonempty_batch_drops_empty_requests_and_hides_causal_rows():
    # request 0: 2 rows, no pages; 1: 3 rows over 2 pages (kv_len 4 + 1 = 5);
    # 2: 0 rows; 3: 4 rows over 1 page with 2 keys (causal: rows 0, 1 see nothing)
    q_indptr = i32([0, 2, 5, 5, 9])
    kv_indptr = i32([0, 0, 2, 3, 4])
    kv_indices = i32([7, 3, 9, 5])
    last_len = i32([1, 1, 4, 2])
    csr = PagedCSR(q_indptr, kv_indptr, kv_indices, last_len)
    b = fb.nonempty_batch(csr, page_size=4, causal=True)
    assert b.rows.tolist() == [2, 3, 4, 5, 6, 7, 8]
    assert b.csr.q_indptr.tolist() == [0, 3, 7]
    assert b.csr.kv_indptr.tolist() == [0, 2, 3] and b.csr.kv_indices.tolist() == [7, 3, 5]
    assert b.csr.last_len.tolist() == [1, 2]
    assert b.visible.tolist() == [True, True, True, False, False, True, True]
    flat = fb.nonempty_batch(csr, 4, causal=False)
    assert flat.visible.all()
    none = fb.nonempty_batch(PagedCSR(i32([0, 1]), i32([0, 0]), i32([]), i32([1])), 4, False)
    assert none.rows.numel() == 0


def test_lse_base_conversion():
    lse2 = torch.tensor([0.0, 1.0, 3.5, -math.inf])
    assert torch.allclose(fb.to_natural_lse(lse2)[:3], torch.tensor([0.0, 1.0, 3.5]) * math.log(2))
    assert fb.to_natural_lse(lse2)[3] == -math.inf


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("rows_per_req", [1, 5])
@pytest.mark.parametrize("logit_cap", [0.0, 2.0])
def test_flashinfer_matches_reference(causal, rows_per_req, logit_cap):
    pytest.importorskip("flashinfer")
    gen = torch.Generator().manual_seed(0)
    num_slots, c, h_kv, h_q, d = 16, 16, 2, 8, 64
    pool = torch.randn((num_slots, 2, c, h_kv, d), generator=gen).to("cuda", torch.bfloat16)
    pages = [[], [3], [1, 7, 2], [5, 4]]  # request 0 has an empty prefix
    last = [1, 9, 16, 3]
    q_indptr = i32(np.arange(len(pages) + 1) * rows_per_req)
    kv_indptr = i32(np.concatenate([[0], np.cumsum([len(p) for p in pages])]))
    args = (
        q_indptr.cuda(),
        pool,
        kv_indptr.cuda(),
        i32([s for p in pages for s in p]).cuda(),
        i32(last).cuda(),
    )
    q = torch.randn((int(q_indptr[-1]), h_q, d), generator=gen).to("cuda", torch.bfloat16)
    kw = dict(causal=causal, logit_cap=logit_cap)
    o, lse = partial_attention(q, *args, backend="flashinfer", **kw)
    o_ref, lse_ref = partial_attention(q, *args, backend="torch", **kw)
    assert o.dtype == lse.dtype == torch.float32
    assert torch.isneginf(lse[:rows_per_req]).all() and o[:rows_per_req].eq(0).all()
    finite = torch.isfinite(lse_ref)
    assert torch.equal(finite, torch.isfinite(lse))
    torch.testing.assert_close(o, o_ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse[finite], lse_ref[finite], atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("separate_hosts", [False, True])
def test_cuda_data_plane_query_matches_dense_attention(separate_hosts):
    """Put a prompt's K/V through the CUDA engines (IPC buffers, interprocess events; NCCL
    between "hosts"), then query it from the other instance; compare with dense attention."""
    if separate_hosts:
        pytest.skip(
            "needs 2 hosts or 2 GPUs: NCCL refuses two ranks on one GPU, and one machine's "
            "instances exchange through CUDA IPC buffers (separate_hosts is refused on CUDA)"
        )
    pytest.importorskip("flashinfer")
    import tokenlake as tl
    from tokenlake.engines.clusters.mp import MPCluster
    from tokenlake.engines.dataplane_config import DataPlaneConfig

    shape = tl.ModelShape(
        num_layers=2, num_q_heads=8, num_kv_heads=2, head_dim=64, dtype="bfloat16"
    )
    pool = tl.Pool(tl.PoolConfig(shape, 2, num_slots=32, segment_len=16, device="cuda"))
    config = DataPlaneConfig(
        max_q_rows=128, max_kv_rows=128, device="cuda", separate_hosts=separate_hosts
    )
    gen = torch.Generator().manual_seed(0)
    ids = np.arange(16 * 5 + 3, dtype=np.int32)
    with MPCluster(pool, config) as cluster:
        plans = pool.gen_plans([[tl.Chunk("a", ids, 0)]], dops=[2])
        stored = []
        for tp in plans.transfer_plans:
            engine = cluster.engine(tp.origin)
            kv_buf = engine.init_transfer(tp)
            kv = torch.randn(kv_buf.shape, generator=gen).to(torch.bfloat16)
            kv_buf.copy_(kv)
            stored.append(kv)
            for layer in range(shape.num_layers):
                engine.put(kv_buf, layer)
        cluster.synchronize()
        pool.commit(plans)
        kv_all = torch.cat(stored, dim=1)  # [layers, len(ids), 2, H_kv, D], sub-batches in order
        ext = np.append(ids, 1)
        plans = pool.gen_plans([[tl.Chunk("a", ext, len(ids))]])
        qp = plans.query_plans[0]
        engine = cluster.engine(qp.origin)
        q_buf = engine.init_query(qp)
        q = torch.randn(q_buf.shape, generator=gen).to(torch.bfloat16)
        q_buf.copy_(q)
        for layer in range(shape.num_layers):
            o, lse = engine.query(q_buf, layer)
            k, v = kv_all[layer, :, 0].float(), kv_all[layer, :, 1].float()
            o_ref, lse_ref = reference.attend(q.float(), k, v, False, shape.head_dim**-0.5)
            torch.testing.assert_close(o.cpu(), o_ref, atol=3e-2, rtol=3e-2)
            torch.testing.assert_close(lse.cpu(), lse_ref, atol=3e-2, rtol=3e-2)
        pool.abort(plans)
