"""Model-engine speed, side by side with ``transformers`` on the same seeded checkpoint, in one run:

- ``decode_single``: one request's decode step (1K-token context) through TokenLake (gen_plans,
  the model forward with prefix attention through the pool, commit) vs transformers' forward
  with its own KV cache (``DynamicCache``). Goal ratio <= 1.0.
- ``decode_batch16``: decode throughput of 16 requests in one batch vs transformers' batched
  ``generate`` (same prompts, greedy). Goal >= 3x.
- ``prefill_cached``: prefill time of a prompt whose first 0/50/90% is in the pool (whole
  segments: the default prompt is 30 segments) vs transformers' forward over the whole prompt
  (goal: time falls with the uncached fraction).

    python -m tokenlake.benchmarks.micro.model [--quick] [--threads 1]

How it stays honest on a shared machine: both sides run on the same ``--threads`` (torch's
and the C++ kernels' pools alike); their steps are *interleaved* one by one (a TokenLake step,
then a transformers step: inside ``generate`` a logits processor runs the TokenLake step, its
time left out of transformers'), so both see the same machine load; each step is timed in
process CPU time (what the work costs, whatever else shares the cores) and on the wall clock;
medians. Ratios use CPU time; the wall-clock ratio is printed beside it. ``dense_only`` is the
same model's dense layers alone (attention replaced by ``o = v``), the floor of any attention:
``transformers / dense_only`` bounds the ratio TokenLake could reach. Prints a table and one
JSON line per case (``load_avg``: the machine's 1-minute load when the case ended).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import numpy as np
import torch

from tokenlake.benchmarks.micro.model_steps import (
    SHAPE,
    HfDecoder,
    Stepper,
    Timer,
    clocks,
    make_model,
)
from tokenlake.engines.kernels import cpu
from tokenlake.engines.model.llama import LlamaModel


def case_decode_single(model, hf, args, rng) -> dict:
    prompt = rng.integers(0, SHAPE["vocab_size"], args.context).tolist()
    st = Stepper(model, args.segment_len, args.slots)
    st.prefill({"a": prompt})
    theirs, timer = HfDecoder(hf, [prompt]), Timer()
    for _ in range(args.steps):
        timer("tokenlake", st.decode)
        timer("transformers", theirs.step)
        timer("dense_only", st.dense_only)
    same = st.tokens["a"][len(prompt) :].tolist() == [g[0] for g in theirs.generated]
    st.finish_all()
    ours, ref, floor = (timer.median(n) for n in ("tokenlake", "transformers", "dense_only"))
    wall = timer.median("tokenlake", "wall") / timer.median("transformers", "wall")
    return {
        "case": "decode_single", "context": args.context, "steps": args.steps,
        "tokenlake_ms": ours * 1e3, "transformers_ms": ref * 1e3, "dense_only_ms": floor * 1e3,
        "ratio": ours / ref, "ratio_wall": wall, "best_possible_ratio": floor / ref,
        "goal": "ratio <= 1.0", "goal_met": ours / ref <= 1.0, "same_tokens": same,
    }  # fmt: skip


def case_decode_batch(model, hf, args, rng) -> dict:
    """TokenLake's batch-16 decode steps interleaved with transformers' ``generate`` steps
    (each TokenLake step runs inside generate's logits processor, its time left out of the
    generate step it sits in), then with transformers' bare forward + cache steps."""
    from transformers import LogitsProcessor, LogitsProcessorList

    batch, ctx = 16, args.batch_context
    prompts = [rng.integers(0, SHAPE["vocab_size"], ctx).tolist() for _ in range(batch)]
    st = Stepper(model, args.segment_len, args.slots)
    st.prefill({f"r{i}": p for i, p in enumerate(prompts)})
    timer = Timer()

    class Interleave(LogitsProcessor):
        last = None  # the clocks when the previous generate step handed over

        def __call__(self, input_ids, scores):
            now = clocks()
            if self.last is not None:  # from the previous hand-over: one generate step
                timer.add("generate", now[0] - self.last[0], now[1] - self.last[1])
                timer("tokenlake", st.decode)
                timer("dense_only", st.dense_only)
            self.last = clocks()
            return scores

    ids = torch.tensor(prompts)
    with torch.no_grad():
        hf.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, eos_token_id=None,
            max_new_tokens=args.steps + 1, min_new_tokens=args.steps + 1,
            logits_processor=LogitsProcessorList([Interleave()]),
        )  # fmt: skip
    bare = HfDecoder(hf, prompts)
    for _ in range(args.steps):
        timer("transformers_forward", bare.step)
    st.finish_all()
    med = {n: timer.median(n) for n in ("tokenlake", "generate", "dense_only")}
    ours, theirs = batch / med["tokenlake"], batch / med["generate"]
    forward = batch / timer.median("transformers_forward")
    wall = timer.median("generate", "wall") / timer.median("tokenlake", "wall")
    return {
        "case": "decode_batch16", "context": ctx, "steps": args.steps,
        "tokenlake_tokens_per_s": ours, "transformers_tokens_per_s": theirs,
        "transformers_forward_tokens_per_s": forward,
        "dense_only_tokens_per_s": batch / med["dense_only"],
        "ratio": ours / theirs, "ratio_wall": wall,
        "best_possible_ratio": med["generate"] / med["dense_only"],
        "goal": "ratio >= 3", "goal_met": ours / theirs >= 3,
    }  # fmt: skip


def case_prefill_cached(model, hf, args, rng) -> list[dict]:
    """Rounds over the fractions (and transformers' whole-prompt forward), so every fraction
    sees the same load; best of ``repeats``."""
    n, seg = args.prefill_len, args.segment_len
    fractions = (0.0, 0.5, 0.9)
    base = rng.integers(0, SHAPE["vocab_size"], n).tolist()
    steppers, cached = [], []
    for frac in fractions:
        st = Stepper(model, seg, args.slots)
        c = int(n * frac) // seg * seg
        if c:
            st.prefill({"warm": base[:c]})
            st.finish_all()
        steppers.append(st)
        cached.append(c)
    timer = Timer()
    for r in range(args.repeats):
        for st, c in zip(steppers, cached, strict=True):
            prompt = base[:c] + rng.integers(0, SHAPE["vocab_size"], n - c).tolist()
            timer(f"tl{c}", st.prefill, {f"p{r}": prompt})
            st.finish_all()
        with torch.no_grad():
            timer("transformers", hf, torch.tensor([base]))
    fresh = min(timer.cpu[f"tl{cached[0]}"])
    ref = min(timer.cpu["transformers"])
    times = [min(timer.cpu[f"tl{c}"]) for c in cached]
    falls = all(a > b for a, b in zip(times[:-1], times[1:], strict=True))
    return [
        {
            "case": "prefill_cached",
            "prompt_len": n,
            "cached_fraction": round(c / n, 3),
            "tokenlake_ms": t * 1e3,
            "transformers_ms": ref * 1e3,
            "ratio_vs_uncached": t / fresh,
            "ratio_vs_transformers": t / ref,
            "uncached_fraction": round(1 - c / n, 3),
            "goal": "time falls with the uncached fraction",
            "goal_met": falls,
        }  # fmt: skip
        for c, t in zip(cached, times, strict=True)
    ]


def _print_table(results: list[dict]) -> None:
    print(
        f"{'case':<16} {'setting':<22} {'tokenlake':>12} {'transformers':>13} {'ratio':>6} "
        f"{'wall':>6} {'bound':>6}  goal"
    )
    for r in results:
        if r["case"] == "decode_single":
            cells = (f"ctx {r['context']}", f"{r['tokenlake_ms']:.2f} ms",
                     f"{r['transformers_ms']:.2f} ms", r["ratio"], r["ratio_wall"],
                     r["best_possible_ratio"])  # fmt: skip
        elif r["case"] == "decode_batch16":
            cells = (f"ctx {r['context']}", f"{r['tokenlake_tokens_per_s']:.0f} tok/s",
                     f"{r['transformers_tokens_per_s']:.0f} tok/s", r["ratio"], r["ratio_wall"],
                     r["best_possible_ratio"])  # fmt: skip
        else:
            cells = (f"{r['cached_fraction']:.0%} of {r['prompt_len']} cached",
                     f"{r['tokenlake_ms']:.1f} ms", f"{r['transformers_ms']:.1f} ms",
                     r["ratio_vs_uncached"], float("nan"), float("nan"))  # fmt: skip
        met = "met" if r["goal_met"] else "NOT met"
        print(
            f"{r['case']:<16} {cells[0]:<22} {cells[1]:>12} {cells[2]:>13} {cells[3]:>6.2f} "
            f"{cells[4]:>6.2f} {cells[5]:>6.2f}  {r['goal']} ({met})"
        )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="short run (CI smoke)")
    p.add_argument("--threads", type=int, default=1, help="torch and kernel threads, both sides")
    p.add_argument("--context", type=int, default=1024, help="decode_single context length")
    p.add_argument("--batch-context", type=int, default=256, help="decode_batch16 prompt length")
    p.add_argument("--prefill-len", type=int, default=1920, help="prefill_cached prompt length")
    p.add_argument("--steps", type=int, default=32, help="decode steps measured")
    p.add_argument("--repeats", type=int, default=3, help="prefill_cached rounds (best of)")
    p.add_argument("--segment-len", type=int, default=64)
    p.add_argument("--slots", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.quick:
        args.context, args.batch_context, args.prefill_len = 256, 64, 640
        args.steps, args.repeats = 8, 1
    torch.set_num_threads(args.threads)
    cpu.set_num_threads(args.threads)
    import transformers

    rng = np.random.default_rng(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        path = make_model(Path(tmp) / "llama", args.seed)
        model = LlamaModel.from_dir(path)
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(path)).eval()
    shape = ", ".join(f"{k}={v}" for k, v in SHAPE.items())
    print(
        f"bench_model: seeded Llama ({shape}), fp32, {args.threads} torch + kernel thread(s); "
        f"ratios in process CPU time, steps interleaved; load average {os.getloadavg()[0]:.1f}"
    )
    results = []
    for case in (case_decode_single, case_decode_batch, case_prefill_cached):
        rows = case(model, hf, args, rng)
        for r in rows if isinstance(rows, list) else [rows]:
            results.append({**r, "load_avg": os.getloadavg()[0]})
    _print_table(results)
    for r in results:
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
