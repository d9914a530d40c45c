"""The plugin through SGLang's own machinery: the installed entry point, ``load_plugins()``,
the command line parsed by ``prepare_server_args``, the registered factory; and the features
the backend refuses at construction."""

from __future__ import annotations

import json
import sys
from importlib.metadata import entry_points
from types import SimpleNamespace

import pytest

sgl_world = pytest.importorskip("sgl_world", reason="sglang is not installed")

import torch  # noqa: E402
from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES  # noqa: E402
from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS  # noqa: E402
from sglang.srt.mem_cache.registry import get_radix_cache_factory  # noqa: E402
from sglang.srt.plugins import load_plugins  # noqa: E402
from sglang.srt.server_args import prepare_server_args  # noqa: E402
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402

from tokenlake.engines.sglang import plugin  # noqa: E402
from tokenlake.engines.sglang.backend import TokenLakeAttnBackend  # noqa: E402
from tokenlake.engines.sglang.config import SGLangPoolConfig  # noqa: E402
from tokenlake.engines.sglang.model_check import UnsupportedFeatureError  # noqa: E402
from tokenlake.errors import InvalidArgumentError  # noqa: E402


@pytest.fixture(scope="module")
def loaded():
    (ep,) = [e for e in entry_points(group="sglang.srt.plugins") if e.name == "tokenlake"]
    assert ep.value == "tokenlake.engines.sglang.plugin:register"
    load_plugins()
    return ep


def test_load_plugins_registers_backend_and_choice(loaded) -> None:
    assert ATTENTION_BACKENDS["tokenlake"] is plugin.create_backend
    assert ATTENTION_BACKEND_CHOICES.count("tokenlake") == 1
    plugin.register()  # idempotent
    assert ATTENTION_BACKEND_CHOICES.count("tokenlake") == 1


def test_command_line_selects_backend_and_exports_config(loaded, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TOKENLAKE_CONFIG", "")  # restored (unset) after the test
    path = tmp_path / "pool.json"
    path.write_text(json.dumps({"num_instances": 3, "num_slots": 700, "segment_len": 8}))
    args = prepare_server_args(
        ["--model-path", str(tmp_path / "model"), "--attention-backend", "tokenlake"]
        + ["--tokenlake-config", str(path)]
    )
    assert args.attention_backend == "tokenlake"
    assert args.disable_decode_cuda_graph and args.disable_prefill_cuda_graph
    assert args.radix_cache_backend == "tokenlake"  # the pool-consulting prefix matcher
    # what a scheduler subprocess then builds through the registered factory
    backend = ATTENTION_BACKENDS["tokenlake"](sgl_world.make_runner(kv_size=4000))
    assert isinstance(backend, TokenLakeAttnBackend)
    cfg = backend.runtime.pool.config
    assert (cfg.num_instances, cfg.num_slots, cfg.segment_len) == (3, 700, 8)
    assert cfg.namespace == "tiny-test-model"
    other = prepare_server_args(["--model-path", str(tmp_path / "model")])
    assert not other.disable_decode_cuda_graph  # other backends keep their graphs
    assert other.radix_cache_backend is None
    kept = prepare_server_args(
        ["--model-path", str(tmp_path / "model"), "--attention-backend", "tokenlake"]
        + ["--disable-radix-cache"]
    )
    assert kept.radix_cache_backend is None


def test_radix_cache_factory_needs_the_tokenlake_backend(loaded) -> None:
    assert get_radix_cache_factory("tokenlake") is plugin.create_radix_cache
    runner = SimpleNamespace(attn_backend=object())
    ctx = SimpleNamespace(tp_worker=SimpleNamespace(model_runner=runner))
    with pytest.raises(UnsupportedFeatureError, match="needs --attention-backend tokenlake"):
        plugin.create_radix_cache(ctx)


def test_bad_config_fails_at_launch(loaded, tmp_path) -> None:
    path = tmp_path / "pool.json"
    path.write_text(json.dumps({"num_slot": 7}))
    with pytest.raises(InvalidArgumentError, match=r"unknown keys \['num_slot'\]"):
        prepare_server_args(
            ["--model-path", str(tmp_path), "--attention-backend", "tokenlake"]
            + ["--tokenlake-config", str(path)]
        )
    path.write_text(json.dumps({"segment_len": True}))
    with pytest.raises(InvalidArgumentError, match="segment_len: expected a positive int"):
        prepare_server_args(["--model-path", str(tmp_path), "--tokenlake-config", str(path)])


@pytest.mark.parametrize(
    "runner_kwargs,runner_attrs,feature",
    [
        ({"logit_cap": 30.0, "logit_capping_method": "sigmoid"}, {}, "logit capping method"),
        ({"logit_cap": 1e9}, {}, "this logit soft cap"),
        ({"sliding_window_size": 128}, {}, "sliding-window attention"),
        ({"is_cross_attention": True}, {}, "cross-attention"),
        ({"v_head_dim": 8}, {}, "different K and V head dims"),
        ({}, {"use_mla_backend": True}, "MLA"),
        ({}, {"spec_algorithm": SpeculativeAlgorithm.EAGLE}, "speculative decoding"),
        ({}, {"is_hybrid_swa": True}, "sliding-window attention"),
        ({}, {"sliding_window_size": 4096}, "sliding-window attention"),
    ],
)
def test_unsupported_features_are_refused_by_name(runner_kwargs, runner_attrs, feature) -> None:
    runner = sgl_world.make_runner(**runner_kwargs)
    for name, value in runner_attrs.items():
        setattr(runner, name, value)
    with pytest.raises(UnsupportedFeatureError, match=feature):
        TokenLakeAttnBackend(runner, SGLangPoolConfig())


def test_soft_capped_layers_are_accepted_with_one_cap() -> None:
    backend = TokenLakeAttnBackend(sgl_world.make_runner(logit_cap=30.0), SGLangPoolConfig())
    assert backend.shape.logit_cap == 30.0 and backend.runtime.cluster.logit_cap == 30.0
    for no_cap in (0.0, -1.0, None):  # SGLang caps only when logit_cap > 0
        backend = TokenLakeAttnBackend(sgl_world.make_runner(logit_cap=no_cap), SGLangPoolConfig())
        assert backend.shape.logit_cap == 0.0
    runner = sgl_world.make_runner(logit_cap=30.0)
    runner.model[1].logit_cap = 50.0
    with pytest.raises(UnsupportedFeatureError, match=r"layers of different logit caps"):
        TokenLakeAttnBackend(runner, SGLangPoolConfig())


def test_other_refusals() -> None:
    runner = sgl_world.make_runner()
    runner.model_config.is_encoder_decoder = True
    with pytest.raises(UnsupportedFeatureError, match="cross-attention"):
        TokenLakeAttnBackend(runner, SGLangPoolConfig())
    small = SGLangPoolConfig(num_instances=2, num_slots=4, segment_len=8)  # < SGLang's cache
    assert TokenLakeAttnBackend(sgl_world.make_runner(kv_size=2048), small).runtime.max_rows
    backend = TokenLakeAttnBackend(sgl_world.make_runner(), SGLangPoolConfig())
    with pytest.raises(UnsupportedFeatureError, match="CUDA-graph capture"):
        backend.init_cuda_graph_state(8, 64)
    fp8 = sgl_world.make_runner()
    fp8.token_to_kv_pool.dtype = torch.float8_e4m3fn
    with pytest.raises(UnsupportedFeatureError, match="float8_e4m3fn KV cache"):
        TokenLakeAttnBackend(fp8, SGLangPoolConfig())


def test_a_plugin_that_cannot_import_names_the_missing_module(monkeypatch, caplog) -> None:
    """SGLang swallows a plugin's error (the user saw only ``invalid choice: 'tokenlake'``):
    the plugin logs and raises naming what failed to import (here, as when torchvision is
    missing, SGLang's attention registry)."""
    missing = "sglang.srt.layers.attention.attention_registry"
    monkeypatch.setitem(sys.modules, missing, None)  # importing it now fails
    with pytest.raises(ImportError, match=f"cannot import {missing!r}"):
        plugin.register()
    assert f"tokenlake SGLang plugin not loaded: cannot import {missing!r}" in caplog.text
