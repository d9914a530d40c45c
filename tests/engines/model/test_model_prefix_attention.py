"""``attend_with_prefix`` (prefix partial + causal partial over the new tokens) equals
monolithic causal attention over the whole sequence, for every backend and GQA shape."""

from __future__ import annotations

import pytest
import torch

from tokenlake.engines.client.prefix_attention import attend_with_prefix
from tokenlake.engines.kernels.reference import attend
from tokenlake.errors import InvalidArgumentError


def case(prefix_lens, new_lens, h_q=4, h_kv=2, d=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    seqs = []
    for p, n in zip(prefix_lens, new_lens, strict=True):
        q = torch.randn((p + n, h_q, d), generator=gen)
        k = torch.randn((p + n, h_kv, d), generator=gen)
        v = torch.randn((p + n, h_kv, d), generator=gen)
        seqs.append((p, n, q, k, v))
    return seqs


@pytest.mark.parametrize("logit_cap", [0.0, 2.5])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize(
    "prefix_lens, new_lens",
    [([0, 5, 17], [3, 1, 8]), ([4, 0, 9], [1, 1, 1]), ([0], [1]), ([30, 2], [12, 5])],
)
def test_equals_monolithic_attention(backend, prefix_lens, new_lens, logit_cap):
    """Ragged prefill chunks, and all-decode batches (one new token each, with and without a
    prefix: the whole-batch merge path), soft-capped or not."""
    seqs = case(prefix_lens, new_lens)
    qs, ks, vs, pos, plse, refs = [], [], [], [], [], []
    for p, _n, q, k, v in seqs:
        qs.append(q[p:])
        ks.append(k[p:])
        vs.append(v[p:])
        scale = dict(sm_scale=16**-0.5, logit_cap=logit_cap)
        o_p, lse_p = attend(q[p:], k[:p], v[:p], causal=False, **scale)
        pos.append(o_p)
        plse.append(lse_p)
        refs.append(attend(q[p:], k, v, causal=True, **scale))
    indptr = torch.tensor([0] + list(torch.tensor(new_lens).cumsum(0)), dtype=torch.int32)
    o, lse = attend_with_prefix(
        torch.cat(qs), torch.cat(ks), torch.cat(vs), indptr, torch.cat(pos), torch.cat(plse),
        backend=backend, logit_cap=logit_cap,
    )  # fmt: skip
    assert float((o - torch.cat([r[0] for r in refs])).abs().max()) <= 1e-5
    assert float((lse - torch.cat([r[1] for r in refs])).abs().max()) <= 1e-5


def test_more_keys_than_rows_is_bottom_right_causal():
    """A piece of a chunk split over instances: its rows are the chunk's last rows."""
    ((p, n, q, k, v),) = case([6], [10])
    o_p, lse_p = attend(q[p + 4 :], k[:p], v[:p], causal=False, sm_scale=0.25)
    o, _ = attend_with_prefix(
        q[p + 4 :], k[p:], v[p:], torch.tensor([0, 6], dtype=torch.int32), o_p, lse_p,
        kv_indptr=torch.tensor([0, 10], dtype=torch.int32), backend="cpu",
    )  # fmt: skip
    ref, _ = attend(q[p + 4 :], k, v, causal=True, sm_scale=0.25)
    assert float((o - ref).abs().max()) <= 1e-5


def test_bad_shapes_are_named():
    q = torch.zeros((3, 4, 8))
    with pytest.raises(InvalidArgumentError, match="prefix_o"):
        attend_with_prefix(q, q[:, :2], q[:, :2], torch.tensor([0, 3], dtype=torch.int32),
                           torch.zeros((2, 4, 8)), torch.zeros((3, 4)))  # fmt: skip
    with pytest.raises(InvalidArgumentError, match="q_indptr"):
        attend_with_prefix(q, q[:, :2], q[:, :2], torch.tensor([0, 3]),
                           torch.zeros((3, 4, 8)), torch.zeros((3, 4)))  # fmt: skip
