"""The adapter's contract with SGLang, read from the installed SGLang source with ``ast``
(nothing imported): the hooks it overrides or registers, and the attributes of SGLang's
``ModelRunner`` that the tests fake (a real one needs a checkpoint, a process group and a
GPU)."""

from __future__ import annotations

import ast
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

import pytest

try:
    SGLANG = Path(str(distribution("sglang").locate_file("sglang")))
except PackageNotFoundError:
    pytest.skip("sglang is not installed", allow_module_level=True)

ADAPTER = Path(__file__).resolve().parents[2] / "engines" / "sglang"
# what TokenLakeAttnBackend and check_model read from SGLang's ModelRunner and ModelConfig
RUNNER_ATTRIBUTES = {
    "device",
    "model",
    "model_config",
    "req_to_token_pool",
    "token_to_kv_pool",
    "use_mla_backend",
    "spec_algorithm",
    "is_hybrid_swa",
    "sliding_window_size",
}
MODEL_CONFIG_ATTRIBUTES = {"is_encoder_decoder", "model_path"}


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _class(module: ast.Module, name: str) -> ast.ClassDef:
    for node in ast.walk(module):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise AssertionError(f"class {name} not found")


def _methods(cls: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}


def _params(fn: ast.FunctionDef) -> tuple[list[str], bool]:
    """Positional parameter names and whether it takes ``**kwargs``."""
    return [a.arg for a in fn.args.posonlyargs + fn.args.args], fn.args.kwarg is not None


def _names_assigned(module: ast.Module) -> set[str]:
    out = set()
    for node in ast.walk(module):
        if isinstance(node, ast.Assign):
            out |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.add(node.target.id)
        elif isinstance(node, ast.FunctionDef):
            out.add(node.name)
    return out


def _self_attributes(paths) -> set[str]:
    out = set()
    for path in paths:
        for node in ast.walk(_tree(path)):
            targets = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, ast.AnnAssign):
                targets = [node.target]
            for t in targets:
                is_self = isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                if is_self and t.value.id == "self":
                    out.add(t.attr)
            if isinstance(node, ast.FunctionDef) and any(
                isinstance(d, ast.Name) and d.id == "property" for d in node.decorator_list
            ):
                out.add(node.name)
    return out


def test_backend_overrides_match_attention_backend() -> None:
    base = _methods(
        _class(_tree(SGLANG / "srt/layers/attention/base_attn_backend.py"), "AttentionBackend")
    )
    ours = _methods(_class(_tree(ADAPTER / "backend.py"), "TokenLakeAttnBackend"))
    assert {n for n in ours if not n.startswith("_")} - set(base) == {"load_prefix", "release_row"}
    overridden = {n for n in ours if n in base}
    assert overridden == {
        "init_forward_metadata",
        "forward_extend",
        "forward_decode",
        "forward_mixed",
        "init_cuda_graph_state",
        "support_triton",
    }
    for name in overridden:
        assert name in base, f"AttentionBackend has no {name}"
        assert _params(ours[name]) == _params(base[name]), name
    # SGLang's own dispatch calls these with keyword save_kv_cache
    assert "save_kv_cache" in _params(base["forward"])[0]


def test_registration_hooks_exist() -> None:
    registry = _tree(SGLANG / "srt/layers/attention/attention_registry.py")
    assert {"ATTENTION_BACKENDS", "register_attention_backend"} <= _names_assigned(registry)
    fn = next(
        n
        for n in ast.walk(registry)
        if isinstance(n, ast.FunctionDef) and n.name == "register_attention_backend"
    )
    assert _params(fn) == (["name"], False)
    choices = _tree(SGLANG / "srt/arg_groups/choices.py")
    assert {"ATTENTION_BACKEND_CHOICES", "add_attention_backend_choices"} <= _names_assigned(
        choices
    )
    hooks = _tree(SGLANG / "srt/plugins/hook_registry.py")
    register = _methods(_class(hooks, "HookRegistry"))["register"]
    assert _params(register)[0][:4] == ["cls", "target", "hook", "hook_type"]
    assert "AFTER" in _names_assigned(_class(hooks, "HookType"))
    plugins = (SGLANG / "srt/plugins/__init__.py").read_text()
    assert 'GENERAL_PLUGINS_GROUP = "sglang.srt.plugins"' in plugins


def test_radix_cache_hooks_match() -> None:
    registry = _tree(SGLANG / "srt/mem_cache/registry.py")
    funcs = {n.name: n for n in registry.body if isinstance(n, ast.FunctionDef)}
    assert _params(funcs["register_radix_cache_backend"])[0] == ["name", "factory"]
    assert _params(funcs["get_radix_cache_factory"])[0] == ["name"]
    create = funcs["create_unified_radix_cache"]
    assert _params(create)[0] == ["ctx"] and "cache_class" in [
        a.arg for a in create.args.kwonlyargs
    ]
    assert "tp_worker" in _names_assigned(_class(registry, "TreeCacheBuildContext"))
    unified = _methods(
        _class(_tree(SGLANG / "srt/mem_cache/unified_radix_cache.py"), "UnifiedRadixCache")
    )
    ours = _methods(_class(_tree(ADAPTER / "radix_cache.py"), "TokenLakeRadixCache"))
    assert _params(ours["match_prefix"]) == _params(unified["match_prefix"])
    base = _tree(SGLANG / "srt/mem_cache/base_prefix_cache.py")
    assert "prev_prefix_len" in _names_assigned(_class(base, "InsertParams"))
    assert "device_prefix_len" in _names_assigned(_class(base, "MatchResult"))
    prefix_cache = _methods(_class(base, "BasePrefixCache"))
    assert {"lock", "unlock", "evict", "path_device_indices"} <= set(prefix_cache)
    memory = _names_assigned(_tree(SGLANG / "srt/arg_groups/fields/memory.py"))
    assert {"radix_cache_backend", "disable_radix_cache"} <= memory


def test_server_args_hooks_match() -> None:
    server_args = _methods(_class(_tree(SGLANG / "srt/server_args.py"), "ServerArgs"))
    add, parse = server_args["add_cli_args"], server_args["from_cli_args"]
    assert [d.id for d in add.decorator_list] == ["staticmethod"]
    assert [d.id for d in parse.decorator_list] == ["classmethod"]
    assert _params(add)[0] == ["parser"]
    assert _params(parse)[0] == ["cls", "args"]
    plugin = {
        n.name: n for n in _tree(ADAPTER / "plugin.py").body if isinstance(n, ast.FunctionDef)
    }
    # AFTER hooks receive (result, *original_args)
    assert _params(plugin["add_cli_args"])[0] == ["result", "parser"]
    assert _params(plugin["apply_cli_args"])[0] == ["server_args", "cls", "args"]
    fields = _names_assigned(_tree(SGLANG / "srt/arg_groups/fields/exec_.py"))
    assert {"attention_backend", "prefill_attention_backend", "decode_attention_backend"} <= fields
    assert {"disable_decode_cuda_graph", "disable_prefill_cuda_graph"} <= fields


def test_faked_model_runner_attributes_exist_in_sglang() -> None:
    runner_files = sorted((SGLANG / "srt/model_executor").glob("model_runner*.py"))
    assert runner_files
    assert _self_attributes(runner_files) >= RUNNER_ATTRIBUTES
    config = _self_attributes([SGLANG / "srt/configs/model_config.py"])
    assert config >= MODEL_CONFIG_ATTRIBUTES
    spec = _methods(_class(_tree(SGLANG / "srt/speculative/spec_info.py"), "SpeculativeAlgorithm"))
    assert "is_none" in spec


def test_fake_runner_has_exactly_the_checked_attributes() -> None:
    sgl_world = pytest.importorskip("sgl_world", reason="sglang does not import here")
    runner = sgl_world.make_runner()
    assert set(vars(runner)) == RUNNER_ATTRIBUTES
    assert set(vars(runner.model_config)) == MODEL_CONFIG_ATTRIBUTES
