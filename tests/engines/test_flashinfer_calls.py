"""Every FlashInfer call TokenLake makes, checked against the released 0.7.x signatures
(``inspect.signature`` of the installed package): the planner (engine-owned, or the one-shot
``tokenlake.engines.kernels`` backend's) is run with a recording stand-in for the module on CPU, and
each recorded call must bind to the real method. Skipped when flashinfer is not installed (it
imports on CPU with ``--no-deps``)."""

from __future__ import annotations

import inspect
import sys

import pytest
import torch

from tokenlake.engines.kernels import PagedAttentionInputs, flashinfer_backend
from tokenlake.engines.kernels.flashinfer_backend import FlashInferPlanner
from tokenlake.engines.kernels.inputs import PagedCSR

flashinfer = pytest.importorskip("flashinfer")
SHAPE = (8, 2, 64, 16)  # H_q, H_kv, D, page size


class _Wrapper:
    def __init__(self, calls: list, name: str, *args, **kwargs) -> None:
        self.calls, self.name = calls, name
        calls.append((name, "__init__", args, kwargs))

    def plan(self, *args, **kwargs) -> None:
        self.calls.append((self.name, "plan", args, kwargs))

    def run(self, q, paged_kv_cache, *args, **kwargs):
        self.calls.append((self.name, "run", (q, paged_kv_cache, *args), kwargs))
        n, h, d = q.shape
        return torch.zeros((n, h, d)), torch.zeros((n, h))


class _Recorder:
    """Looks like the flashinfer module to the planner; records every call."""

    def __init__(self) -> None:
        self.calls: list = []
        for name in ("BatchDecodeWithPagedKVCacheWrapper", "BatchPrefillWithPagedKVCacheWrapper"):
            setattr(self, name, lambda *a, _n=name, **k: _Wrapper(self.calls, _n, *a, **k))


def _i32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def test_every_flashinfer_call_matches_the_released_signatures(monkeypatch):
    assert flashinfer.__version__.startswith("0.7"), flashinfer.__version__
    recorder = _Recorder()
    planner = FlashInferPlanner(recorder, torch.device("cpu"), SHAPE, torch.bfloat16)
    capped = FlashInferPlanner(recorder, torch.device("cpu"), SHAPE, torch.bfloat16, 0.3, 30.0)
    pool_layer = torch.zeros((4, 2, SHAPE[3], SHAPE[1], SHAPE[2]), dtype=torch.bfloat16)
    decode = planner.plan(
        PagedCSR(_i32([0, 1, 2, 3]), _i32([0, 0, 2, 3]), _i32([1, 3, 2]), _i32([1, 5, 16]))
    )
    prefill = planner.plan(
        PagedCSR(_i32([0, 3, 5]), _i32([0, 1, 3]), _i32([0, 2, 1]), _i32([4, 16]))
    )
    empty = planner.plan(PagedCSR(_i32([0, 2]), _i32([0, 0]), _i32([]), _i32([1])))
    causal = capped.plan(
        PagedCSR(_i32([0, 3, 5]), _i32([0, 1, 3]), _i32([0, 2, 1]), _i32([2, 16])), True
    )
    for part, rows in ((decode, 3), (prefill, 5), (empty, 2), (causal, 5)):
        o, lse = part.run(torch.zeros((rows, SHAPE[0], SHAPE[2]), dtype=torch.bfloat16), pool_layer)
        assert o.shape == (rows, SHAPE[0], SHAPE[2]) and lse.dtype == torch.float32
    assert torch.isneginf(empty.run(torch.zeros((2, 8, 64)), pool_layer)[1]).all()
    # row 0 of the causal plan's first request (3 rows, 2 keys) sees no key: exactly empty
    lse = causal.run(torch.zeros((5, 8, 64), dtype=torch.bfloat16), pool_layer)[1]
    assert torch.isneginf(lse[0]).all() and torch.isfinite(lse[1:]).all()
    # the one-shot backend of tokenlake.engines.kernels plans its own planner, on the same calls
    monkeypatch.setitem(sys.modules, "flashinfer", recorder)
    num_calls = len(recorder.calls)
    args = PagedAttentionInputs(
        torch.zeros((2, 8, 64), dtype=torch.bfloat16), _i32([0, 1, 2]), pool_layer,
        _i32([0, 1, 2]), _i32([3, 0]), _i32([7, 16]), sm_scale=0.2, logit_cap=50,
    )  # fmt: skip
    flashinfer_backend.partial_attention(args)
    one_shot = [c for c in recorder.calls[num_calls:] if c[1] == "plan"]
    assert [c[3]["logits_soft_cap"] for c in one_shot] == [50.0]
    assert [c[3]["sm_scale"] for c in one_shot] == [0.2]
    plans = [kwargs for _, method, _, kwargs in recorder.calls if method == "plan"]
    assert [k["logits_soft_cap"] for k in plans] == [0.0, 0.0, 30.0, 50.0]
    assert [k.get("causal") for k in plans] == [None, False, True, None]
    made = {(name, method) for name, method, _, _ in recorder.calls}
    assert made == {
        (cls, m)
        for cls in ("BatchDecodeWithPagedKVCacheWrapper", "BatchPrefillWithPagedKVCacheWrapper")
        for m in ("__init__", "plan", "run")
    }
    for name, method, args, kwargs in recorder.calls:
        cls = getattr(flashinfer, name)
        sig = inspect.signature(getattr(cls, method))
        if any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
            # 0.7's plan() forwards **kwargs to _plan_impl: check against the real one
            sig = inspect.signature(getattr(cls, f"_{method}_impl", getattr(cls, method)))
        try:
            sig.bind(object(), *args, **kwargs)
        except TypeError as e:
            pytest.fail(f"{name}.{method}{tuple(kwargs)}: {e}")
