"""The model benchmarks' shared pieces: a seeded Llama checkpoint (``make_model``), a CPU and
wall-clock ``Timer``, greedy generation straight on the pool and the model engine
(``Stepper``) and transformers' own step-by-step decode (``HfDecoder``) to compare it with."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np
import torch

import tokenlake as tl
from tokenlake.engines.client.forward import RowBatch
from tokenlake.engines.clusters.local import LocalCluster
from tokenlake.engines.model.engine import ModelEngine
from tokenlake.engines.model.llama import LlamaModel

SHAPE = dict(
    vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
    num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=8192,
)  # fmt: skip


def make_model(path: Path, seed: int = 0) -> Path:
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(**SHAPE, bos_token_id=None, eos_token_id=None)
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(str(path))
    return path


class Timer:
    """Process CPU seconds and wall seconds of each call, kept per name."""

    def __init__(self) -> None:
        self.cpu: dict[str, list[float]] = {}
        self.wall: dict[str, list[float]] = {}

    def __call__(self, name: str, fn, *args):
        c0, w0 = time.process_time(), time.perf_counter()
        out = fn(*args)
        self.cpu.setdefault(name, []).append(time.process_time() - c0)
        self.wall.setdefault(name, []).append(time.perf_counter() - w0)
        return out

    def add(self, name: str, cpu_s: float, wall_s: float) -> None:
        self.cpu.setdefault(name, []).append(cpu_s)
        self.wall.setdefault(name, []).append(wall_s)

    def median(self, name: str, clock: str = "cpu") -> float:
        return statistics.median(getattr(self, clock)[name])


def clocks() -> tuple[float, float]:
    return time.process_time(), time.perf_counter()


class Stepper:
    """Greedy generation straight on the pool and the model engine (no scheduler)."""

    def __init__(self, model: LlamaModel, segment_len: int, num_slots: int) -> None:
        self.model = model
        self.pool = tl.Pool(tl.PoolConfig(model.shape, 1, num_slots, segment_len))
        self.engine = ModelEngine(model, LocalCluster(self.pool))
        self.tokens: dict[str, np.ndarray] = {}
        self.stored: dict[str, int] = {}

    def prefill(self, prompts: dict[str, list[int]]) -> None:
        """Prefill ``prompts`` (from their cached prefix) in one iteration."""
        tree = self.pool.get_prefix_tree()
        chunks = []
        for rid, p in prompts.items():
            ids = np.asarray(p, dtype=np.int32)
            chunks.append(tl.Chunk(rid, ids, min(tree.match(ids).num_tokens, len(p) - 1)))
        self._run(chunks)

    def decode(self) -> None:
        self._run([tl.Chunk(r, t, self.stored[r]) for r, t in self.tokens.items()])

    def _run(self, chunks: list[tl.Chunk]) -> None:
        plans = self.pool.gen_plans([chunks])
        logits = self.engine.run(plans, {c.request_id: c for c in chunks})
        self.pool.commit(plans)
        self.engine.retire(plans)
        for c in chunks:
            token = int(logits[c.request_id].argmax())
            self.tokens[c.request_id] = np.append(c.token_ids, np.int32(token))
            self.stored[c.request_id] = c.end

    def dense_only(self) -> None:
        """A decode step of the same rows through the model's dense layers alone."""
        m = self.model
        group = m.config.num_q_heads // m.config.num_kv_heads
        batch = RowBatch.from_chunks(
            [tl.Chunk(r, t, len(t) - 1) for r, t in self.tokens.items()]
        )  # fmt: skip
        state = m.begin(batch)
        for layer in range(m.num_layers):
            q, _, v = m.project(state, layer)
            o = v.float().repeat_interleave(group, dim=1)
            m.absorb(state, layer, o, o.new_zeros(q.shape[:2]))
        m.logits(state, torch.from_numpy(batch.last_rows))

    def finish_all(self) -> None:
        for rid in self.tokens:
            self.pool.finish(rid)
        self.tokens.clear()
        self.stored.clear()


class HfDecoder:
    """transformers' forward with its own KV cache (``DynamicCache``), greedy, step by step."""

    def __init__(self, hf, prompts: list[list[int]]) -> None:
        from transformers import DynamicCache

        with torch.no_grad():
            out = hf(torch.tensor(prompts), past_key_values=DynamicCache(config=hf.config))
        self.hf, self.cache = hf, out.past_key_values
        self.token = out.logits[:, -1].argmax(-1, keepdim=True)
        self.generated = [self.token[:, 0].tolist()]

    def step(self) -> None:
        with torch.no_grad():
            out = self.hf(self.token, past_key_values=self.cache, use_cache=True)
        self.cache = out.past_key_values
        self.token = out.logits[:, -1].argmax(-1, keepdim=True)
        self.generated.append(self.token[:, 0].tolist())
