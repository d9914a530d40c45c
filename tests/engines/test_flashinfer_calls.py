"""Every FlashInfer call the engines make, checked against the released 0.7.x signatures
(``inspect.signature`` of the installed package): the engine-owned planner is run with a
recording stand-in for the module on CPU, and each recorded call must bind to the real
method. Skipped when flashinfer is not installed (it imports on CPU with ``--no-deps``)."""

from __future__ import annotations

import inspect

import pytest
import torch

from tokenlake.engines.flashinfer_attention import FlashInferPlanner

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


def test_every_flashinfer_call_matches_the_released_signatures():
    assert flashinfer.__version__.startswith("0.7"), flashinfer.__version__
    recorder = _Recorder()
    planner = FlashInferPlanner(recorder, torch.device("cpu"), SHAPE, torch.bfloat16)
    pool_layer = torch.zeros((4, 2, SHAPE[3], SHAPE[1], SHAPE[2]), dtype=torch.bfloat16)
    decode = planner.plan(_i32([0, 1, 2, 3]), _i32([0, 0, 2, 3]), _i32([1, 3, 2]), _i32([1, 5, 16]))
    prefill = planner.plan(_i32([0, 3, 5]), _i32([0, 1, 3]), _i32([0, 2, 1]), _i32([4, 16]))
    empty = planner.plan(_i32([0, 2]), _i32([0, 0]), _i32([]), _i32([1]))
    for part, rows in ((decode, 3), (prefill, 5), (empty, 2)):
        o, lse = part.run(torch.zeros((rows, SHAPE[0], SHAPE[2]), dtype=torch.bfloat16), pool_layer)
        assert o.shape == (rows, SHAPE[0], SHAPE[2]) and lse.dtype == torch.float32
    assert torch.isneginf(empty.run(torch.zeros((2, 8, 64)), pool_layer)[1]).all()
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
