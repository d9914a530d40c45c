"""SGLang's prefix matcher, consulting the pool (``--radix-cache-backend tokenlake``, set by
the plugin whenever the attention backend is ``tokenlake``).

SGLang's scheduler decides how much of a request to recompute from its own radix tree. This
subclass of SGLang's ``UnifiedRadixCache`` also asks the pool: when the pool holds a longer
prefix than SGLang's tree (SGLang evicted it, the pool did not), the extra tokens' K/V are
copied from the pool's segments into newly allocated SGLang KV slots and inserted into the
tree, and the match is repeated, so SGLang reuses them instead of recomputing them.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchResult
from sglang.srt.mem_cache.registry import create_unified_radix_cache
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

from tokenlake.errors import InvalidArgumentError, IterationStateError

from .model_check import UnsupportedFeatureError

logger = logging.getLogger(__name__)


class TokenLakeRadixCache(UnifiedRadixCache):
    """``UnifiedRadixCache`` whose ``match_prefix`` loads the pool's longer prefixes back.

    ``attach(backend)`` binds the ``TokenLakeAttnBackend`` of the same SGLang process; until
    then it behaves exactly like its parent.
    """

    backend = None
    num_loaded_tokens = 0
    num_load_races = 0  # loads given up: the pool changed between the match and the read

    def attach(self, backend) -> None:
        self.backend = backend

    def on_release(self, req, *, checkpointed: bool) -> None:
        """SGLang released a request's row (finished, aborted or retracted): its pool request
        ends now, not at the next forward, so an idle server pins nothing in the pool."""
        super().on_release(req, checkpointed=checkpointed)
        if self.backend is not None:
            self.backend.release_row(int(req.kv.req_pool_idx))

    def match_prefix(self, params) -> MatchResult:
        result = super().match_prefix(params)
        active = self.backend is not None and not self.disable
        if active and self._load_from_pool(params.key, result):
            result = super().match_prefix(params)
        return result

    def _load_from_pool(self, key, result: MatchResult) -> bool:
        """Insert what the pool holds beyond SGLang's match; ``True`` if anything was."""
        if key.is_bigram or key.extra_key is not None or key.cache_salt is not None:
            return False  # the pool keys segments by token ids alone (see create_radix_cache)
        # only the key's first len(key) tokens may match: SGLang caps a request's match
        # below its length (``RadixKey.limit``, at most input_len - 1) without slicing
        # ``token_ids``; every token loaded past the cap is one slot the tree never takes
        token_ids = np.frombuffer(key.raw_token_ids(), dtype=np.int64).astype(np.int32)
        have = result.device_prefix_len
        runtime = self.backend.runtime
        if runtime.inflight is not None:
            return False
        pool_len = runtime.match_len(token_ids) // self.page_size * self.page_size
        num_new = pool_len - have
        if num_new <= 0:
            return False
        lock = self.lock(result.last_device_node)  # keep SGLang's match through an eviction
        try:
            allocator = self.token_to_kv_pool_allocator
            slots = allocator.alloc(num_new)
            if slots is None:
                self.evict(EvictParams(num_tokens=num_new))
                slots = allocator.alloc(num_new)
                if slots is None:
                    return False
            prefix = self.path_device_indices(result.last_device_node)[:have]
            try:
                self.backend.load_prefix(token_ids, have, pool_len, slots)
            except (InvalidArgumentError, IterationStateError):
                # another worker's forward evicted or replaced part of it since the match:
                # SGLang computes what its own tree lacks, as without the pool
                allocator.free(slots)
                self.num_load_races += 1
                return False
            # prev_prefix_len: the first ``have`` values are the tree's own, not duplicates;
            # the tree frees any of ``slots`` it already holds (a value per key token)
            value = torch.cat([prefix.to(torch.int64), slots.to(prefix.device, torch.int64)])
            self.insert(InsertParams(key=key[:pool_len], value=value, prev_prefix_len=have))
        finally:
            self.unlock(lock)
        self.num_loaded_tokens += num_new
        return True


def create_radix_cache(ctx):
    """The ``register_radix_cache_backend`` factory: SGLang's own unified cache construction
    with this class, bound to the process's TokenLake attention backend."""
    from .backend import TokenLakeAttnBackend

    backend = ctx.tp_worker.model_runner.attn_backend
    if not isinstance(backend, TokenLakeAttnBackend):
        raise UnsupportedFeatureError(
            "--radix-cache-backend tokenlake needs --attention-backend tokenlake "
            f"(got {type(backend).__name__})"
        )
    cache = create_unified_radix_cache(ctx, cache_class=TokenLakeRadixCache)
    cache.attach(backend)
    return cache
