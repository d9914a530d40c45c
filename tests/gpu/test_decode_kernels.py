"""The CUDA decode path run on CPU over a FlashInfer stand-in (tests/gpu/flashinfer_standin.py,
FlashInfer's conventions on the torch reference, each call one recorded launch): its results
against monolithic attention in float64, and its kernels per decode layer (aten ops that
launch one on a GPU + FlashInfer's launches): at most 10 with one holder, 14 with 2-4.
On a GPU the benchmark counts the same layer with torch.profiler; not run on a GPU here."""

from __future__ import annotations

import argparse
import inspect
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import decode_layer_bench as bench  # noqa: E402
from flashinfer_standin import FlashInferStandIn  # noqa: E402

from tokenlake.engines.client.prefix_attention import PrefixAttention  # noqa: E402
from tokenlake.engines.core.state_merge import StateMerge  # noqa: E402
from tokenlake.engines.kernels.flashinfer_backend import FlashInferPlanner  # noqa: E402
from tokenlake.errors import InvalidArgumentError  # noqa: E402

SHAPE = argparse.Namespace(num_q_heads=8, num_kv_heads=2, head_dim=16, page_len=8)
CPU = torch.device("cpu")


def monolithic(case: bench.Case, logit_cap: float = 0.0) -> torch.Tensor:
    """float64 attention of each request's q over its prefix keys and its new token."""
    h_q, h_kv, d, page = case.shape
    group = h_q // h_kv
    out = []
    for b in range(case.batch):
        pages = case.full.kv_indices[case.full.kv_indptr[b] : case.full.kv_indptr[b + 1]].long()
        kv = case.pool[pages].double()  # [P, 2, C, H_kv, D], the new token already put
        keys = kv[:, 0].reshape(-1, h_kv, d)[: case.context + 1]
        values = kv[:, 1].reshape(-1, h_kv, d)[: case.context + 1]
        assert torch.equal(keys[-1], case.kv[b, 0].double())  # the put landed where planned
        q = case.q[b].double().view(h_kv, group, d)
        scores = torch.einsum("hgd,thd->hgt", q, keys) * d**-0.5
        if logit_cap:
            scores = logit_cap * torch.tanh(scores / logit_cap)
        out.append(torch.einsum("hgt,thd->hgd", scores.softmax(-1), values).reshape(h_q, d))
    return torch.stack(out)


@pytest.mark.parametrize("holders", [1, 2, 4])
@pytest.mark.parametrize("logit_cap", [0.0, 2.0])
def test_decode_layer_on_flashinfer_matches_monolithic_attention(holders, logit_cap):
    fi = FlashInferStandIn()
    case = bench.Case(3, 45, holders, SHAPE, CPU, torch.bfloat16)
    planner = FlashInferPlanner(fi, CPU, case.shape, torch.bfloat16, logit_cap=logit_cap)
    parts = [planner.plan(csr) for csr in case.parts]
    h_q, h_kv, d, _ = case.shape
    attention = PrefixAttention.bind(
        np.arange(case.batch + 1), (case.batch, h_q, d), h_kv, torch.bfloat16,
        logit_cap=logit_cap, flashinfer=fi, num_prefix_states=holders,
    )  # fmt: skip
    o_states, lse_states = attention.prefix_states
    case.put()
    for s, part in enumerate(parts):
        part.run_native(case.q, case.pool, out=o_states[s], lse=lse_states[s])
    o, lse = attention(case.q, case.kv[:, 0], case.kv[:, 1])
    assert o.dtype == torch.bfloat16 and lse.dtype == torch.float32 and torch.isfinite(lse).all()
    torch.testing.assert_close(o.double(), monolithic(case, logit_cap), atol=2e-2, rtol=2e-2)
    assert fi.launches["merge_state" if holders == 1 else "merge_states"] == 1


@pytest.mark.parametrize("holders,most", [(1, 10), (2, 14), (3, 14), (4, 14)])
def test_kernels_per_decode_layer(holders, most):
    fi = FlashInferStandIn()
    for batch in (1, 16):  # the count does not grow with the batch
        case = bench.Case(batch, 64, holders, SHAPE, CPU, torch.bfloat16)
        layer = bench.tokenlake_layer(case, fi)
        layer()
        before = dict(fi.launches)
        kernels, host_reads = bench.count_kernels(layer, fi)
        launched = {k: v - before.get(k, 0) for k, v in fi.launches.items()}
        assert launched["BatchDecodeWithPagedKVCacheWrapper"] == holders  # FlashInfer's counted
        assert host_reads == 0
        assert kernels <= most, (holders, batch, kernels)
        # the baseline: the same put (2 kernels) and one decode
        assert bench.count_kernels(bench.flashinfer_layer(case, fi), fi)[0] == 3


def test_both_sides_get_the_same_tensor_core_rule_and_backend():
    fi = FlashInferStandIn()
    made = []
    for cls in ("BatchDecodeWithPagedKVCacheWrapper", "BatchPrefillWithPagedKVCacheWrapper"):
        base = getattr(fi, cls)
        setattr(fi, cls, type(cls, (base,), {"__init__": lambda self, *a, _b=base, **kw: (
            made.append(kw), _b.__init__(self, *a, **kw))[1]}))  # fmt: skip
    for h_q, h_kv in ((8, 2), (4, 2)):  # groups of 4 and 2
        case = bench.Case(2, 30, 1, argparse.Namespace(**{**vars(SHAPE), "num_q_heads": h_q,
                                                          "num_kv_heads": h_kv}), CPU,
                          torch.bfloat16)  # fmt: skip
        bench.tokenlake_layer(case, fi)
        bench.flashinfer_layer(case, fi)
        ours, theirs = made[-2:]
        assert ours == theirs == {"use_tensor_cores": h_q // h_kv >= 4, "backend": "fa2"}
    planner = FlashInferPlanner(fi, CPU, (8, 2, 16, 8), torch.bfloat16)
    csr = bench.Case(2, 30, 1, SHAPE, CPU, torch.bfloat16).parts[0]
    planner.plan(csr._replace(q_indptr=csr.q_indptr * 2), causal=True)  # two rows each: prefill
    assert made[-1] == {"backend": "fa2"}


def test_state_merge_on_flashinfer_matches_torch():
    gen = torch.Generator().manual_seed(1)
    # rows 0..3: row 0 has 3 states, row 1 one, row 2 none, row 3 two (one of them empty)
    rows = np.array([0, 3, 1, 0, 3, 0])
    o = torch.randn((6, 4, 8), generator=gen)
    lse = torch.randn((6, 4), generator=gen)
    lse[4] = -math.inf
    fi = FlashInferStandIn()
    planner = FlashInferPlanner(fi, CPU, (4, 2, 8, 8), torch.bfloat16)
    o_fi, lse_fi = StateMerge.build(rows, 4, CPU, planner).run(o, lse)
    o_ref, lse_ref = StateMerge.build(rows, 4, CPU).run(o, lse)
    assert fi.launches == {"merge_states": 1}
    assert o_fi.dtype == lse_fi.dtype == torch.float32
    torch.testing.assert_close(o_fi, o_ref, atol=2e-2, rtol=2e-2)
    assert torch.isneginf(lse_fi[2]).all() and o_fi[2].eq(0).all()
    finite = torch.isfinite(lse_ref)
    torch.testing.assert_close(lse_fi[finite], lse_ref[finite], atol=1e-5, rtol=1e-5)


def test_flashinfer_part_fills_empty_rows_and_refuses_native_form_then():
    fi = FlashInferStandIn()
    planner = FlashInferPlanner(fi, CPU, (8, 2, 16, 8), torch.bfloat16)
    case = bench.Case(3, 30, 1, SHAPE, CPU, torch.bfloat16)
    csr = case.parts[0]
    no_pages = csr._replace(kv_indptr=torch.tensor([0, 0, 4, 8], dtype=torch.int32),
                            kv_indices=csr.kv_indices[4:])  # fmt: skip
    part = planner.plan(no_pages)  # request 0 has no pages: not dense
    o, lse = part.run(case.q, case.pool)
    assert o[0].eq(0).all() and torch.isneginf(lse[0]).all() and torch.isfinite(lse[1:]).all()
    with pytest.raises(InvalidArgumentError, match="run_native"):
        part.run_native(case.q, case.pool)
    dense = planner.plan(csr)
    o_d, lse_d = dense.run(case.q, case.pool)
    o_n, lse_n = dense.run_native(case.q, case.pool)
    torch.testing.assert_close(o_d, o_n.float())
    torch.testing.assert_close(lse_d, lse_n * math.log(2.0))


def test_flashinfer_merge_needs_a_decode_step_of_a_16_bit_model():
    fi = FlashInferStandIn()
    with pytest.raises(InvalidArgumentError, match="flashinfer: FlashInfer's merge takes decode"):
        PrefixAttention.bind(np.array([0, 2, 3]), (3, 8, 16), 2, torch.bfloat16, flashinfer=fi)
    with pytest.raises(InvalidArgumentError, match="flashinfer"):
        PrefixAttention.bind(np.arange(4), (3, 8, 16), 2, torch.float32, flashinfer=fi)
    bound = PrefixAttention.bind(np.arange(4), (3, 8, 16), 2, torch.bfloat16, flashinfer=fi)
    q, kv = (
        torch.zeros((3, 8, 16), dtype=torch.bfloat16),
        torch.zeros((3, 2, 16), dtype=torch.bfloat16),
    )
    with pytest.raises(InvalidArgumentError, match="prefix_o: bound with flashinfer"):
        bound(q, kv, kv, torch.zeros((3, 8, 16)), torch.zeros((3, 8)))


def _recording(base: type, calls: list) -> type:
    """``base`` (a stand-in wrapper class) whose constructor, plan and run record their calls."""

    def wrap(name):
        def method(self, *args, **kwargs):
            calls.append((base.__name__, name, args, kwargs))
            return getattr(base, name)(self, *args, **kwargs)

        return method

    return type(base.__name__, (base,), {m: wrap(m) for m in ("__init__", "plan", "run")})


def test_the_decode_path_calls_bind_to_the_released_flashinfer_signatures():
    flashinfer = pytest.importorskip("flashinfer")  # imports on CPU (tvm_ffi)
    fi, calls = FlashInferStandIn(), []
    for cls in ("BatchDecodeWithPagedKVCacheWrapper", "BatchPrefillWithPagedKVCacheWrapper"):
        setattr(fi, cls, _recording(getattr(fi, cls), calls))
    for name in ("merge_state", "merge_states"):
        merge = getattr(fi, name)
        setattr(fi, name, lambda *a, _m=merge, _n=name, **k: (calls.append((None, _n, a, k)), _m(*a, **k))[1])  # fmt: skip
    for holders in (1, 3):
        bench.tokenlake_layer(bench.Case(2, 40, holders, SHAPE, CPU, torch.bfloat16), fi)()
    bench.flashinfer_layer(bench.Case(2, 40, 1, SHAPE, CPU, torch.bfloat16), fi)()
    for owner, name, args, kwargs in calls:
        if owner is None:
            inspect.signature(getattr(flashinfer, name)).bind(*args, **kwargs)
        else:
            real = getattr(getattr(flashinfer, owner), name)
            inspect.signature(real).bind(None, *args, **kwargs)
    made = {(owner, name) for owner, name, _, _ in calls}
    assert ("BatchDecodeWithPagedKVCacheWrapper", "run") in made
    assert (None, "merge_state") in made and (None, "merge_states") in made


GPU_SHAPE = argparse.Namespace(num_q_heads=8, num_kv_heads=2, head_dim=64, page_len=16)
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("holders", [1, 2, 4])
def test_decode_layer_on_real_flashinfer_matches_monolithic_attention(holders):
    """The same layer on CUDA with FlashInfer itself: results, and kernels by torch.profiler
    (the bounds above, plus one split-KV merge per part where FlashInfer splits)."""
    flashinfer = pytest.importorskip("flashinfer")
    case = bench.Case(8, 300, holders, GPU_SHAPE, torch.device("cuda"), torch.bfloat16)
    layer = bench.tokenlake_layer(case, flashinfer)
    out = layer()
    torch.testing.assert_close(out.double(), monolithic(case), atol=2e-2, rtol=2e-2)
    kernels, _ = bench.count_kernels(layer, flashinfer)
    assert kernels <= (10 if holders == 1 else 14) + holders, kernels
    theirs = bench.flashinfer_layer(case, flashinfer)()
    torch.testing.assert_close(out.float(), theirs.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@needs_gpu
def test_state_merge_on_real_flashinfer_matches_torch():
    flashinfer = pytest.importorskip("flashinfer")
    gen = torch.Generator().manual_seed(1)
    rows = np.array([0, 3, 1, 0, 3, 0])
    o = torch.randn((6, 8, 64), generator=gen).cuda()
    lse = torch.randn((6, 8), generator=gen).cuda()
    lse[4] = -math.inf
    planner = FlashInferPlanner(flashinfer, torch.device("cuda"), (8, 2, 64, 16), torch.bfloat16)
    o_fi, lse_fi = StateMerge.build(rows, 4, o.device, planner).run(o, lse)
    o_ref, lse_ref = StateMerge.build(rows, 4, o.device).run(o, lse)
    torch.testing.assert_close(o_fi, o_ref, atol=2e-2, rtol=2e-2)
    assert torch.isneginf(lse_fi[2]).all() and o_fi[2].eq(0).all()
    finite = torch.isfinite(lse_ref)
    torch.testing.assert_close(lse_fi[finite], lse_ref[finite], atol=1e-4, rtol=1e-4)
