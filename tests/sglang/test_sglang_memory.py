"""The memory of the docs/sglang.md example on one 80 GB GPU, computed by SGLang's own sizing
rules (pinned against SGLang's source here) and SGLang's own KV buffer sizes, beside what
TokenLake allocates: the example as written leaves SGLang's activation headroom free. Not run
on a GPU; the per-token and staging sizes are checked against real allocations on CPU."""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import pytest
import torch

sgl_world = pytest.importorskip("sgl_world", reason="sglang is not installed")

from sglang.srt.arg_groups import memory_hook  # noqa: E402
from sglang.srt.mem_cache import kv_cache_configurator  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402

from tokenlake.config import ModelShape  # noqa: E402
from tokenlake.engines.sglang import sizing  # noqa: E402
from tokenlake.engines.sglang.backend import TokenLakeAttnBackend  # noqa: E402
from tokenlake.engines.sglang.config import SGLangPoolConfig  # noqa: E402

DOC = Path(__file__).resolve().parents[2] / "docs" / "sglang.md"
GPU_BYTES = 80 * 10**9  # "80 GB", the smallest reading of it
# Qwen/Qwen2.5-0.5B-Instruct's config.json: 24 layers, 14 query heads, 2 KV heads of 64,
# hidden 896, MLP 4864, vocabulary 151936, tied embeddings, bfloat16
QWEN = ModelShape(24, 14, 2, 64, "bfloat16")
HIDDEN, MLP, VOCAB = 896, 4864, 151936
QWEN_PARAMS = VOCAB * HIDDEN + HIDDEN + 24 * (
    2 * HIDDEN * HIDDEN + HIDDEN  # q (with bias) and o
    + 2 * (HIDDEN * 128 + 128)  # k and v (with bias)
    + 3 * HIDDEN * MLP + 2 * HIDDEN  # MLP, two norms
)  # fmt: skip
CHUNKED_PREFILL = 8192  # SGLang's default on a GPU of 60-90 GiB (H100, A100 80 GB)


def test_sglang_rules_are_the_ones_pinned_here() -> None:
    hook = inspect.getsource(memory_hook)
    for text in ("reserved_mem = 512", "activation_tokens * 1.5",
                 "cfg.tp_size * cfg.pp_size / 8 * 1024", "gpu_mem > 60 * 1024",
                 "reserved_mem = max(reserved_mem, 10 * 1024)",
                 "round((gpu_mem - reserved_mem) / gpu_mem, 3)"):  # fmt: skip
        assert text in hook, text
    h100 = hook[hook.index("elif gpu_mem < 90 * 1024") : hook.index("elif gpu_mem < 160 * 1024")]
    assert "chunked_prefill_size=8192" in h100
    configurator = inspect.getsource(kv_cache_configurator)
    assert "pre_model_load_memory * (1 - get_schedule().mem_fraction_static)" in configurator
    assert QWEN_PARAMS == 494_032_768  # the model card's 0.49B


def test_kv_bytes_per_token_are_sglangs() -> None:
    """SGLang's own buffers (``get_kv_size_bytes``) hold ``kv_bytes_per_token`` per token."""
    kv = MHATokenToKVPool(63, 1, torch.bfloat16, 2, 64, 24, "cpu", False)
    k_bytes, v_bytes = kv.get_kv_size_bytes()
    assert (k_bytes + v_bytes) == 64 * QWEN.kv_bytes_per_token == 64 * 12288  # 63 + padding


def test_tokenlake_bytes_are_the_backends_allocation() -> None:
    config = SGLangPoolConfig(num_instances=3, num_slots=16, segment_len=8, max_forward_rows=96)
    backend = TokenLakeAttnBackend(sgl_world.make_runner(), config)
    views = backend.runtime.cluster._driver.views
    allocated = sum(
        t.untyped_storage().nbytes() for v in views.values()
        for t in (v.pool.data, v.q, v.kv, v.out_o, v.out_lse)
    )  # fmt: skip
    assert allocated == sizing.tokenlake_bytes(config, backend.shape, 3)


def _doc_example() -> tuple[SGLangPoolConfig, float]:
    text = DOC.read_text()
    (raw,) = re.findall(r"echo '(\{[^']*\})' > tokenlake\.json", text)
    (fraction,) = re.findall(
        r"--tokenlake-config tokenlake\.json --mem-fraction-static (0\.\d+)", text
    )
    assert "Qwen/Qwen2.5-0.5B-Instruct" in text
    return SGLangPoolConfig(**json.loads(raw)), float(fraction)


def test_the_docs_example_fits_one_80_gb_gpu() -> None:
    config, fraction = _doc_example()
    weights = QWEN_PARAMS * 2
    alone = sizing.worker_memory(
        GPU_BYTES, weights, QWEN, sizing.sglang_default_mem_fraction(GPU_BYTES, CHUNKED_PREFILL),
        None, 0, CHUNKED_PREFILL,
    )  # fmt: skip
    both = sizing.worker_memory(GPU_BYTES, weights, QWEN, fraction, config,
                                config.num_instances, CHUNKED_PREFILL)  # fmt: skip
    assert alone.free_bytes > -GPU_BYTES / 1000  # SGLang rounds its fraction to 3 decimals
    assert both.free_bytes >= 0  # TokenLake fits beside SGLang's activation headroom
    assert fraction <= sizing.max_mem_fraction_static(
        GPU_BYTES, config, QWEN, config.num_instances, CHUNKED_PREFILL
    )
    # the figures docs/sglang.md states
    assert 5.2e6 < alone.sglang_kv_tokens < 5.5e6  # SGLang alone: about 5.3M tokens
    assert 3.7e6 < both.sglang_kv_tokens < 3.9e6  # beside TokenLake: about 3.8M
    assert config.num_instances * config.num_slots * config.segment_len == 1 << 20
    assert 14.5e9 < both.tokenlake_bytes < 15.0e9  # 12.9 GB of slots, 1.9 GB of staging


def test_one_copy_worker_memory_is_sglangs_own() -> None:
    """One copy (a worker of a shared pool, ``engine_slots``): the KV bytes are SGLang's own
    cache for the same token capacity (within 1.05x), plus only the staging buffers; the
    fraction docs/sglang.md gives for it leaves SGLang's activation headroom free."""
    config, _ = _doc_example()
    text = DOC.read_text()
    (fraction,) = re.findall(r"one copy[^\n]*--mem-fraction-static (0\.\d+)", text)
    weights = QWEN_PARAMS * 2
    one = sizing.one_copy_memory(GPU_BYTES, weights, QWEN, float(fraction), config,
                                 CHUNKED_PREFILL)  # fmt: skip
    alone_same_tokens = one.sglang_kv_tokens * QWEN.kv_bytes_per_token
    assert one.sglang_kv_bytes <= 1.05 * alone_same_tokens
    assert one.free_bytes >= 0
    # real SGLang buffers over the slots hold exactly these bytes (small shape, same rule)
    from tokenlake.engines.sglang.one_copy import SlotKVPool

    data = torch.zeros((24, 9, 2, 8, 2, 64), dtype=torch.bfloat16)
    kv = SlotKVPool(data, device="cpu", enable_memory_saver=False)
    assert kv.shares_storage_with(data)
    alone = MHATokenToKVPool(8 * 8, 8, torch.bfloat16, 2, 64, 24, "cpu", False)
    assert data.nbytes == sum(alone.get_kv_size_bytes())  # 8 pages + padding, both
    # the figures docs/sglang.md states
    assert 5.2e6 < one.sglang_kv_tokens < 5.4e6
    assert 0.3e9 < one.tokenlake_bytes < 0.6e9
