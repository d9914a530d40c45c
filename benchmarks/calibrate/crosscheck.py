"""Cross-check of the simulator's step times (the scheduler's roofline ``CostModel`` with the
harness's calibration, :class:`tokenlake.benchmarks.sim.step_timer.TimerConfig`) against published
measurements of Llama-2-7B (LWM-Text-1M's architecture) on one A100-80G.

Source: lmdeploy's "Benchmark on A100 (FP16)" (InternLM/lmdeploy, docs/en/benchmark/
a100_fp16.md, lmdeploy v0.1.0a1, TurboMind engine, llama2-7b, TP 1): first-token latency of a
single prompt (prefill) and the median per-token latency of a static batch (decode, context =
prompt + about half the output). No SGLang or vLLM per-step table for this model and GPU was
found in the sources available to us; TurboMind is a comparable paged-attention engine.

Distributed attention (the layered pricing, :mod:`tokenlake.benchmarks.sim.systems.layered`): no
measured per-layer figure was found. The TokenLake paper (§4.2) publishes an analytic one
for its A100 testbed: the communication of one decode row over a remote segment costs
``2 x latency + 4d / B_net``, "only 4.66 us per layer" for a short request with 1,000 prefix
tokens, and a remote segment pays for itself above about 568 tokens. Both are compared here
with the simulator's own terms (one A100 per instance); they are printed, not checked (the
paper's latency is not stated and its figure is a model, not a measurement).

    python -m tokenlake.benchmarks.calibrate.crosscheck        # table + one JSON line per point; exit 1 if any step time > 25%
"""

from __future__ import annotations

import argparse
import json
import sys

from tokenlake.benchmarks.sim.step_timer import ClusterSpec, make_timer
from tokenlake.benchmarks.sim.systems.layered import LayeredPricing, PricingConfig

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
DIST_SOURCE = "TokenLake paper §4.2 (analytic model of its A100 testbed, not a measurement)"
# (what, the paper's figure, unit)
DIST_REFERENCE = (
    ("comm per layer, 1 decode row, remote segment", 4.66e-6, "s"),
    ("segment length where a remote segment pays", 568, "tokens"),
)


def dist_attention() -> list[dict]:
    """The layered pricing's per-layer communication of one decode row (q out, (o, lse)
    back, over NVLink) and the segment length whose attention time equals it, against the
    paper's analytic figures; plus the whole per-layer remote part of that row over a
    1,000-token segment (no published figure)."""
    spec = ClusterSpec("A100-80G", "LWM-Text-1M", num_instances=2, tp=1)
    timer = make_timer(spec)
    layers = LayeredPricing(spec, timer.hardware, PricingConfig())
    num_layers = spec.mp.num_layers
    comm = 2 * layers.latency + 2 * layers.o_bytes / layers.bw_near
    per_token = timer.cost.query_time(1, 100_000) / 100_000 / num_layers  # one layer's read
    segment = comm / per_token
    remote = comm + layers.launch + timer.cost.query_time(1, 1000) / num_layers
    rows = []
    for (what, paper, unit), modeled in zip(DIST_REFERENCE, (comm, segment), strict=True):
        scale = 1e6 if unit == "s" else 1
        rows.append(
            {
                "kind": "dist-attn",
                "what": what,
                "unit": "us" if unit == "s" else unit,
                "published": round(paper * scale, 2),
                "modeled": round(modeled * scale, 2),
                "error": round(modeled / paper - 1, 3),
            }
        )
    rows.append(
        {
            "kind": "dist-attn",
            "what": "remote part per layer, 1 decode row, 1,000-token segment",
            "unit": "us",
            "published": None,
            "modeled": round(remote * 1e6, 2),
            "error": None,
        }
    )
    return rows


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
    dist = dist_attention()
    print(f"\ndistributed attention (layered pricing) vs {DIST_SOURCE}; printed, not checked")
    for r in dist:
        published = "-" if r["published"] is None else f"{r['published']:g}"
        error = "" if r["error"] is None else f"{r['error']:+.0%}"
        print(f"{r['what']:58s} {published:>8s} {r['modeled']:>9g} {r['unit']:6s} {error}")
    for r in rows + dist:
        print(json.dumps(r))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
