"""Real SGLang objects on CPU for the backend tests, and a tiny stand-in for SGLang's
scheduler that drives both backends with identical batches.

Real: ``ReqToTokenPool``, ``MHATokenToKVPool``, ``RadixAttention``, ``ForwardBatch``,
``ForwardMode``, ``SpeculativeAlgorithm`` and the reference ``TorchNativeAttnBackend``.
Faked: the ``ModelRunner`` (building one needs a checkpoint, a distributed group and a GPU);
its attributes the backend reads are checked against SGLang's source in test_sglang_api.py.
SGLang's ``torch_native`` ignores ``RadixAttention.logit_cap``, so soft-capped layers are
checked against monolithic attention written out here (``reference="plain"``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

from tokenlake.engines.sglang.backend import TokenLakeAttnBackend
from tokenlake.engines.sglang.config import SGLangPoolConfig

TOLERANCE = 1e-5


def make_runner(
    num_q_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    num_layers: int = 2,
    kv_size: int = 2048,
    max_reqs: int = 16,
    max_context_len: int = 512,
    scaling: float | None = None,
    dtype: torch.dtype = torch.float32,
    kv_pool=None,
    device: str = "cpu",
    **layer_kwargs,
) -> SimpleNamespace:
    """A stand-in ``ModelRunner`` holding real SGLang pools and attention layers
    (``kv_pool``: an SGLang KV pool built by the caller, e.g. over a pool instance's slots;
    ``device``: the runner's name for its device, e.g. ``cpu:0`` as SGLang says ``cuda``)."""
    scaling = head_dim**-0.5 if scaling is None else scaling
    layers = torch.nn.ModuleList(
        RadixAttention(num_q_heads, head_dim, scaling, num_kv_heads, i, **layer_kwargs)
        for i in range(num_layers)
    )
    return SimpleNamespace(
        device=device,
        model=layers,
        model_config=SimpleNamespace(is_encoder_decoder=False, model_path="tiny-test-model"),
        req_to_token_pool=ReqToTokenPool(max_reqs, max_context_len, "cpu", False),
        token_to_kv_pool=kv_pool
        if kv_pool is not None
        else MHATokenToKVPool(kv_size, 1, dtype, num_kv_heads, head_dim, num_layers, "cpu", False),
        use_mla_backend=False,
        spec_algorithm=SpeculativeAlgorithm.NONE,
        is_hybrid_swa=False,
        sliding_window_size=None,
    )


@dataclass
class Req:
    """A request as the stand-in scheduler sees it."""

    rid: str
    tokens: list[int]
    row: int
    num_cached: int = 0  # tokens whose KV is in SGLang's cache (req_to_token filled)
    slots: list[int] = field(default_factory=list)


class World:
    """Drives ``TokenLakeAttnBackend`` and SGLang's ``torch_native`` backend over the same
    real pools with the same batches, layer by layer, and records the largest difference from
    the reference: ``torch_native``, or with ``reference="plain"`` monolithic attention over
    every request's whole sequence in float64 with SGLang's soft cap (``cap * tanh(s / cap)``
    of the scaled score ``s``, when ``logit_cap > 0``); ``native_err`` then keeps the largest
    difference from ``torch_native``, which ignores the cap."""

    def __init__(
        self,
        config: SGLangPoolConfig,
        seed: int = 0,
        reference: str = "torch_native",
        runtime=None,
        **runner_kwargs,
    ) -> None:
        assert reference in ("torch_native", "plain")
        self.plain = reference == "plain"
        self.native_err = 0.0
        self.runner = make_runner(**runner_kwargs)
        self.allocator = None  # SGLang's slot allocator, when a test sets one
        self.tokenlake = TokenLakeAttnBackend(self.runner, config, runtime=runtime)
        self.reference = TorchNativeAttnBackend(self.runner)
        self.layers = list(self.runner.model)
        self.rtt = self.runner.req_to_token_pool
        self.free_kv = list(range(self.runner.token_to_kv_pool.size, 0, -1))  # slot 0 is padding
        self.reqs: dict[str, Req] = {}
        self.seed = seed
        self.max_err = 0.0
        gen = torch.Generator().manual_seed(seed)
        layer = self.layers[0]
        h_kv, d = layer.tp_k_head_num, layer.head_dim
        # K, V depend only on (token, position, layer), as in a real model's prefix
        self._kv_table = torch.randn((len(self.layers), 997, 2, h_kv, d), generator=gen)
        self.dtype = self.runner.token_to_kv_pool.dtype  # the model's activations, too
        self._kv_table = self._kv_table.to(self.dtype)
        self._gen = gen

    @property
    def pool(self):
        """The pool, when it lives in this process (``None`` for a worker of a shared pool)."""
        return getattr(self.tokenlake.runtime, "pool", None)

    # ---- the scheduler's side ------------------------------------------------------------
    def add(
        self,
        rid: str,
        tokens: list[int],
        share_from: str | None = None,
        share: int = 0,
        prefix_slots: list[int] | None = None,
    ):
        """A new request; ``share`` tokens of ``share_from``'s cached KV are reused as SGLang's
        radix cache would (same slots, no recompute), or the slots of a radix-cache match."""
        (row,) = self.rtt.alloc_rows(1)
        req = Req(rid, list(tokens), row)
        if share_from is not None and share:
            src = self.reqs[share_from]
            assert src.tokens[:share] == req.tokens[:share] and share <= src.num_cached
            prefix_slots = src.slots[:share]
        if prefix_slots:
            req.slots = list(prefix_slots)
            req.num_cached = len(prefix_slots)
            self.rtt.req_to_token[row, : req.num_cached] = torch.tensor(
                req.slots, dtype=torch.int32
            )
        self.reqs[rid] = req
        return req

    def release(self, rid: str) -> None:
        """SGLang finished, aborted or retracted the request: its row goes back (and, with a
        paged allocator, the pages no other live request uses)."""
        req = self.reqs.pop(rid)
        self.rtt.free_rows([req.row])
        if self.allocator is not None and self.allocator.page_size > 1:
            ps = self.allocator.page_size
            live = {s // ps for r in self.reqs.values() for s in r.slots}
            gone = sorted({s // ps for s in req.slots} - live)
            if gone:
                self.allocator.free(torch.tensor(gone, dtype=torch.int64) * ps)

    def alloc_locs(self, start: int, n: int, last_loc: int | None) -> list[int]:
        """KV locations of ``n`` tokens at positions ``start...``: one by one, or with a paged
        allocator as SGLang's ``alloc_extend`` (the current page goes on, then new pages)."""
        if self.allocator is None:
            return [self.free_kv.pop() for _ in range(n)]
        ps = self.allocator.page_size
        if ps == 1:
            return self.allocator.alloc(n).tolist()
        out = []
        for pos in range(start, start + n):
            if pos % ps == 0:
                page = self.allocator.alloc(ps)
                assert page is not None, "out of KV pages"
                last_loc = int(page[0])
            else:
                last_loc += 1
            out.append(last_loc)
        return out

    def step(self, work: dict[str, int], mode: ForwardMode | None = None) -> float:
        """One forward: request ``rid`` computes its next ``work[rid]`` tokens. Returns the max
        abs difference of the two backends' outputs over every layer."""
        reqs = [self.reqs[rid] for rid in work]
        new_lens = [work[r.rid] for r in reqs]
        if mode is None:
            decode = all(n == 1 and r.num_cached > 0 for r, n in zip(reqs, new_lens, strict=True))
            mode = ForwardMode.DECODE if decode else ForwardMode.EXTEND
        locs, ids, pos = [], [], []
        for req, n in zip(reqs, new_lens, strict=True):
            start = req.num_cached
            while len(req.tokens) < start + n:  # decoding: the "sampled" next token
                req.tokens.append((len(req.tokens) * 131 + 17) % 5000)
            new_slots = self.alloc_locs(start, n, req.slots[-1] if req.slots else None)
            req.slots += new_slots
            self.rtt.req_to_token[req.row, start : start + n] = torch.tensor(
                new_slots, dtype=torch.int32
            )
            locs += new_slots
            ids += req.tokens[start : start + n]
            pos += list(range(start, start + n))
        seq_lens = torch.tensor([r.num_cached + n for r, n in zip(reqs, new_lens, strict=True)])
        prefix = [r.num_cached for r in reqs]
        fb = ForwardBatch(
            forward_mode=mode,
            batch_size=len(reqs),
            input_ids=torch.tensor(ids),
            req_pool_indices=torch.tensor([r.row for r in reqs]),
            seq_lens=seq_lens,
            out_cache_loc=torch.tensor(locs, dtype=torch.int64),
            seq_lens_sum=int(seq_lens.sum()),
            seq_lens_cpu=seq_lens.clone(),
            positions=torch.tensor(pos),
            rids=[r.rid for r in reqs],
        )
        if mode != ForwardMode.DECODE:
            fb.extend_prefix_lens = torch.tensor(prefix)
            fb.extend_seq_lens = torch.tensor(new_lens)
            fb.extend_prefix_lens_cpu = prefix
            fb.extend_seq_lens_cpu = new_lens
            fb.extend_num_tokens = sum(new_lens)
        self.tokenlake.init_forward_metadata(fb)
        self.reference.init_forward_metadata(fb)
        err = 0.0
        token_ids, positions = torch.tensor(ids), torch.tensor(pos)
        for layer in self.layers:
            q, k, v = self._qkv(layer, token_ids, positions)
            out = self.tokenlake.forward(q, k, v, layer, fb)
            ref = self.reference.forward(q, k, v, layer, fb)
            assert out.shape == ref.shape == (len(ids), layer.tp_q_head_num * layer.head_dim)
            if self.plain:
                self.native_err = max(self.native_err, float((out - ref).abs().max()))
                ref = self._plain(layer, reqs, new_lens, q)
            err = max(err, float((out - ref).abs().max()))
        for req, n in zip(reqs, new_lens, strict=True):
            req.num_cached += n
        if self.pool is not None:
            self.pool.check_invariants()
        self.max_err = max(self.max_err, err)
        return err

    def _plain(self, layer, reqs: list[Req], new_lens: list[int], q: torch.Tensor):
        """Each request's new rows over its whole sequence (K/V recomputed from the token ids
        and positions, not read from any cache), causal, float64, soft-capped."""
        h_q, d = layer.tp_q_head_num, layer.head_dim
        group = h_q // layer.tp_k_head_num
        cap = layer.logit_cap or 0.0
        out, lo = [], 0
        for req, n in zip(reqs, new_lens, strict=True):
            end = req.num_cached + n
            kv = self._kv(layer, torch.tensor(req.tokens[:end]), torch.arange(end)).double()
            rows = q[lo : lo + n].double().view(n, h_q, d)
            lo += n
            o = torch.empty((n, h_q, d), dtype=torch.float64)
            for h in range(h_q):
                scores = rows[:, h] @ kv[:, 0, h // group].T * layer.scaling  # [n, end]
                if cap > 0:
                    scores = cap * torch.tanh(scores / cap)
                future = torch.arange(end)[None, :] > req.num_cached + torch.arange(n)[:, None]
                probs = torch.softmax(scores.masked_fill(future, -math.inf), dim=-1)
                o[:, h] = probs @ kv[:, 1, h // group]
            out.append(o.reshape(n, h_q * d))
        return torch.cat(out).float()

    def _kv(self, layer, token_ids, positions):
        index = (token_ids * 31 + positions * 7) % self._kv_table.shape[1]
        return self._kv_table[layer.layer_id, index]

    def _qkv(self, layer, token_ids, positions):
        kv = self._kv(layer, token_ids, positions)
        q = torch.randn(
            (len(token_ids), layer.tp_q_head_num * layer.head_dim), generator=self._gen
        ) / math.sqrt(2)
        return q.to(self.dtype), kv[:, 0].contiguous(), kv[:, 1].contiguous()


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(0, 5000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
