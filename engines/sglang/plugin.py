"""SGLang plugin entry point (group ``sglang.srt.plugins``, name ``tokenlake``).

SGLang's ``load_plugins()`` runs :func:`register` early in every SGLang process (the launcher
before it parses the command line, and each scheduler subprocess). It

* registers the attention backend ``tokenlake`` (a factory; the backend module is imported
  only when the backend is built) and adds it to ``--attention-backend``'s choices;
* adds ``--tokenlake-config FILE`` to SGLang's command line and exports it as
  ``TOKENLAKE_CONFIG`` for the subprocesses;
* registers the radix cache ``tokenlake`` (:mod:`.radix_cache`: SGLang's prefix matcher
  consulting the pool);
* when ``tokenlake`` is the attention backend, turns SGLang's CUDA graphs off (every batch is
  planned on the host, which a captured graph cannot replay) and selects that radix cache
  unless ``--radix-cache-backend`` or ``--disable-radix-cache`` says otherwise.
"""

from __future__ import annotations

import argparse
import logging
import os

from .config import ENV_VAR, load_config

BACKEND_NAME = "tokenlake"
_SERVER_ARGS = "sglang.srt.server_args.ServerArgs"
_BACKEND_FLAGS = ("attention_backend", "prefill_attention_backend", "decode_attention_backend")

logger = logging.getLogger(__name__)


def create_backend(model_runner):
    """The registered factory: ``fn(model_runner) -> AttentionBackend``."""
    from .backend import TokenLakeAttnBackend

    return TokenLakeAttnBackend(model_runner)


def create_radix_cache(ctx):
    """The registered radix-cache factory: ``fn(TreeCacheBuildContext) -> BasePrefixCache``."""
    from .radix_cache import create_radix_cache as create

    return create(ctx)


def add_cli_args(result, parser: argparse.ArgumentParser, *args, **kwargs) -> None:
    """AFTER hook of ``ServerArgs.add_cli_args``."""
    parser.add_argument(
        "--tokenlake-config",
        type=str,
        default=None,
        metavar="FILE",
        help="JSON file of TokenLake pool settings for --attention-backend tokenlake "
        f"(exported to SGLang's subprocesses as {ENV_VAR}).",
    )


def apply_cli_args(server_args, cls, args: argparse.Namespace, *rest, **kwargs):
    """AFTER hook of ``ServerArgs.from_cli_args``: export the config path; with the tokenlake
    attention backend, disable CUDA graphs and select the pool-consulting radix cache."""
    path = getattr(args, "tokenlake_config", None)
    if path:
        load_config(path)  # a bad file fails at launch, not in a subprocess
        os.environ[ENV_VAR] = os.path.abspath(path)
    if any(getattr(server_args, f, None) == BACKEND_NAME for f in _BACKEND_FLAGS):
        if not (server_args.disable_decode_cuda_graph and server_args.disable_prefill_cuda_graph):
            logger.info("tokenlake attention backend: CUDA graphs disabled (host-side planning)")
        server_args.disable_decode_cuda_graph = True
        server_args.disable_prefill_cuda_graph = True
        if server_args.radix_cache_backend is None and not server_args.disable_radix_cache:
            server_args.radix_cache_backend = BACKEND_NAME
    return server_args


def register() -> None:
    """Entry point of the ``tokenlake`` SGLang plugin (idempotent).

    SGLang catches a plugin's exception and goes on; the user would see only ``invalid
    choice: 'tokenlake'``. A module that fails to import is named in a log line and in the
    error raised."""
    try:
        _register()
    except ImportError as e:
        missing = e.name or str(e)
        message = (
            f"tokenlake SGLang plugin not loaded: cannot import {missing!r} ({e}). "
            "SGLang's attention registry needs it; see docs/sglang.md (on a CPU machine "
            "without torchvision: the CPU-test support in tests/sglang/cpu_support)"
        )
        logger.error(message)
        raise ImportError(message, name=e.name) from e


def _register() -> None:
    from sglang.srt.arg_groups.choices import (
        ATTENTION_BACKEND_CHOICES,
        add_attention_backend_choices,
    )
    from sglang.srt.layers.attention.attention_registry import (
        ATTENTION_BACKENDS,
        register_attention_backend,
    )
    from sglang.srt.mem_cache.registry import (
        get_radix_cache_factory,
        register_radix_cache_backend,
    )
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if ATTENTION_BACKENDS.get(BACKEND_NAME) is create_backend:
        return
    register_attention_backend(BACKEND_NAME)(create_backend)
    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND_NAME])
    if get_radix_cache_factory(BACKEND_NAME) is None:
        register_radix_cache_backend(BACKEND_NAME, create_radix_cache)
    HookRegistry.register(f"{_SERVER_ARGS}.add_cli_args", add_cli_args, HookType.AFTER)
    HookRegistry.register(f"{_SERVER_ARGS}.from_cli_args", apply_cli_args, HookType.AFTER)
