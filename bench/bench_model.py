"""Model-engine speed, side by side with ``transformers`` on the same seeded checkpoint, in one run:

- ``decode_single``: one request's decode step (1K-token context) through TokenLake (gen_plans,
  the model forward with prefix attention through the pool, commit) vs transformers' forward
  with its own KV cache (``DynamicCache``). Goal ratio <= 1.0.
- ``decode_batch16``: decode throughput of 16 requests in one batch vs transformers' batched
  ``generate`` (same prompts, greedy). Goal >= 3x.
- ``prefill_cached``: prefill time of a prompt whose first X% is in the pool vs the same
  length uncached (goal: time falls with the uncached fraction).

    python -m tokenlake.bench.bench_model [--quick] [--threads 1]

Prints a table and one JSON line per case. Ratios are measured in one run; absolute times on a
shared 2-core machine are noise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import tokenlake as tl
from tokenlake.engines.local_cluster import LocalCluster
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


class Stepper:
    """Greedy generation straight on the pool and the model engine (no scheduler)."""

    def __init__(self, model: LlamaModel, segment_len: int, num_slots: int) -> None:
        self.pool = tl.Pool(tl.PoolConfig(model.shape, 1, num_slots, segment_len))
        self.engine = ModelEngine(model, LocalCluster(self.pool))
        self.tokens: dict[str, list[int]] = {}
        self.stored: dict[str, int] = {}

    def prefill(self, prompts: dict[str, list[int]]) -> float:
        """Seconds to prefill ``prompts`` (from their cached prefix) in one iteration."""
        tree = self.pool.get_prefix_tree()
        chunks = []
        for rid, p in prompts.items():
            ids = np.asarray(p, dtype=np.int32)
            start = min(tree.match(ids).num_tokens, len(p) - 1)
            chunks.append(tl.Chunk(rid, ids, start))
        return self._run(chunks)

    def decode(self) -> float:
        chunks = [
            tl.Chunk(rid, np.asarray(t, dtype=np.int32), self.stored[rid])
            for rid, t in self.tokens.items()
        ]
        return self._run(chunks)

    def _run(self, chunks: list[tl.Chunk]) -> float:
        t0 = time.perf_counter()
        plans = self.pool.gen_plans([chunks])
        logits = self.engine.run(plans, {c.request_id: c for c in chunks})
        self.pool.commit(plans)
        for c in chunks:
            self.tokens[c.request_id] = c.token_ids.tolist() + [int(logits[c.request_id].argmax())]
            self.stored[c.request_id] = c.end
        return time.perf_counter() - t0

    def finish_all(self) -> None:
        for rid in self.tokens:
            self.pool.finish(rid)
        self.tokens.clear()
        self.stored.clear()


def hf_decode_step_s(hf, prompt: list[int], steps: int) -> tuple[float, list[int]]:
    """Median seconds of one decode step of transformers with its own KV cache."""
    from transformers import DynamicCache

    with torch.no_grad():
        cache = DynamicCache(config=hf.config)
        out = hf(torch.tensor([prompt]), past_key_values=cache, use_cache=True)
        token = out.logits[0, -1].argmax().view(1, 1)
        times, generated = [], [int(token)]
        for _ in range(steps):
            t0 = time.perf_counter()
            out = hf(token, past_key_values=out.past_key_values, use_cache=True)
            token = out.logits[0, -1].argmax().view(1, 1)
            times.append(time.perf_counter() - t0)
            generated.append(int(token))
    return statistics.median(times), generated


def case_decode_single(model, hf, args, rng) -> dict:
    prompt = rng.integers(0, SHAPE["vocab_size"], args.context).tolist()
    st = Stepper(model, args.segment_len, args.slots)
    st.prefill({"a": prompt})
    times = [st.decode() for _ in range(args.steps)]
    ours = statistics.median(times)
    generated = st.tokens["a"][len(prompt) :]
    st.finish_all()
    theirs, ref = hf_decode_step_s(hf, prompt, args.steps)
    return {
        "case": "decode_single", "context": args.context, "steps": args.steps,
        "tokenlake_ms": ours * 1e3, "transformers_ms": theirs * 1e3, "ratio": ours / theirs,
        "goal": "ratio <= 1.0", "same_tokens": generated == ref,
    }  # fmt: skip


def case_decode_batch(model, hf, args, rng) -> dict:
    batch, ctx = 16, args.batch_context
    prompts = {f"r{i}": rng.integers(0, SHAPE["vocab_size"], ctx).tolist() for i in range(batch)}
    st = Stepper(model, args.segment_len, args.slots)
    st.prefill(prompts)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        st.decode()
    ours = batch * args.steps / (time.perf_counter() - t0)
    st.finish_all()
    ids = torch.tensor(list(prompts.values()))
    with torch.no_grad():
        kw = dict(do_sample=False, attention_mask=torch.ones_like(ids), eos_token_id=None)
        t0 = time.perf_counter()
        hf.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
        prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        hf.generate(ids, max_new_tokens=args.steps + 1, min_new_tokens=args.steps + 1, **kw)
        total = time.perf_counter() - t0
    theirs = batch * args.steps / max(total - prefill, 1e-9)
    return {
        "case": "decode_batch16", "context": ctx, "steps": args.steps,
        "tokenlake_tokens_per_s": ours, "transformers_tokens_per_s": theirs,
        "ratio": ours / theirs, "goal": "ratio >= 3",
    }  # fmt: skip


def case_prefill_cached(model, args, rng) -> list[dict]:
    n = args.prefill_len
    rows = []
    for frac in (0.0, 0.5, 0.9):
        st = Stepper(model, args.segment_len, args.slots)
        cached = int(n * frac) // args.segment_len * args.segment_len
        base = rng.integers(0, SHAPE["vocab_size"], n).tolist()
        if cached:
            st.prefill({"warm": base[:cached]})
            st.finish_all()
        times = []
        for r in range(args.repeats):
            prompt = base[:cached] + rng.integers(0, SHAPE["vocab_size"], n - cached).tolist()
            times.append(st.prefill({f"p{r}": prompt}))
            st.finish_all()
        rows.append({"cached_fraction": cached / n, "seconds": min(times)})
    fresh = rows[0]["seconds"]
    return [
        {
            "case": "prefill_cached",
            "prompt_len": n,
            "cached_fraction": round(r["cached_fraction"], 3),
            "tokenlake_ms": r["seconds"] * 1e3,
            "ratio_vs_uncached": r["seconds"] / fresh,
            "uncached_fraction": round(1 - r["cached_fraction"], 3),
            "goal": "time falls with the uncached fraction",
        }  # fmt: skip
        for r in rows
    ]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tokenlake.bench.bench_model", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    p.add_argument("--quick", action="store_true", help="short run (CI smoke)")
    p.add_argument("--threads", type=int, default=1, help="torch threads for both sides")
    p.add_argument("--context", type=int, default=1024, help="decode_single context length")
    p.add_argument("--batch-context", type=int, default=256, help="decode_batch16 prompt length")
    p.add_argument("--prefill-len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=32, help="decode steps measured")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--segment-len", type=int, default=64)
    p.add_argument("--slots", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.quick:
        args.context, args.batch_context, args.prefill_len = 256, 64, 512
        args.steps, args.repeats = 6, 1
    torch.set_num_threads(args.threads)
    import transformers

    rng = np.random.default_rng(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        path = make_model(Path(tmp) / "llama", args.seed)
        model = LlamaModel.from_dir(path)
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(path)).eval()
    shape = ", ".join(f"{k}={v}" for k, v in SHAPE.items())
    print(f"bench_model: seeded Llama ({shape}), fp32, {args.threads} torch thread(s)")
    results = [case_decode_single(model, hf, args, rng), case_decode_batch(model, hf, args, rng)]
    results += case_prefill_cached(model, args, rng)
    print(f"{'case':<16} {'setting':<22} {'tokenlake':>14} {'transformers':>14} {'ratio':>7}  goal")
    for r in results:
        if r["case"] == "decode_single":
            cells = (
                f"ctx {r['context']}",
                f"{r['tokenlake_ms']:.2f} ms",
                f"{r['transformers_ms']:.2f} ms",
            )
        elif r["case"] == "decode_batch16":
            cells = (f"ctx {r['context']}", f"{r['tokenlake_tokens_per_s']:.0f} tok/s",
                     f"{r['transformers_tokens_per_s']:.0f} tok/s")  # fmt: skip
        else:
            cells = (
                f"{r['cached_fraction']:.0%} of {r['prompt_len']} cached",
                f"{r['tokenlake_ms']:.1f} ms",
                "-",
            )
        ratio = r.get("ratio", r.get("ratio_vs_uncached"))
        print(
            f"{r['case']:<16} {cells[0]:<22} {cells[1]:>14} {cells[2]:>14} {ratio:>7.2f}  {r['goal']}"
        )
    for r in results:
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
