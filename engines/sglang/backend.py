"""``TokenLakeAttnBackend``: SGLang's attention backend interface over the pool.

SGLang keeps running the model, its scheduler and its own KV cache; per forward
(``init_forward_metadata``) every request is mapped to a pool chunk and the iteration is
planned once; per layer the new K/V are written to SGLang's cache and ``put`` into the pool,
the query rows attend to their prefix where the pool's segments live, and a local causal
partial over the new (and backfilled) tokens is merged with it by LSE (natural log).
Extend, decode and mixed batches (chunked prefill included) all take the same path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import numpy as np
import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.mem_cache.memory_pool import KVWriteLoc
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from tokenlake.engines.client.prefix_attention import PrefixAttention
from tokenlake.engines.kernels.flashinfer_attention import make_causal_planner
from tokenlake.errors import IterationStateError, PoolFullError
from tokenlake.validate import canonical_device

from .batch_map import BatchMap, HostTokens, RequestTable, SeqInfo, engine_slots, map_batch
from .config import SGLangPoolConfig, config_from_env
from .local_batch import LocalBatch, attend, local_batch, plan_rows
from .model_check import UnsupportedFeatureError, check_model
from .one_copy import check_one_copy
from .pool_runtime import PoolRuntime
from .shared_runtime import SharedPoolRuntime

_MODES = (ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.MIXED)


class TokenLakeAttnBackend(AttentionBackend):
    """Selected by ``--attention-backend tokenlake``; pool settings from ``TOKENLAKE_CONFIG``."""

    def __init__(self, model_runner, config: SGLangPoolConfig | None = None, runtime=None) -> None:
        """``runtime``: a :class:`.shared_runtime.SharedPoolRuntime` when this worker is one
        instance of a pool shared by several SGLang workers; by default a pool of its own
        (:class:`.pool_runtime.PoolRuntime`, ``config``'s instances in this process). The pool
        may hold fewer tokens than SGLang's KV cache: a forward it cannot take is attended
        from SGLang's cache (:mod:`.local_batch`)."""
        super().__init__()
        layers = [m for m in model_runner.model.modules() if isinstance(m, RadixAttention)]
        shape = check_model(model_runner, layers)
        config = config if config is not None else config_from_env()
        self.device = canonical_device(model_runner.device)  # `cuda` -> `cuda:N`, as tensors
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        kv = self.token_to_kv_pool
        joined = runtime is None and config.control_endpoint is not None
        if joined:
            runtime = SharedPoolRuntime.join(
                config.control_endpoint, config.secret_file, joining_instance(config),
                kernel_backend=config.kernel_backend,
            )  # fmt: skip
        if runtime is None:
            namespace = config.namespace or str(model_runner.model_config.model_path)
            runtime = PoolRuntime(config, shape, namespace, self.device)
        elif runtime.model != shape:
            if joined:
                runtime.close()  # give the instance up: this process may go on
            hint = ""
            if dataclasses.replace(runtime.model, dtype=shape.dtype) == shape:
                hint = f"; start SGLang with --dtype {runtime.model.dtype}"
            raise UnsupportedFeatureError(
                f"tokenlake shared pool: the pool's model shape {runtime.model} differs from "
                f"this SGLang worker's {shape}{hint}"
            )
        if getattr(runtime, "engine_slots", False):
            try:
                check_one_copy(kv, runtime)
            except BaseException:
                if joined:
                    runtime.close()
                raise
        self.runtime = runtime
        self.requests = RequestTable(self.runtime)
        self.shape = shape
        self.start_layer = kv.start_layer
        # token id of every SGLang KV slot, as written by this backend: the pool keys
        # segments by token ids, and a forward batch carries only the new tokens' ids
        self.slot_tokens = torch.full(
            (kv.k_buffer[0].shape[0],), -1, dtype=torch.int32, device=self.device
        )
        self.host_tokens = HostTokens(self.req_to_token_pool.req_to_token, self.slot_tokens)
        self.forward_metadata: BatchMap | None = None
        self.attention: PrefixAttention | None = None  # the batch's causal part and merge
        self._causal_planner = make_causal_planner(
            self.runtime.model, self.runtime.kernel_backend, self.device
        )
        self._layers_done: set[int] = set()
        self.local: LocalBatch | None = None  # a forward attended from SGLang's cache
        self.num_local_forwards = 0

    # ---- per forward -------------------------------------------------------------------
    def init_forward_metadata(self, forward_batch) -> None:
        self._settle()
        mode = forward_batch.forward_mode
        if mode.is_idle():
            self.forward_metadata = None
            return
        if mode not in _MODES:
            raise UnsupportedFeatureError(
                f"--attention-backend tokenlake does not support {mode.name} batches "
                f"(speculative decoding, PD-disaggregation prebuilt KV, split or diffusion "
                f"prefill); supported: {', '.join(m.name for m in _MODES)}"
            )
        rtt = self.req_to_token_pool
        generations = rtt.req_generation.numpy()  # SGLang keeps it on the host
        free_rows = set(rtt.free_slots)
        self.requests.release(free_rows, generations)
        self.host_tokens.release(free_rows, generations)
        new_ids = forward_batch.input_ids.to(torch.int32)
        self.slot_tokens[forward_batch.out_cache_loc.long()] = new_ids
        seqs = self._seq_infos(forward_batch, generations)
        # the forward's one copy to the host: its new tokens (no read per request)
        token_ids = self.host_tokens.forward(seqs, new_ids.cpu().numpy())
        chunks = [self.requests.chunk(s, ids) for s, ids in zip(seqs, token_ids, strict=True)]
        self.local = None
        it = None
        if plan_rows(seqs, [c.start for c in chunks]) <= self.runtime.max_rows:
            # a full pool (pinned data leaves too few slots) sends this forward local
            with contextlib.suppress(PoolFullError):
                if self.runtime.engine_slots:
                    slots = engine_slots(seqs, chunks, rtt.req_to_token, self.runtime.segment_len)
                    it = self.runtime.begin(chunks, slots)
                else:
                    it = self.runtime.begin(chunks)
        if it is None:
            self._go_local(seqs)
            return
        try:
            self.forward_metadata = map_batch(it, seqs, chunks, rtt.req_to_token)
            self.attention = self._bind_attention(self.forward_metadata)
        except BaseException:
            self.runtime.abort()
            raise

    def release_row(self, row: int) -> None:
        """SGLang released ``row``'s request (:mod:`.radix_cache`): finish its pool request
        now, unless a forward is in flight (then the next forward does)."""
        if self.runtime.inflight is None:
            self.requests.forget([row])

    def _go_local(self, seqs: list[SeqInfo]) -> None:
        """Attend this forward from SGLang's cache (:mod:`.local_batch`); its requests' pool
        side starts again at their next forward."""
        self.requests.forget([s.row for s in seqs])
        self.forward_metadata = None
        self.local = local_batch(
            seqs, self.req_to_token_pool.req_to_token, self.shape, self.token_to_kv_pool.dtype,
            self.runtime.kernel_backend, self._causal_planner, self.device,
        )  # fmt: skip
        self.num_local_forwards += 1

    def _bind_attention(self, m: BatchMap) -> PrefixAttention:
        """Plan the batch's local causal part and merge once, from host offsets."""
        shape, it = self.shape, m.it
        backfill = m.num_backfill > 0
        return PrefixAttention.bind(
            m.new_offsets, (int(m.plan_new_rows.numel()), shape.num_q_heads, shape.head_dim),
            shape.num_kv_heads, it.q_buf.dtype, kv_indptr=m.kv_offsets if backfill else None,
            num_kv_rows=int(it.kv_buf.shape[1]), backend=self.runtime.kernel_backend,
            logit_cap=shape.logit_cap, device=it.q_buf.device, planner=self._causal_planner,
        )  # fmt: skip

    def _seq_infos(self, fb, generations: np.ndarray) -> list[SeqInfo]:
        """The batch's requests on the host: SGLang's host copies where it has them (one
        read per forward of its row indices otherwise)."""
        rows = fb.req_pool_indices_cpu
        rows = (fb.req_pool_indices if rows is None else rows).tolist()
        seq_lens = (fb.seq_lens_cpu if fb.seq_lens_cpu is not None else fb.seq_lens).tolist()
        decode = fb.forward_mode.is_decode()
        new_lens = [1] * len(rows) if decode else list(fb.extend_seq_lens_cpu)
        rids = fb.rids if fb.rids is not None else [None] * len(rows)
        return [
            SeqInfo(row, int(generations[row]), rid, int(n), int(new))
            for row, rid, n, new in zip(rows, rids, seq_lens, new_lens, strict=True)
        ]

    def _settle(self) -> None:
        """Commit the previous forward if every layer ran, else abort it (it failed)."""
        if self.runtime.inflight is None:
            return
        if len(self._layers_done) == self.shape.num_layers:
            self.runtime.commit()
        else:
            self.runtime.abort()
        self._layers_done.clear()

    # ---- per layer ---------------------------------------------------------------------
    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache)

    def forward_mixed(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache)

    def _forward(self, q, k, v, layer, forward_batch, save_kv_cache: bool) -> torch.Tensor:
        if self.local is not None:
            return self._forward_local(q, k, v, layer, forward_batch, save_kv_cache)
        m = self.forward_metadata
        if m is None or self.runtime.inflight is not m.it:
            raise IterationStateError(
                "TokenLakeAttnBackend: forward without init_forward_metadata for this batch"
            )
        kv = self.token_to_kv_pool
        loc = forward_batch.out_cache_loc
        if save_kv_cache and k is not None and v is not None:
            kv.set_kv_buffer(layer, KVWriteLoc(loc, None), k, v)
        if k is None or v is None:  # the model wrote them into SGLang's cache itself
            k = kv.get_key_buffer(layer.layer_id)[loc.long()]
            v = kv.get_value_buffer(layer.layer_id)[loc.long()]
        li = layer.layer_id - self.start_layer
        it, shape = m.it, self.shape
        rows = it.kv_buf[li]
        rows[m.new_plan_rows, 0] = k.reshape(-1, shape.num_kv_heads, shape.head_dim).to(rows.dtype)
        rows[m.new_plan_rows, 1] = v.reshape(-1, shape.num_kv_heads, shape.head_dim).to(rows.dtype)
        if m.num_backfill:
            rows[m.backfill_plan_rows, 0] = kv.get_key_buffer(layer.layer_id)[m.backfill_slots]
            rows[m.backfill_plan_rows, 1] = kv.get_value_buffer(layer.layer_id)[m.backfill_slots]
        self.runtime.put(it, li)
        # the pool's kernels use 1/sqrt(D); fold the layer's own scaling into q (the soft cap
        # applies to the scaled score, as in SGLang: cap * tanh(scaling * q.k / cap))
        q3 = q.reshape(-1, shape.num_q_heads, shape.head_dim)
        it.q_buf[m.new_plan_rows] = (q3.float() * (layer.scaling * math.sqrt(shape.head_dim))).to(
            it.q_buf.dtype
        )
        o_p, lse_p = self.runtime.query(it, li)
        o_plan, _ = self.attention(
            it.q_buf[m.plan_new_rows], rows[:, 0], rows[:, 1], o_p[m.plan_new_rows],
            lse_p[m.plan_new_rows],
        )  # fmt: skip
        out = q3.new_empty((q3.shape[0], shape.num_q_heads, shape.head_dim))
        out[m.plan_src_rows] = o_plan.to(q.dtype)
        self._layers_done.add(li)
        if len(self._layers_done) == shape.num_layers:
            self.runtime.commit()
            self._layers_done.clear()
        return out.reshape(-1, shape.num_q_heads * shape.head_dim)

    def _forward_local(self, q, k, v, layer, forward_batch, save_kv_cache: bool):
        kv, shape = self.token_to_kv_pool, self.shape
        loc = forward_batch.out_cache_loc
        if save_kv_cache and k is not None and v is not None:
            kv.set_kv_buffer(layer, KVWriteLoc(loc, None), k, v)
        k_cache, v_cache = kv.get_key_buffer(layer.layer_id), kv.get_value_buffer(layer.layer_id)
        if k is None or v is None:
            k, v = k_cache[loc.long()], v_cache[loc.long()]
        q3 = q.reshape(-1, shape.num_q_heads, shape.head_dim)
        scaled = (q3.float() * (layer.scaling * math.sqrt(shape.head_dim))).to(k_cache.dtype)
        o = attend(
            self.local, scaled, k.reshape(-1, shape.num_kv_heads, shape.head_dim),
            v.reshape(-1, shape.num_kv_heads, shape.head_dim), k_cache, v_cache,
        )  # fmt: skip
        return o.to(q.dtype).reshape(-1, shape.num_q_heads * shape.head_dim)

    # ---- load-back into SGLang's cache (engines/sglang/radix_cache.py) -------------------
    def load_prefix(self, token_ids: np.ndarray, lo: int, hi: int, slots: torch.Tensor) -> None:
        """Copy the pool's K/V of tokens ``lo:hi`` of ``token_ids`` into SGLang's KV cache at
        ``slots`` (``hi - lo`` slot ids), so SGLang can reuse a prefix only the pool held."""
        kv = self.runtime.read_kv(token_ids, lo, hi)
        cache = self.token_to_kv_pool
        slots = slots.to(self.device).long()
        for li in range(self.shape.num_layers):
            layer_id = li + self.start_layer
            k_buf, v_buf = cache.get_key_buffer(layer_id), cache.get_value_buffer(layer_id)
            k_buf[slots] = kv[li, :, 0].to(k_buf.dtype)
            v_buf[slots] = kv[li, :, 1].to(v_buf.dtype)
        ids = torch.from_numpy(np.ascontiguousarray(token_ids[lo:hi], dtype=np.int32))
        self.slot_tokens[slots] = ids.to(self.device)

    # ---- what cannot be captured -------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        raise UnsupportedFeatureError(
            "--attention-backend tokenlake does not support CUDA-graph capture: every batch "
            "is planned on the host. Run with --disable-decode-cuda-graph "
            "--disable-prefill-cuda-graph (the plugin sets both when it parses the command line)"
        )

    def support_triton(self) -> bool:
        return False


def joining_instance(config: SGLangPoolConfig) -> int:
    """The instance a worker joining a host is: ``config.instance_id``, or else its SGLang
    data-parallel rank (``--dp-size N``: every DP worker reads one config file)."""
    if config.instance_id is not None:
        return config.instance_id
    from sglang.srt.runtime_context import get_parallel

    try:
        rank = get_parallel().dp_rank
    except RuntimeError:
        rank = None
    if rank is None:
        raise UnsupportedFeatureError(
            "tokenlake config instance_id: not given, and this SGLang process is no "
            "data-parallel replica (no --dp-size); give each worker's instance_id"
        )
    return int(rank)
