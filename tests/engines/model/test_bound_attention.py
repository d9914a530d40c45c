"""The bound-once forms of the decode path: ``CpuPart`` (a part's CSR checked and converted
once, run every layer) equals the checked one-shot kernel and re-checks whatever changes;
``PrefixAttention`` (an iteration's merge, bound once) equals monolithic attention and names
the tensor whose geometry differs from the bound one."""

from __future__ import annotations

import pytest
import torch

from tokenlake.engines import kernels
from tokenlake.engines.client.prefix_attention import PrefixAttention
from tokenlake.engines.kernels.cpu import CpuPart
from tokenlake.engines.kernels.inputs import PagedCSR
from tokenlake.engines.kernels.reference import attend
from tokenlake.errors import InvalidArgumentError

I32 = dict(dtype=torch.int32)


def paged_case(dtype=torch.float32, num_slots=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn((num_slots, 2, 4, 2, 8), generator=gen).to(dtype)  # C=4, H_kv=2, D=8
    q = torch.randn((3, 4, 8), generator=gen).to(dtype)  # rows 0..1: request 0, row 2: request 1
    csr = (
        torch.tensor([0, 2, 3], **I32),
        torch.tensor([0, 2, 3], **I32),
        torch.tensor([5, 1, 3], **I32),
        torch.tensor([3, 4], **I32),
    )
    return q, pool, csr


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("logit_cap", [0.0, 3.0])
def test_cpu_part_equals_checked_kernel_layer_after_layer(dtype, logit_cap):
    q, pool, csr = paged_case(dtype)
    part = CpuPart(PagedCSR(*csr), logit_cap=logit_cap)
    for layer_pool in (pool, pool.flip(0).contiguous(), pool * 2):  # three "layers"
        o, lse = part.run(q, layer_pool)
        ref_o, ref_lse = kernels.partial_attention(
            q, csr[0], layer_pool, *csr[1:], backend="cpu", logit_cap=logit_cap
        )
        assert torch.equal(o, ref_o) and torch.equal(lse, ref_lse)
        torch_o, _ = kernels.partial_attention(
            q, csr[0], layer_pool, *csr[1:], backend="torch", logit_cap=logit_cap
        )
        assert float((o - torch_o).abs().max()) <= 2e-2 if dtype == torch.bfloat16 else 1e-5


def test_cpu_part_checks_its_csr_at_the_first_run():
    q, pool, (q_indptr, kv_indptr, kv_indices, last_len) = paged_case()
    bad = CpuPart(PagedCSR(q_indptr, kv_indptr, torch.tensor([5, 1, 6], **I32), last_len))
    with pytest.raises(InvalidArgumentError, match="kv_indices"):
        bad.run(q, pool)
    with pytest.raises(InvalidArgumentError, match="last_len"):
        CpuPart(PagedCSR(q_indptr, kv_indptr, kv_indices, torch.tensor([3, 5], **I32))).run(q, pool)


def test_cpu_part_rechecks_when_the_geometry_changes():
    """Once checked, a call with other shapes/dtypes/contiguity is checked in full again:
    a smaller pool (slot 5 out of range), other heads, a non-contiguous pool, another dtype."""
    q, pool, csr = paged_case()
    part = CpuPart(PagedCSR(*csr))
    part.run(q, pool)
    with pytest.raises(InvalidArgumentError, match="kv_indices"):
        part.run(q, pool[:5].contiguous())
    with pytest.raises(InvalidArgumentError, match="q"):
        part.run(q[:, :3], pool)
    with pytest.raises(InvalidArgumentError, match="q"):
        part.run(q[:2], pool)  # rows no longer those of q_indptr
    with pytest.raises(InvalidArgumentError, match="pool_layer"):
        part.run(q, pool.transpose(2, 3))
    with pytest.raises(InvalidArgumentError, match="q"):
        part.run(q.double(), pool)
    o, _ = part.run(q, pool)  # the first geometry is still fine
    assert torch.equal(o, kernels.partial_attention(q, csr[0], pool, *csr[1:], backend="cpu")[0])


def monolithic(lens, prefix_lens, h_q=4, h_kv=2, d=8, seed=1):
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for n, p in zip(lens, prefix_lens, strict=True):
        q, k, v = (torch.randn((p + n, h, d), generator=gen) for h in (h_q, h_kv, h_kv))
        o_p, lse_p = attend(q[p:], k[:p], v[:p], causal=False, sm_scale=d**-0.5)
        rows.append(
            (q[p:], k[p:], v[p:], o_p, lse_p, attend(q[p:], k, v, causal=True, sm_scale=d**-0.5))
        )
    return [torch.cat([r[i] for r in rows]) for i in range(5)], rows


@pytest.mark.parametrize(
    "lens, one_each", [([1, 1, 1], True), ([0, 2, 1], False), ([2, 0, 1], False)]
)
def test_prefix_attention_detects_one_token_each_by_its_offsets(lens, one_each):
    """As many rows as requests is not enough: ``[0, 0, 2, 3]`` has an empty request and one
    with two rows (the merge over the new tokens must then be causal)."""
    (q, k, v, o_p, lse_p), rows = monolithic(lens, [3, 0, 5])
    indptr = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], **I32)
    bound = PrefixAttention.bind(indptr, tuple(q.shape), k.shape[1], q.dtype, backend="cpu")
    assert bound.one_token_each is one_each
    for _ in range(2):  # a bound merge runs every layer
        o, lse = bound(q, k, v, o_p, lse_p)
        ref_o = torch.cat([r[5][0] for r in rows])
        ref_lse = torch.cat([r[5][1] for r in rows])
        assert float((o - ref_o).abs().max()) <= 1e-5
        assert float((lse - ref_lse).abs().max()) <= 1e-5


def test_prefix_attention_names_the_tensor_off_the_bound_geometry():
    (q, k, v, o_p, lse_p), _ = monolithic([1, 1], [2, 3])
    bound = PrefixAttention.bind(torch.tensor([0, 1, 2], **I32), tuple(q.shape), 2, q.dtype)
    with pytest.raises(InvalidArgumentError, match="^v"):
        bound(q, k, v[:, :1], o_p, lse_p)
    with pytest.raises(InvalidArgumentError, match="prefix_lse"):
        bound(q, k, v, o_p, lse_p.double())
    with pytest.raises(InvalidArgumentError, match="^q"):
        bound(q[:1], k, v, o_p, lse_p)
    with pytest.raises(InvalidArgumentError, match="H_kv"):
        PrefixAttention.bind(torch.tensor([0, 1, 2], **I32), tuple(q.shape), 3, q.dtype)
    with pytest.raises(InvalidArgumentError, match="q_indptr"):
        PrefixAttention.bind(torch.tensor([0, 1, 2]), tuple(q.shape), 2, q.dtype)
