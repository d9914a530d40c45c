"""What a GPU user of the SGLang backend hits first, checked here on CPU (not run on a GPU):
FlashInfer decode on tensor cores where SGLang's own FlashInfer backend uses them (GQA
groups of 4 and more: Qwen2.5-0.5B's 7, and 5), float16 KV caches accepted on CUDA, and a
16-bit session exact to its rounding."""

from __future__ import annotations

import inspect

import pytest
import torch

sgl_world = pytest.importorskip("sgl_world", reason="sglang is not installed")
flashinfer = pytest.importorskip("flashinfer")

from sglang.srt.layers.attention.flashinfer_backend import should_use_tensor_core  # noqa: E402

from tokenlake.engines.kernels.flashinfer_backend import FlashInferPlanner  # noqa: E402
from tokenlake.engines.kernels.inputs import PagedCSR  # noqa: E402
from tokenlake.engines.sglang.config import SGLangPoolConfig  # noqa: E402
from tokenlake.engines.sglang.model_check import UnsupportedFeatureError, check_model  # noqa: E402
from tokenlake.engines.sglang.pool_runtime import pool_config_for  # noqa: E402


class _Recorder:
    """Looks like the flashinfer module to the planner; records each wrapper's constructor."""

    def __init__(self) -> None:
        self.made: list[tuple[str, tuple, dict]] = []
        for name in ("BatchDecodeWithPagedKVCacheWrapper", "BatchPrefillWithPagedKVCacheWrapper"):
            setattr(self, name, lambda *a, _n=name, **k: self._make(_n, a, k))

    def _make(self, name: str, args: tuple, kwargs: dict):
        self.made.append((name, args, kwargs))
        return type("Wrapper", (), {"plan": lambda *a, **k: None})()


@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(14, 2), (10, 2), (7, 1), (8, 2), (4, 2),
                                                      (8, 8), (28, 4), (32, 8)])  # fmt: skip
def test_decode_uses_tensor_cores_where_sglang_does(num_q_heads: int, num_kv_heads: int) -> None:
    recorder = _Recorder()
    shape = (num_q_heads, num_kv_heads, 64, 16)
    for dtype in (torch.bfloat16, torch.float16):
        planner = FlashInferPlanner(recorder, torch.device("cpu"), shape, dtype)
        i32 = dict(dtype=torch.int32)
        planner.plan(PagedCSR(torch.tensor([0, 1, 2], **i32), torch.tensor([0, 1, 3], **i32),
                              torch.tensor([0, 1, 2], **i32), torch.tensor([5, 16], **i32)))  # fmt: skip
        (name, args, kwargs), *_ = recorder.made[-1:]
        assert name == "BatchDecodeWithPagedKVCacheWrapper"
        assert kwargs["use_tensor_cores"] == should_use_tensor_core(
            dtype, num_q_heads, num_kv_heads
        )
        real = inspect.signature(flashinfer.BatchDecodeWithPagedKVCacheWrapper.__init__)
        real.bind(object(), *args, **kwargs)  # the released 0.7 signature takes it


def test_float16_kv_cache_is_accepted_on_cuda_and_refused_by_name_on_cpu() -> None:
    runner = sgl_world.make_runner(dtype=torch.float16)
    layers = list(runner.model)
    shape = check_model(runner, layers)
    assert shape.dtype == "float16"
    cfg = pool_config_for(SGLangPoolConfig(), shape, "m", torch.device("cuda"))
    assert cfg.device == "cuda" and cfg.model.dtype == "float16"
    with pytest.raises(UnsupportedFeatureError, match=r"float16 KV cache on cpu"):
        pool_config_for(SGLangPoolConfig(), shape, "m", "cpu")
    bf16 = check_model(sgl_world.make_runner(dtype=torch.bfloat16), layers)
    assert pool_config_for(SGLangPoolConfig(), bf16, "m", "cpu").model.dtype == "bfloat16"


def test_bfloat16_session_is_exact_to_its_rounding() -> None:
    """The 16-bit path (q, K/V and the pool in bfloat16) against float64 attention over the
    same bfloat16 inputs: within one bfloat16 step (2**-8 relative) of outputs below 2."""
    from test_sglang_exactness import serving_session

    config = SGLangPoolConfig(num_instances=2, num_slots=256, segment_len=8)
    w = sgl_world.World(config, reference="plain", dtype=torch.bfloat16)
    tol = 2 * 2**-8
    serving_session(w, tol)
    assert w.max_err <= tol


def test_float16_passes_the_kernels_checks_on_cuda_only() -> None:
    """A float16 forward meets the merge's and the kernels' dtype checks first: they take it
    on CUDA (FlashInfer's paths do; not run on a GPU here) and refuse it by name on the CPU."""
    import numpy as np

    from tokenlake.engines.client.prefix_attention import PrefixAttention
    from tokenlake.engines.kernels.inputs import check_dtype_on
    from tokenlake.errors import InvalidArgumentError

    check_dtype_on("q", torch.float16, torch.device("cuda"))
    check_dtype_on("q", torch.bfloat16, torch.device("cpu"))
    with pytest.raises(InvalidArgumentError, match=r"q: .*float16 runs on CUDA"):
        check_dtype_on("q", torch.float16, torch.device("cpu"))
    offsets = np.array([0, 3], dtype=np.int64)
    with pytest.raises(InvalidArgumentError, match=r"float16 runs on CUDA"):
        PrefixAttention.bind(offsets, (3, 4, 16), 2, torch.float16, device="cpu")
    with pytest.raises(InvalidArgumentError, match=r"expected dtype float32, bfloat16 or float16"):
        PrefixAttention.bind(offsets, (3, 4, 16), 2, torch.float64, device="cpu")
