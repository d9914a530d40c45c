"""Cross-check of the simulator's step times (the scheduler's roofline ``CostModel`` with the
harness's calibration, :class:`tokenlake.benchmarks.sim.step_timer.TimerConfig`) against published
measurements of Llama-2-7B (LWM-Text-1M's architecture) on one A100-80G.

Source: lmdeploy's "Benchmark on A100 (FP16)" (InternLM/lmdeploy, docs/en/benchmark/
a100_fp16.md, lmdeploy v0.1.0a1, TurboMind engine, llama2-7b, TP 1): first-token latency of a
single prompt (prefill) and the median per-token latency of a static batch (decode, context =
prompt + about half the output). No SGLang or vLLM per-step table for this model and GPU was
found in the sources available to us; TurboMind is a comparable paged-attention engine.

    python -m tokenlake.benchmarks.sim_crosscheck        # table + one JSON line per point; exit 1 if any > 25%
"""

from __future__ import annotations

import argparse
import json
import sys

from tokenlake.benchmarks.sim.step_timer import ClusterSpec, make_timer

SOURCE = "lmdeploy docs/en/benchmark/a100_fp16.md (llama2-7b, A100-80G, TP1, fp16)"
# (kind, batch, tokens: prefill prompt length or decode context, measured seconds)
REFERENCE = (
    ("prefill", 1, 128, 0.022),
    ("prefill", 1, 2048, 0.139),
    ("decode", 1, 64, 0.009),
    ("decode", 1, 2112, 0.010),
    ("decode", 16, 192, 0.011),
    ("decode", 64, 192, 0.014),
    ("decode", 16, 2112, 0.020),
    ("decode", 64, 2112, 0.046),
)
TOLERANCE = 0.25


def crosscheck() -> list[dict]:
    spec = ClusterSpec("A100-80G", "LWM-Text-1M", num_instances=1, tp=1)
    timer = make_timer(spec)
    rows = []
    for kind, batch, tokens, measured in REFERENCE:
        if kind == "prefill":
            modeled = timer.prefill_time([tokens] * batch, [0] * batch)
        else:
            modeled = timer.decode_time([tokens] * batch)
        err = modeled / measured - 1
        rows.append(
            {
                "kind": kind,
                "batch": batch,
                "tokens": tokens,
                "measured_ms": round(1e3 * measured, 2),
                "modeled_ms": round(1e3 * modeled, 2),
                "error": round(err, 3),
                "ok": abs(err) <= TOLERANCE,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    rows = crosscheck()
    print(f"simulator step times vs {SOURCE}")
    print(
        f"{'kind':8s} {'batch':>5s} {'tokens':>7s} {'measured':>9s} {'modeled':>9s} {'error':>7s}"
    )
    for r in rows:
        print(
            f"{r['kind']:8s} {r['batch']:>5d} {r['tokens']:>7d} {r['measured_ms']:>7.1f}ms "
            f"{r['modeled_ms']:>7.1f}ms {r['error']:>+7.1%}"
        )
    for r in rows:
        print(json.dumps(r))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
